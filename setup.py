"""Drives the CMake build (CMakeLists.txt is the one list of sources).

`pip install --no-build-isolation .` and `pip install --no-build-isolation -e .`
both end here. It builds against the installed torch, 2.11 to 2.15, and the
package requires that torch's minor release (NOTE [the torch a wheel is built
against]). Environment:
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

# NOTE [the torch a wheel is built against]
# libtorch_tp.so links torch's C++ API (c10d's Backend and Work among it), which
# changes between minor releases: a library built against one minor release does
# not load under another. So the build takes the installed torch (pip's
# --no-build-isolation), refuses one outside the supported range before compiling
# anything, and the wheel requires the minor release it was built against. pip
# then keeps the torch it built with, rather than resolving a range to another
# release and swapping it in under the finished library.
SUPPORTED_TORCH = ((2, 11), (2, 15))  # oldest and newest minor release, inclusive


def installed_torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor), or SystemExit saying what to do."""
    oldest, newest = (".".join(map(str, release)) for release in SUPPORTED_TORCH)
    try:
        import torch
    except ImportError:
        sys.exit(f"torch_tp: no torch to build against: install torch {oldest} to {newest} first, then build with "
                 "`pip install --no-build-isolation .` (an isolated build does not see the installed torch)")
    version = torch.__version__
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if not SUPPORTED_TORCH[0] <= release <= SUPPORTED_TORCH[1]:
        sys.exit(f"torch_tp: the installed torch is {version}; torch_tp supports torch {oldest} to {newest}")
    return release


TORCH_RELEASE = installed_torch_release()


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def finalize_options(self) -> None:
        super().finalize_options()
        # setuptools copies a file only where the target is older than its source, so a
        # library built against another torch (from another build directory) would stay
        # in place beside this build's; CMake already rebuilds only what changed.
        self.force = True

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
            f"-DTORCH_TP_VERSION={self.distribution.get_version()}",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        # CMake writes into a stable directory (so rebuilds are incremental and
        # the GoogleTest executables keep finding libtorch_tp.so); what the
        # package carries then goes where setuptools expects the extension.
        built = build_dir / "torch_tp"
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        module = Path(self.get_ext_filename(ext.name)).name
        for name in (module, *PACKAGE_PAYLOAD):
            self.copy_payload(built / name, output_dir / name)

    def copy_extensions_to_source(self) -> None:
        # Editable installs copy the extension module into the source tree;
        # the rest of the payload must travel with it.
        super().copy_extensions_to_source()
        for name in PACKAGE_PAYLOAD:
            self.copy_payload(Path(self.build_lib) / "torch_tp" / name, ROOT / "torch_tp" / name)

    def copy_payload(self, source: Path, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            self.copy_tree(str(source), str(target), level=self.verbose)
        else:
            self.copy_file(str(source), str(target), level=self.verbose)


# NOTE [the installed CMake package]
# Beside the Python module, the package carries what a C++ (LibTorch) program
# needs to build against it, as torch does with torch.utils.cmake_prefix_path:
#   libtorch_tp.so                      the ops, the backend, the C++ modules
#   include/torch_tp/*.h                the public headers (csrc/include)
#   share/cmake/torch_tp/               torch_tpConfig.cmake and its version file,
#                                       found through torch_tp.cmake_prefix_path
#   _build.py                           the torch it was built against, which
#                                       `import torch_tp` checks first
# CMakeLists.txt stages all of it in its output directory; this list says what
# is copied from there into the wheel (or the source tree, for -e).
PACKAGE_PAYLOAD = ("libtorch_tp.so", "include", "share", "_build.py")


setup(
    ext_modules=[CMakeExtension("torch_tp._C")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[f"torch=={TORCH_RELEASE[0]}.{TORCH_RELEASE[1]}.*"],
)
