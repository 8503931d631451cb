"""Drives the CMake build (CMakeLists.txt is the one list of sources).

`pip install --no-build-isolation .` and `pip install --no-build-isolation -e .`
both end here. Environment:
  TORCH_TP_CUDA=0|1          force the CPU-only or the CUDA build (default: CUDA
                             when torch is a CUDA build and nvcc is found)
  TORCH_TP_BUILD_TESTS=1     also build the GoogleTest executables
  TORCH_TP_BUILD_DIR=DIR     the CMake build directory (default build/cmake)
  TORCH_TP_SANITIZE=address  build with that sanitizer (give it its own
                             TORCH_TP_BUILD_DIR; see CMakeLists.txt)
  MAX_JOBS=N                 parallel compile jobs (default: all cores)
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("TORCH_TP_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        cuda = {"0": "OFF", "1": "ON"}.get(os.environ.get("TORCH_TP_CUDA", ""), "AUTO")
        tests = "ON" if os.environ.get("TORCH_TP_BUILD_TESTS") == "1" else "OFF"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DTORCH_TP_CUDA={cuda}",
            f"-DTORCH_TP_BUILD_TESTS={tests}",
            f"-DTORCH_TP_SANITIZE={os.environ.get('TORCH_TP_SANITIZE', '')}",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        # CMake writes into a stable directory (so rebuilds are incremental and
        # the GoogleTest executables keep finding libtorch_tp.so); both
        # libraries then go where setuptools expects the extension.
        built = build_dir / "torch_tp"
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        output_dir.mkdir(parents=True, exist_ok=True)
        module = Path(self.get_ext_filename(ext.name)).name
        for name in ("libtorch_tp.so", module):
            self.copy_file(str(built / name), str(output_dir / name), level=self.verbose)

    def copy_extensions_to_source(self) -> None:
        # Editable installs copy the extension module into the source tree;
        # the library it links must travel with it.
        super().copy_extensions_to_source()
        built = Path(self.build_lib) / "torch_tp" / "libtorch_tp.so"
        self.copy_file(str(built), str(ROOT / "torch_tp" / built.name), level=self.verbose)


setup(ext_modules=[CMakeExtension("torch_tp._C")], cmdclass={"build_ext": CMakeBuild})
