#!/usr/bin/env bash
# The README's test command: set up, then run the whole test suite (fast tests, the slow
# fault-injection tests, and the end-to-end Slurm check when root can install Slurm).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
python -m pytest -q -m "not slow" "$@"
python -m pytest -q -m slow "$@" || { rc=$?; [ $rc -eq 5 ] || exit $rc; }  # 5: no slow tests selected
if [ -f scripts/ci_slurm.sh ] && [ "$(id -u)" = 0 ] && [ "${SKIP_SLURM:-0}" != 1 ]; then
  bash scripts/ci_slurm.sh
fi
