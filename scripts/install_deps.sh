# Sourced by setup_env.sh and run_tests.sh: installs what building torch_tp
# needs on a fresh machine and sets PYTHON.
set -euo pipefail

PYTHON=${PYTHON:-python3}

# torch: keep an installed one that torch_tp supports (setup.py refuses any
# other, naming it); with none, the newest supported release, which is what
# `pip install torch` gives a new user (scripts/torch-newest.txt).
# --no-build-isolation then builds against exactly this torch.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -r "$(dirname "${BASH_SOURCE[0]}")/torch-newest.txt"
fi
"$PYTHON" -m pip install -q "cmake>=3.22" ninja setuptools wheel
