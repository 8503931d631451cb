#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs every test against what
# `pip install` gives a user, with one C++ build:
#   1. an sdist, and the wheel built from it (so a file missing from the sdist
#      fails the build), with the GoogleTest executables in the same build;
#   2. ctest on those executables;
#   3. the wheel in a fresh virtual environment that reuses the installed
#      torch, and pytest, from a copy of test/ and examples/ outside the
#      source tree (so `import torch_tp` can only find the wheel): the whole
#      suite with its ranks on the torch_tp backend, then the ops' files again
#      on gloo (the ops reach gloo through c10d, the torch_tp backend directly);
#   4. examples/cpp built with CMake against the installed package
#      (find_package(torch_tp)) and trained under torchrun --no-python.
# Every step runs even if one fails; the exit status is non-zero if any did.
# Work goes to build/installed, removed and remade on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s libgtest-dev >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null
fi
source scripts/install_deps.sh
"$PYTHON" -m pip install -q pytest numpy expecttest hypothesis build transformers==5.24.0

WORK="$PWD/build/installed"
rm -rf "$WORK"
mkdir -p "$WORK"
phase() { echo "== $1 (at ${SECONDS} s)"; }

phase "sdist, and the wheel built from it with the GoogleTest executables"
"$PYTHON" -m build --sdist --no-isolation --outdir "$WORK/dist" . > "$WORK/sdist.log" 2>&1 || { cat "$WORK/sdist.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/torch_tp-*.tar.gz)
# A build directory of its own: the wheel must not reuse the checkout's objects.
if ! TORCH_TP_BUILD_TESTS=1 TORCH_TP_BUILD_DIR="$WORK/build" "$PYTHON" -m pip wheel --no-cache-dir \
    --no-build-isolation --no-deps -w "$WORK/dist" "$SDIST" > "$WORK/wheel.log" 2>&1; then
  cat "$WORK/wheel.log"
  exit 1
fi
WHEEL=$(ls "$WORK"/dist/torch_tp-*.whl)
echo "$(basename "$SDIST"), $(basename "$WHEEL")"
if grep -E "warning:" "$WORK/wheel.log"; then echo "(compiler warnings above)"; fi

status=0
phase "ctest"
# The GoogleTest executables, as many at once as there are cores (each shm segment's name carries
# a random group token, so concurrent executables never share one).
ctest --test-dir "$WORK/build" --output-on-failure --timeout 300 --parallel "$(nproc)" || status=1

phase "a fresh virtual environment with the wheel"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VENV_PYTHON="$WORK/venv/bin/python"
# --no-deps: the venv's own older setuptools shadows the system's, which torch's
# metadata would have pip replace; test_package.py checks that the wheel's one
# requirement is the running torch's minor release.
"$VENV_PYTHON" -m pip install -q --no-deps "$WHEEL"
mkdir -p "$WORK/src"
# setup.py too: test_package.py checks what it refuses before building.
cp -r test examples setup.py "$WORK/src/"
cd "$WORK/src/test"
"$VENV_PYTHON" - "$WORK/venv" <<'PY'
import os, sys
import torch_tp
where = os.path.realpath(torch_tp.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"torch_tp imported from {where}, not the wheel"
print("torch_tp imported from", os.path.dirname(where))
PY

# Both pytest runs compile the same graphs: one torch.compile cache for them, made with this build.
export TORCH_TP_TEST_COMPILE_CACHE="$WORK/compile-cache"
phase "pytest, ranks on the torch_tp backend"
TORCH_TP_TEST_BACKEND=torch_tp "$VENV_PYTHON" -m pytest -q -rs -p no:cacheprovider . || status=1
phase "pytest, the ops on gloo"
TORCH_TP_TEST_BACKEND=gloo "$VENV_PYTHON" -m pytest -q -rs -p no:cacheprovider \
  test_collectives.py test_moe_ops.py test_linear.py test_fuzz.py || status=1

phase "examples/cpp built against the installed package"
PREFIX=$("$VENV_PYTHON" -c "import torch_tp; print(torch_tp.cmake_prefix_path)")
cmake -S "$WORK/src/examples/cpp" -B "$WORK/example-cpp" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" \
  > "$WORK/example-cpp.log" 2>&1 || { cat "$WORK/example-cpp.log"; exit 1; }
cmake --build "$WORK/example-cpp" >> "$WORK/example-cpp.log" 2>&1 || { cat "$WORK/example-cpp.log"; exit 1; }
for ranks in 2 3; do
  # torchrun, from the environment's Python (a venv reusing the system's torch has no torchrun script);
  # its logs under $WORK, not a /tmp/torchelastic_* of its own
  "$VENV_PYTHON" -m torch.distributed.run --log-dir "$WORK/torchrun-logs" --nproc-per-node "$ranks" --no-python \
    "$WORK/example-cpp/train_tp_mlp" \
    2> "$WORK/torchrun.log" | tail -n 1 || { cat "$WORK/torchrun.log"; status=1; }
done
phase "done"
exit $status
