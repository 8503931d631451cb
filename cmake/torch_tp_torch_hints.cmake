# The hints find_package(Torch) needs to find the LibTorch inside a torch
# wheel on a machine whose CUDA toolkit is bare. Shared by torch_tp's own build
# (CMakeLists.txt) and by the CMake package it installs (torch_tpConfig.cmake),
# so a C++ program built against an installed torch_tp finds Torch the same way.
#
#   torch_tp_torch_hints(<torch's cmake prefix> <torch's CUDA version, "" for a CPU build>)
#
# Sets, in the caller's scope:
#   CMAKE_PREFIX_PATH          + the torch cmake prefix
#   TORCH_TP_NVCC              the nvcc found (CUDA_HOME, /usr/local/cuda, PATH)
#   CUDAToolkit_ROOT, CUDA_TOOLKIT_ROOT_DIR
#                              the toolkit that nvcc belongs to: torch's CMake
#                              config finds CUDA from the root, and a wrapper
#                              script on PATH would point it at the wrong prefix
#   TORCH_TP_SITE_PACKAGES     the site-packages directory holding torch
#   TORCH_TP_CUDA_MAJOR        "13" for CUDA 13.x, empty for a CPU torch
#   CUDA_nvrtc_LIBRARY         a CUDA torch's CMake config links nvrtc; a bare
#                              toolkit may lack it, the wheel's nvidia packages
#                              carry it (only as libnvrtc.so.<major>)
macro(torch_tp_torch_hints torch_cmake_prefix torch_cuda_version)
  list(APPEND CMAKE_PREFIX_PATH "${torch_cmake_prefix}")
  get_filename_component(TORCH_TP_SITE_PACKAGES "${torch_cmake_prefix}/../../.." ABSOLUTE)
  find_program(TORCH_TP_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
  if(TORCH_TP_NVCC AND NOT CUDAToolkit_ROOT)
    get_filename_component(_torch_tp_cuda_bin "${TORCH_TP_NVCC}" DIRECTORY)
    get_filename_component(CUDA_TOOLKIT_ROOT_DIR "${_torch_tp_cuda_bin}" DIRECTORY)
    set(CUDAToolkit_ROOT "${CUDA_TOOLKIT_ROOT_DIR}")
  endif()
  set(TORCH_TP_CUDA_MAJOR "")
  if(NOT "${torch_cuda_version}" STREQUAL "")
    string(REGEX MATCH "^[0-9]+" TORCH_TP_CUDA_MAJOR "${torch_cuda_version}")
    find_library(CUDA_nvrtc_LIBRARY
      NAMES nvrtc "libnvrtc.so.${TORCH_TP_CUDA_MAJOR}"
      HINTS "${CUDA_TOOLKIT_ROOT_DIR}/lib64"
            "${TORCH_TP_SITE_PACKAGES}/nvidia/cu${TORCH_TP_CUDA_MAJOR}/lib"
            "${TORCH_TP_SITE_PACKAGES}/nvidia/cuda_nvrtc/lib")
  endif()
endmacro()
