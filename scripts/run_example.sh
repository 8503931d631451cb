#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: a 2-rank
# torchrun example that trains a tensor-parallel MLP with the torch_tp ops
# and checks it against the unsharded model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 examples/tp_mlp.py "$@"
