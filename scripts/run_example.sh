#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: a small
# Llama-style model trained with torchtitan's tensor-parallel plan (sequence
# parallel, vocab-parallel loss) on 2 torchrun ranks with torch_tp.
# Arguments go to examples/train_llama.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PYTHON" -m pip install -q matplotlib   # the loss-curve PNG
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 examples/train_llama.py "$@"
