#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every test: the GoogleTest
# executables under ctest, then pytest. Both run even if the first fails; the
# exit status is non-zero if either failed.
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
"$PYTHON" -m pip install -q pytest numpy expecttest

status=0
ctest --test-dir build/cmake --output-on-failure --timeout 300 || status=1
"$PYTHON" -m pytest test -q -rs || status=1
exit $status
