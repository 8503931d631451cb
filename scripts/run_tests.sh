#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every test: the GoogleTest
# executables under ctest, then pytest on gloo, then the communicating tests
# again on the torch_tp backend, then what `pip install` gives a user (the
# wheel from the sdist in a fresh virtual environment, and the C++ example
# built against it: scripts/test_installed_package.sh). All run even if one
# fails; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s libgtest-dev >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null
fi

export TORCH_TP_BUILD_TESTS=1
source scripts/setup_env.sh
"$PYTHON" -m pip install -q pytest numpy expecttest hypothesis

status=0
ctest --test-dir build/cmake --output-on-failure --timeout 300 || status=1
"$PYTHON" -m pytest test -q -rs || status=1
# The ops, the TP module API, DDP and the composition with DCP and FSDP2 once
# more with torch_tp's own backend under them (the backend's own tests above
# already run on it).
TORCH_TP_TEST_BACKEND=torch_tp "$PYTHON" -m pytest -q -rs \
  test/test_collectives.py test/test_linear.py test/test_parallelize.py test/test_ddp.py \
  test/test_compose.py || status=1
PYTHON="$PYTHON" bash scripts/test_installed_package.sh || status=1
exit $status
