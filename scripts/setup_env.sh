# Sourced by run_example.sh: installs what building torch_tp needs on a fresh
# machine, then builds and installs torch_tp editable, so the CMake build
# directory build/cmake is shared by the example and later rebuilds. Set
# TORCH_TP_BUILD_TESTS=1 before sourcing to build the GoogleTest executables
# too (a developer's loop; scripts/run_tests.sh builds its own).
set -euo pipefail
source scripts/install_deps.sh

mkdir -p build
if ! "$PYTHON" -m pip install --no-build-isolation -e . > build/install.log 2>&1; then
  cat build/install.log
  echo "torch_tp: build failed (log above, also in build/install.log)" >&2
  exit 1
fi
tail -n 1 build/install.log
