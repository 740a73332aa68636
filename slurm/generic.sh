#!/usr/bin/env bash
# Pretraining on any Slurm cluster: one torchrun per node, one process per GPU.
#
#   sbatch -N 4 --gpus-per-node=8 slurm/generic.sh +experiment=llama500m_adamw
#   SCAPE_GPUS_PER_NODE=4 sbatch -N 2 -p PARTITION slurm/generic.sh +experiment=gpt345m_adamw
#   SCAPE_CPU=1 SCAPE_NPROC_PER_NODE=2 sbatch slurm/generic.sh +experiment=tiny_adamw logger=console
#
# The same launcher as slurm/vista.sh (slurm/launch_common.sh): same run directory, signal,
# requeue and resume behaviour; see docs/CLUSTER.md. What differs between sites goes in
# #SBATCH lines or sbatch flags (partition, account, how GPUs and CPUs are requested) and in:
#   SCAPE_GPUS_PER_NODE  processes per node in GPU mode (default: --gpus-per-node if given,
#                        else the GPUs nvidia-smi lists on the first node)
#   SCAPE_MODULES        modules to `module load` before activating the venv (default: none)
#SBATCH -J scape
#SBATCH -N 1
#SBATCH --ntasks-per-node=1
#SBATCH -t 24:00:00
#SBATCH -o %x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# Many sites need the GPUs and CPUs of the single task per node asked for explicitly:
##SBATCH --gpus-per-node=8
##SBATCH --cpus-per-task=32
##SBATCH -p PARTITION
##SBATCH -A ACCOUNT
set -euo pipefail

# sbatch runs a copy of this file from a spool directory, so there the repository is the
# submit directory; run directly (`bash slurm/generic.sh` inside salloc/idev) it is this file's parent.
if [[ -z ${SCAPE_ROOT:-} ]]; then
    if [[ -f $(dirname "$0")/launch_common.sh ]]; then
        SCAPE_ROOT=$(cd "$(dirname "$0")/.." && pwd)
    else
        SCAPE_ROOT=${SLURM_SUBMIT_DIR:-$PWD}
    fi
fi
export SCAPE_ROOT
[[ -f $SCAPE_ROOT/slurm/launch_common.sh ]] \
    || { echo "generic.sh: $SCAPE_ROOT is not the repository; submit from its root or set SCAPE_ROOT" >&2; exit 1; }
# shellcheck source=slurm/launch_common.sh
source "$SCAPE_ROOT/slurm/launch_common.sh"

scape_site_setup() {
    if [[ -n ${SCAPE_MODULES:-} ]]; then
        set +u
        # shellcheck disable=SC2086
        module load $SCAPE_MODULES
        set -u
    fi
    if [[ -z ${SCAPE_GPUS_PER_NODE:-} ]]; then
        # --gpus-per-node may carry a type ("a100:4"); the count is after the last colon.
        if [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then
            SCAPE_GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}
        elif command -v nvidia-smi >/dev/null; then
            SCAPE_GPUS_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
        fi
        [[ ${SCAPE_GPUS_PER_NODE:-0} -ge 1 ]] \
            || scape__die "no GPUs found: set SCAPE_GPUS_PER_NODE or --gpus-per-node (or SCAPE_CPU=1)"
        export SCAPE_GPUS_PER_NODE
    fi
}

scape_launch "$@"
