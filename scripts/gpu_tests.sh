#!/usr/bin/env bash
# The GPU tests (marker `gpu`) on a machine with a CUDA device, in one call: set up if needed (setup.sh keeps the
# machine's own CUDA torch), refuse to "pass" where no device is visible (the tests would only skip), run them.
# Extra arguments go to pytest, e.g. `bash scripts/gpu_tests.sh -x -v`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || QUIET=1 bash scripts/setup.sh
.venv/bin/python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to torch {torch.__version__}: the GPU tests would only skip")
print(f"gpu tests on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})")
PY
exec .venv/bin/python -m pytest -m gpu -n 0 -p no:cacheprovider "$@"
