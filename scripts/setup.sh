#!/usr/bin/env bash
# Set up p2p-diloco in ./.venv. Keeps a torch that is already installed (e.g. a CUDA build on a GPU
# machine); on a machine without a GPU it installs a CPU-only torch, never gigabytes of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
QUIET=${QUIET:-}

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: keeping the torch installed for $PY"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip() { python -m pip ${QUIET:+-q} "$@"; }

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch from PyPI (CUDA build)"
    pip install torch
  else
    echo "setup: no GPU, installing a CPU-only torch"
    # A local or mirrored CPU wheel first (pip's configured find-links), else PyTorch's CPU index.
    # (Plain `pip install torch` from PyPI would pull the CUDA build: never that here.)
    pip install "torch==2.13.0+cpu" 2>/dev/null \
      || pip install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install -e ".[dev]"
python -c "from p2p_diloco.train.data.tokens import stdlib_token_dataset as s; print('setup: stdlib token dataset', s())" \
  || echo "setup: could not pre-build the stdlib token dataset (needs the tokenizers package); built on first use"
echo "setup: done. Try: .venv/bin/p2p-diloco --help"
