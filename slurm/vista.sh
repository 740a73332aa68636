#!/usr/bin/env bash
# Pretraining on TACC Vista's GH200 nodes: one GPU per node, so N GPUs is `-N N`.
#
#   sbatch slurm/vista.sh +experiment=llama500m_adamw                  # 1 GH200
#   sbatch -N 32 -t 48:00:00 slurm/vista.sh +experiment=llama500m_scape99
#   sbatch -p gh-dev -N 2 -t 00:30:00 slurm/vista.sh +experiment=tiny_adamw
#   SCAPE_CPU=1 sbatch slurm/vista.sh +experiment=tiny_adamw logger=console   # no GPU
#
# Submit from the repository root. Every argument is a Hydra override for train.py. The run
# directory is $SCAPE_OUT_DIR/<experiment>-<job id> (default $SCRATCH/scape-sdp/runs, else
# ./runs); the log is ./<job name>-<job id>.out. About 5 minutes before the time limit Slurm
# sends SIGUSR1, train.py checkpoints and exits, and the job requeues itself and resumes from
# that checkpoint (resume=auto). docs/CLUSTER.md has the details and all the settings.
#
# Edit these or override them on the sbatch command line. Vista rejects --gres, --mem and
# --gpus-per-task: do not add them. Uncomment -A if you have more than one allocation.
#SBATCH -J scape
#SBATCH -p gh
#SBATCH -N 1
#SBATCH --ntasks-per-node=1
#SBATCH -t 24:00:00
#SBATCH -o %x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
##SBATCH -A YOUR_PROJECT
set -euo pipefail

# sbatch runs a copy of this file from a spool directory, so there the repository is the
# submit directory; run directly (`bash slurm/vista.sh` inside salloc/idev) it is this file's parent.
if [[ -z ${SCAPE_ROOT:-} ]]; then
    if [[ -f $(dirname "$0")/launch_common.sh ]]; then
        SCAPE_ROOT=$(cd "$(dirname "$0")/.." && pwd)
    else
        SCAPE_ROOT=${SLURM_SUBMIT_DIR:-$PWD}
    fi
fi
export SCAPE_ROOT
[[ -f $SCAPE_ROOT/slurm/launch_common.sh ]] \
    || { echo "vista.sh: $SCAPE_ROOT is not the repository; submit from its root or set SCAPE_ROOT" >&2; exit 1; }
# shellcheck source=slurm/launch_common.sh
source "$SCAPE_ROOT/slurm/launch_common.sh"

# One GH200 per node.
export SCAPE_GPUS_PER_NODE=1
# Checkpoints and caches belong on $SCRATCH at TACC ($HOME and $WORK are small or slow for this).
if [[ -n ${SCRATCH:-} ]]; then
    export SCAPE_OUT_DIR=${SCAPE_OUT_DIR:-$SCRATCH/scape-sdp/runs}
    export HF_HOME=${HF_HOME:-$SCRATCH/hf_home}
fi

# GPU mode only (skipped with SCAPE_CPU=1): a clean module environment with the compiler and
# CUDA the venv was built against. Set SCAPE_MODULES to add or pin modules, e.g.
# SCAPE_MODULES="gcc/14.2.0 cuda/12.6 python3/3.11.8".
scape_site_setup() {
    set +u  # Lmod's shell functions reference unset variables
    module reset
    # shellcheck disable=SC2086
    module load ${SCAPE_MODULES:-gcc cuda}
    set -u
    module list 2>&1 | sed 's/^/[modules] /' >&2 || true
}

scape_launch "$@"
