#!/usr/bin/env bash
# Create .venv and install the project. Idempotent: a second run only checks.
# On the project's CPU machines torch==2.13.0 comes from local disk; elsewhere set TORCH_SPEC
# (e.g. TORCH_SPEC="torch>=2.5" on a CUDA cluster) or pre-install torch in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
# torch first, so the project's `torch>=2.5` is already satisfied and no CUDA build is pulled.
python -c "import torch" 2>/dev/null || python -m pip install --quiet "$TORCH_SPEC"
python -m pip install --quiet -e ".[${EXTRAS}]"
echo "setup: $(python -c 'import torch, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")') in $VENV"
