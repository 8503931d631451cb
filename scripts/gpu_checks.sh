#!/usr/bin/env bash
# The checks that need a GPU, in one go, for a machine lent for minutes:
# build torch_tp against that machine's torch, run every CUDA test, run the
# CUDA tests of the linear ops under compute-sanitizer, benchmark the linear
# ops against nn.Linear and the device's own ceilings, and run the main job
# and the generation example on the GPU (one rank: NCCL takes one GPU per
# rank).
#
#   bash scripts/gpu_checks.sh [LOG_DIR]        (default: build/gpu)
#
# It uses the python3 on PATH and the torch installed there, as a GPU image
# carries one (no virtual environment, nothing downloaded). LOG_DIR receives
# build.log, tests.log, examples.log, sanitizer.log and the benchmarks' JSON
# and plots; turn a JSON into its RESULTS.md section with
#   python benchmarks/report.py LOG_DIR/bfloat16/linear_gpu.json --results-md benchmarks/RESULTS.md
# (and LOG_DIR/float32/linear_gpu_float32.json).
# Exit status: nonzero when the build, a test, a benchmark, an example or the
# sanitizer failed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=$(mkdir -p "${1:-build/gpu}" && cd "${1:-build/gpu}" && pwd)
PYTHON=${PYTHON:-python3}
status=0
phase() { echo "=== $* ($(date +%T))"; }

phase "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
"$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
      'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"

phase "build"
if ! "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . >"$LOG_DIR/build.log" 2>&1; then
  tail -40 "$LOG_DIR/build.log"
  exit 1
fi

phase "CUDA tests"
(cd test && "$PYTHON" -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors -k cuda \
  test_linear.py test_collectives.py test_compose.py) 2>&1 | tee "$LOG_DIR/tests.log" || status=1

phase "benchmarks"
for dtype in bfloat16 float32; do
  "$PYTHON" benchmarks/bench_linear_gpu.py --dtype "$dtype" --no-results-md --out-dir "$LOG_DIR/$dtype" \
    2>&1 | tail -20 || status=1
done

# The examples as a user runs them, on one GPU: a short training run (bf16
# autocast, DCP checkpoint), then generation from that checkpoint.
phase "examples on CUDA"
RUN_DIR=$(mktemp -d)
PYTHONUNBUFFERED=1 timeout 300 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 examples/train_llama.py \
  --device cuda --amp --steps 40 --out-dir "$RUN_DIR" >"$LOG_DIR/examples.log" 2>&1 &&
  PYTHONUNBUFFERED=1 timeout 120 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 examples/generate.py \
    --device cuda --out-dir "$RUN_DIR" --max-new-tokens 64 >>"$LOG_DIR/examples.log" 2>&1 || status=1
tail -12 "$LOG_DIR/examples.log"
rm -rf "$RUN_DIR"

# memcheck over the cuBLASLt path (fused epilogues, misaligned, offset and
# non-contiguous operands): the CUDA linear checks in one process of world
# size 1, without the tests' process pool, so the sanitizer sees every launch.
phase "compute-sanitizer"
if command -v compute-sanitizer >/dev/null; then
  (cd test && timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$PYTHON" -c "
import tempfile, torch.distributed as dist
import test_linear as t
with tempfile.TemporaryDirectory() as store:
    dist.init_process_group('gloo', init_method=f'file://{store}/store', rank=0, world_size=1)
    for check in (t._check_cuda_linear, t._check_cuda_offsets, t._check_cuda_non_contiguous):
        t._restoring_matmul_settings(check)
        print(check.__name__, 'passed', flush=True)
    dist.destroy_process_group()
") >"$LOG_DIR/sanitizer.log" 2>&1 || status=1
  tail -15 "$LOG_DIR/sanitizer.log"
else
  echo "compute-sanitizer not found: skipped"
fi

phase "done, status $status"
exit $status
