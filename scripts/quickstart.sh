#!/usr/bin/env bash
# The README's main command: set up, then train a tiny Llama on the embedded corpus on 2 processes
# (1 on a one-GPU machine)
# with dense AdamS, SCAPE-99 and sparse model averaging at SCAPE-99's bytes, and compare validation loss and bytes sent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# Two ranks where that is cheap: 2 CPU processes (gloo), or one per GPU up to 2. A one-GPU machine
# runs one process (two would both need cuda:0); for two ranks there, train on the CPU:
#   NPROC=2 bash scripts/quickstart.sh train.device=cpu
GPUS=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [[ " $* " == *" train.device=cpu "* ]]; then GPUS=0; fi
if [ -z "${NPROC:-}" ]; then
  if [ "$GPUS" -ge 1 ]; then NPROC=$(( GPUS < 2 ? GPUS : 2 )); else NPROC=2; fi
fi
if [ "$GPUS" -eq 1 ] && [ "$NPROC" -eq 1 ]; then
  echo "quickstart: one GPU, so one process; for two ranks on the CPU: NPROC=2 bash scripts/quickstart.sh train.device=cpu"
fi
runs=()
for exp in tiny_adams tiny_scape99 tiny_sma99; do
  [ -f "conf/experiment/$exp.yaml" ] || continue
  run_name="$exp-$(date +%Y%m%d-%H%M%S)"
  torchrun --standalone --nproc_per_node "$NPROC" train.py "+experiment=$exp" "run_name=$run_name" "$@"
  runs+=("runs/$run_name")
done
echo
python scripts/compare_runs.py "${runs[@]}"
