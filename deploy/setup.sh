#!/usr/bin/env bash
# Create .venv and install omnistream with its test extras from this checkout.
# torch is installed first as the CPU build (torch==2.13.0 lies on the dev/CI machines' disk);
# on a GPU host, install your CUDA torch first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${OMNISTREAM_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test,fast]"
