# Sourced by run_example.sh and run_tests.sh: installs what building torch_tp
# needs on a fresh machine, then builds and installs torch_tp (editable, so the
# CMake build directory build/cmake is shared by the example, the tests and
# later rebuilds). Set TORCH_TP_BUILD_TESTS=1 before sourcing to build the
# GoogleTest executables too.
set -euo pipefail

PYTHON=${PYTHON:-python3}

# torch: keep an installed 2.11-2.14; otherwise the CUDA build of 2.14.1 (from
# the local wheel cache where there is one). --no-build-isolation below builds
# against exactly this torch.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install torch==2.14.1
fi
"$PYTHON" -m pip install -q "cmake>=3.22" ninja setuptools wheel

mkdir -p build
if ! "$PYTHON" -m pip install --no-build-isolation -e . > build/install.log 2>&1; then
  cat build/install.log
  echo "torch_tp: build failed (log above, also in build/install.log)" >&2
  exit 1
fi
tail -n 1 build/install.log
