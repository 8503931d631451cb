# Sourced by setup_env.sh and run_tests.sh: installs what building torch_tp
# needs on a fresh machine and sets PYTHON.
set -euo pipefail

PYTHON=${PYTHON:-python3}

# torch: keep an installed 2.11-2.14; otherwise the CUDA build of 2.14.1 (from
# the local wheel cache where there is one). --no-build-isolation builds
# against exactly this torch.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install torch==2.14.1
fi
"$PYTHON" -m pip install -q "cmake>=3.22" ninja setuptools wheel
