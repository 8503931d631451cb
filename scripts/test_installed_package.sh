#!/usr/bin/env bash
# Tests what `pip install` gives a user, not the editable checkout: builds an
# sdist, builds the wheel from that sdist (so a file missing from the sdist
# fails the build), installs the wheel into a fresh virtual environment that
# reuses the installed torch, and from a directory outside the source tree
#   - runs a part of the test suite against it: the collective ops,
#     parallelize_module, DDP and the torch_tp backend, multi-rank;
#   - builds examples/cpp with CMake against the installed package
#     (find_package(torch_tp) through torch_tp.cmake_prefix_path) and trains it
#     with torchrun --no-python at 2 and 3 ranks.
# Called by run_tests.sh after setup_env.sh; usable alone once that has run.
# Leaves its work in build/installed (removed and remade on every run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK="$PWD/build/installed"
rm -rf "$WORK"
mkdir -p "$WORK"

"$PYTHON" -m pip install -q build
echo "== sdist, and the wheel built from it"
"$PYTHON" -m build --sdist --no-isolation --outdir "$WORK/dist" . > "$WORK/sdist.log" 2>&1 || { cat "$WORK/sdist.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/torch_tp-*.tar.gz)
# A build directory of its own: the wheel must not reuse the checkout's objects.
if ! TORCH_TP_BUILD_DIR="$WORK/wheel-build" "$PYTHON" -m pip wheel --no-cache-dir --no-build-isolation --no-deps \
    -w "$WORK/dist" "$SDIST" > "$WORK/wheel.log" 2>&1; then
  cat "$WORK/wheel.log"
  exit 1
fi
WHEEL=$(ls "$WORK"/dist/torch_tp-*.whl)
echo "$(basename "$SDIST"), $(basename "$WHEEL")"

echo "== a fresh virtual environment with the wheel"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VENV_PYTHON="$WORK/venv/bin/python"
"$VENV_PYTHON" -m pip install -q --no-deps "$WHEEL"

# The tests and the example model they import, without the package source:
# from here `import torch_tp` can only find the installed wheel.
mkdir -p "$WORK/src"
cp -r test examples "$WORK/src/"
cd "$WORK/src/test"
"$VENV_PYTHON" - "$WORK/venv" <<'PY'
import os, sys
import torch_tp
where = os.path.realpath(torch_tp.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"torch_tp imported from {where}, not the wheel"
print("torch_tp imported from", os.path.dirname(where))
PY

echo "== tests against the installed package"
status=0
"$VENV_PYTHON" -m pytest -q -p no:cacheprovider test_collectives.py test_parallelize.py test_ddp.py \
  test_backend.py || status=1

echo "== examples/cpp built against the installed package"
PREFIX=$("$VENV_PYTHON" -c "import torch_tp; print(torch_tp.cmake_prefix_path)")
cmake -S "$WORK/src/examples/cpp" -B "$WORK/example-cpp" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" \
  > "$WORK/example-cpp.log" 2>&1 || { cat "$WORK/example-cpp.log"; exit 1; }
cmake --build "$WORK/example-cpp" >> "$WORK/example-cpp.log" 2>&1 || { cat "$WORK/example-cpp.log"; exit 1; }
for ranks in 2 3; do
  # torchrun, from the environment's Python (a venv reusing the system's torch has no torchrun script)
  "$VENV_PYTHON" -m torch.distributed.run --nproc-per-node "$ranks" --no-python "$WORK/example-cpp/train_tp_mlp" \
    2> "$WORK/torchrun.log" | tail -n 1 || { cat "$WORK/torchrun.log"; status=1; }
done
exit $status
