#!/usr/bin/env bash
# One prepared check of a machine with one GPU, under 10 minutes on an H100; exits non-zero on any miss.
#
#   bash scripts/gpu_check.sh                      # from anywhere, in the project's venv
#   bash scripts/gpu_check.sh --out FILE.json      # default docs/results/gpu_check.json (GPU_CHECK_OUT)
#   bash scripts/gpu_check.sh --dry                # every part on the CPU at tiny sizes (GPU_CHECK_DRY=1);
#                                                  # default output outputs/gpu_check_dry.json
#
# The parts (scripts/gpu_check.py, one function each), each in a fresh process with its own timeout:
#   attention           SDPA (fp32, bf16) and flash-attn (where installed) against float64, forward and
#                       gradients, MHA and GQA, on fixed inputs; a non-causal control must be caught
#   loss                the fused and the standard loss against float64 (loss, both gradients), fp32 and bf16
#   nan_probe           NaN (CUDA's 0x7FFFFFFF and 0xFFFFFFFF, the CPU's) and +-Inf through every SCAPE
#                       kernel (scape/kernels): they stay non-finite, as in the PyTorch reference
#   sync_audit          one SCAPE-99 and one sparse-averaging step under set_sync_debug_mode("error")
#   offload             SCAPE-99 with the residual offloaded equals it on the device, bit for bit
#   llama500m_eager     AdamW steps: MFU >= 25% (H100/GH200), peak memory within 25% of the pre-flight
#   llama500m_compiled  the same compiled (train.compile): MFU >= 38%
#   llama1_8b_adamw     two steps, activation checkpointing, compiled; peak memory against the estimate
#   llama1_8b_scape99   two SCAPE-99 steps, activation checkpointing; peak memory against the estimate
# Every part's checks, measurements and limits go to the JSON; the summary names each miss.
# Without CUDA (and without --dry) it refuses at once (exit 2) with the torch build it found and the fix.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=${GPU_CHECK_DRY:-0}
out=${GPU_CHECK_OUT:-}
while (($#)); do
    case "$1" in
        --dry) dry=1 ;;
        --out) [[ $# -ge 2 ]] || { echo "gpu_check: --out needs a path" >&2; exit 2; }; out=$2; shift ;;
        --out=*) out=${1#--out=} ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (expected --dry, --out PATH or --help)" >&2; exit 2 ;;
    esac
    shift
done
if [[ $dry == 1 ]]; then
    out=${out:-outputs/gpu_check_dry.json}
    dry_flag=(--dry)
else
    out=${out:-docs/results/gpu_check.json}
    dry_flag=()
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-disabled}

if [[ $dry != 1 ]]; then
    python - <<'PY' || exit 2
import sys
import torch
from core.distributed import cuda_unavailable_message
if not torch.cuda.is_available():
    print("gpu_check: " + cuda_unavailable_message().replace("train.device=cuda but ", "")
          + " (or run the parts on the CPU with --dry)", file=sys.stderr)
    sys.exit(2)
from core.distributed import DistEnv, runtime_summary
print("gpu_check: " + runtime_summary(DistEnv(0, 1, 0, torch.device("cuda", 0)), "cuda"))
PY
fi

parts=$(python -m scripts.gpu_check parts) || { echo "gpu_check: cannot list the parts" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
while read -r part timeout_s; do
    echo "=== gpu_check: $part (at most ${timeout_s} s) ==="
    timeout --kill-after=15 "$timeout_s" \
        python -m scripts.gpu_check run "$part" --out "$work/$part.json" "${dry_flag[@]}"
    echo $? > "$work/$part.rc"
done <<< "$parts"

echo
python -m scripts.gpu_check report --out "$out" --parts-dir "$work" --wall-s $((SECONDS - start)) "${dry_flag[@]}"
status=$?
echo "gpu_check: results in $out"
if ((status)); then
    echo "gpu_check: FAILED" >&2
    exit 1
fi
echo "gpu_check: all parts passed"
