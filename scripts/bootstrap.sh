#!/usr/bin/env bash
# Create .venv (if missing) and install rwkv-clip with its test and DALI extras.
# Idempotent: a second run only re-checks the install. Works without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
EXTRAS=${RWKV_CLIP_EXTRAS:-dev,dali}
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[${EXTRAS}]"
.venv/bin/python -c "import rwkv_clip, torch; print(f'rwkv_clip {rwkv_clip.__version__} ready (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})')"
