#!/usr/bin/env bash
# The README's main command: set up, then train a tiny Llama on the embedded corpus on 2 processes
# with dense AdamS, SCAPE-99 and sparse model averaging at 99%, and compare validation loss and bytes sent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
NPROC=${NPROC:-2}
runs=()
for exp in tiny_adams tiny_scape99 tiny_sma99; do
  [ -f "conf/experiment/$exp.yaml" ] || continue
  run_name="$exp-$(date +%Y%m%d-%H%M%S)"
  torchrun --standalone --nproc_per_node "$NPROC" train.py "+experiment=$exp" "run_name=$run_name" "$@"
  runs+=("runs/$run_name")
done
echo
python scripts/compare_runs.py "${runs[@]}"
