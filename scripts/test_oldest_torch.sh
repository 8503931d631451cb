#!/usr/bin/env bash
# The other end of the supported range: run_tests.sh runs everything on the
# installed torch (on a fresh machine the newest, scripts/torch-newest.txt);
# this builds torch_tp against the
# oldest one, 2.11, in a virtual environment of its own, and runs the tests
# that reach furthest into torch's API there: the package and its private
# torch symbols, the ops, the sharded linears and parallelize_module. The wheel
# is the CPU build (TORCH_TP_CUDA=0): run_tests.sh compiles the CUDA sources.
# CI (.ci/run) runs it after run_tests.sh. Work goes to build/oldest-torch,
# removed and remade on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OLDEST_TORCH=2.11.0

WORK="$PWD/build/oldest-torch"
rm -rf "$WORK"
mkdir -p "$WORK"
phase() { echo "== $1 (at ${SECONDS} s)"; }

phase "torch $OLDEST_TORCH in a fresh virtual environment"
"$PYTHON" -m venv "$WORK/venv"
VENV_PYTHON="$WORK/venv/bin/python"
"$VENV_PYTHON" -m pip install -q "torch==$OLDEST_TORCH" "cmake>=3.22" ninja setuptools wheel \
  pytest numpy expecttest hypothesis

phase "the wheel, built against it"
if ! TORCH_TP_CUDA=0 TORCH_TP_BUILD_DIR="$WORK/build" "$VENV_PYTHON" -m pip wheel --no-cache-dir \
    --no-build-isolation --no-deps -w "$WORK/dist" . > "$WORK/wheel.log" 2>&1; then
  cat "$WORK/wheel.log"
  exit 1
fi
WHEEL=$(ls "$WORK"/dist/torch_tp-*.whl)
# --no-index: the wheel's torch requirement must be met by the torch it was built against.
"$VENV_PYTHON" -m pip install -q --no-index "$WHEEL"
mkdir -p "$WORK/src"
cp -r test examples setup.py "$WORK/src/"

phase "pytest on torch $OLDEST_TORCH, ranks on the torch_tp backend"
cd "$WORK/src/test"
TORCH_TP_TEST_BACKEND=torch_tp "$VENV_PYTHON" -m pytest -q -rs -p no:cacheprovider \
  test_package.py test_torch_private.py test_collectives.py test_linear.py test_parallelize.py
