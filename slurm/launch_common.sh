#!/usr/bin/env bash
# Shared launcher behind slurm/vista.sh and slurm/generic.sh. Three roles:
#
#   1. sourced by a batch script, which then calls `scape_launch "$@"` (runs in the batch shell
#      on the first node): resolves the run, starts one torchrun per node with `srun`, turns
#      the pre-time-limit SIGUSR1 into a checkpoint, and requeues or resubmits the job;
#   2. `launch_common.sh node NPROC -- OVERRIDES...`: the per-node task that srun starts; runs
#      torchrun (c10d rendezvous) on train.py and records torchrun's pid for role 3;
#   3. `launch_common.sh signal-workers SIG`: a short step on every node that sends SIG to the
#      train.py worker processes of that node, and to nothing else.
#
# Why the signal takes this route: torchrun's agent does not forward SIGUSR1 to its workers
# (its default action would kill the agent, and with it the workers, mid-step), and it answers
# SIGTERM by SIGTERM-ing the workers and SIGKILL-ing them 30 s later. Slurm's own step signals
# (`scancel --signal` without --batch, `--signal` without B:) hit every process of the step,
# agent and DataLoader workers included. So the batch script asks for the signal itself
# (`--signal=B:USR1@N`), and on it runs role 3, which signals exactly the train.py workers;
# train.py checkpoints, all ranks agree, they exit 0, torchrun exits 0, and the batch shell
# requeues the job. As a second line of defence the node task starts torchrun with SIGUSR1
# ignored: a USR1 that reaches torchrun is then harmless, and a worker that has not installed
# its handler yet ignores it instead of dying (train.py's handler replaces the inherited
# "ignore" once installed).
#
# Settings (environment; the batch scripts set the site-specific defaults):
#   SCAPE_CPU=1              CPU mode: no modules, no GPUs, gloo, train.device=cpu (GPU mode
#                            passes train.device=cuda and sets NCCL's error handling and
#                            dump-on-timeout variables, see scape__nccl_env)
#   SCAPE_NPROC_PER_NODE     processes per node (CPU mode default 2; GPU mode: GPUs per node)
#   SCAPE_GPUS_PER_NODE      GPUs per node in GPU mode (vista.sh: 1)
#   SCAPE_VENV               virtual environment to activate (default: $SCAPE_ROOT/.venv if it
#                            exists, else the python already on PATH)
#   SCAPE_ROOT               the repository (default: the directory sbatch was run from)
#   SCAPE_TRAIN_SCRIPT       entry point (default: $SCAPE_ROOT/train.py)
#   SCAPE_OUT_DIR            parent of run directories (default: $SCAPE_ROOT/runs); an
#                            out_dir=... override wins
#   SCAPE_RUN_NAME           run name (default: <job name>-<job id>, or <experiment>-<job id> under
#                            the default job name "scape"); a run_name=... override wins
#   SCAPE_REQUEUE            what to do after a checkpoint on SIGUSR1: auto (scontrol requeue,
#                            else resubmit with sbatch), requeue, resubmit, none (default auto)
#   SCAPE_MAX_RESTARTS       stop continuing a run after this many requeues/resubmissions (50)
#   SCAPE_MASTER_PORT        rendezvous port (default: 29500 + job id % 500, so two jobs that
#                            share a node do not collide)
#   SCAPE_SIGNAL_TIMEOUT     seconds the signal step waits for the workers to be ready (120)

scape__log() { echo "[scape-launch $(date +%H:%M:%S)] $*" >&2; }
scape__die() { scape__log "ERROR: $*"; exit 1; }

# Where the node task records torchrun's pid: node-local, per job and per restart, so a stale
# file from an earlier run of a requeued job is never read.
scape__pidfile() {
    echo "${TMPDIR:-/tmp}/scape-${SLURM_JOB_ID:?}-${SLURM_RESTART_COUNT:-0}-$(hostname -s).torchrun.pid"
}

# ---------------------------------------------------------------------------------------------
# Role 2: per-node task.
scape__node() {
    local nproc=$1
    shift
    [[ ${1:-} == -- ]] && shift
    local pidfile tr rc
    pidfile=$(scape__pidfile)
    # Ignored signals survive fork and exec: torchrun and its workers start with SIGUSR1
    # ignored, until train.py installs its own handler (see the header).
    trap '' USR1
    # At the time limit or on scancel Slurm sends SIGTERM to every process of the step. If this
    # shell died of it, srun would see the task end and kill the rest of the step while train.py
    # is still writing its checkpoint, so it only notes the signal and keeps waiting.
    trap 'scape__log "$(hostname -s): SIGTERM; waiting for torchrun and train.py to finish"' TERM
    python -m torch.distributed.run \
        --nnodes="${SLURM_JOB_NUM_NODES:?}" \
        --nproc_per_node="$nproc" \
        --rdzv_backend=c10d \
        --rdzv_endpoint="${SCAPE_MASTER_ADDR:?}:${SCAPE_MASTER_PORT:?}" \
        --rdzv_id="${SCAPE_RDZV_ID:?}" \
        --max_restarts=0 \
        "${SCAPE_TRAIN_SCRIPT:?}" "$@" &
    tr=$!
    echo "$tr" >"$pidfile"
    # wait returns early whenever a trapped signal arrives; keep waiting while torchrun lives.
    rc=0
    while :; do
        wait "$tr" && rc=0 || rc=$?
        kill -0 "$tr" 2>/dev/null || break
    done
    # Tells a late signal step that training already ended here (it need not wait for workers).
    echo "$rc" >"$pidfile.done"
    rm -f "$pidfile"
    return "$rc"
}

# ---------------------------------------------------------------------------------------------
# Role 3: send a signal to this node's train.py workers (the direct children of torchrun that
# run the training script); torchrun itself and any grandchildren are left alone.
scape__catches() {  # scape__catches PID SIGNUM -> 0 if PID has a handler installed for SIGNUM
    local mask
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
    [[ -n $mask ]] && (( (16#$mask >> ($2 - 1)) & 1 ))
}

scape__signal_workers() {
    local sig=${1:-USR1} signum pidfile tr pids=() p deadline ready
    signum=$(kill -l "$sig")
    pidfile=$(scape__pidfile)
    deadline=$((SECONDS + ${SCAPE_SIGNAL_TIMEOUT:-120}))
    # Wait until the workers exist and have installed their handler: until then they ignore the
    # signal (see the header), and a signal sent then would be lost.
    while :; do
        pids=()
        ready=1
        if [[ -e $pidfile.done ]]; then
            scape__log "$(hostname -s): training already ended on this node; nothing to signal"
            return 0
        fi
        if [[ -s $pidfile ]]; then
            tr=$(cat "$pidfile")
            for p in $(pgrep -P "$tr" || true); do
                # Only workers running the training script.
                tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$(basename "${SCAPE_TRAIN_SCRIPT:?}")" \
                    || continue
                pids+=("$p")
                scape__catches "$p" "$signum" || ready=0
            done
        fi
        ((${#pids[@]} && ready)) && break
        if ((SECONDS >= deadline)); then
            if ((${#pids[@]} == 0)); then
                scape__log "$(hostname -s): no train.py workers found (pid file $pidfile); nothing signalled"
                return 1
            fi
            scape__log "$(hostname -s): train.py has no SIG$sig handler after ${SCAPE_SIGNAL_TIMEOUT:-120}s; signalling anyway"
            break
        fi
        sleep 1
    done
    kill -s "$sig" "${pids[@]}"
    scape__log "$(hostname -s): sent SIG$sig to train.py workers ${pids[*]} (torchrun $tr)"
}

# ---------------------------------------------------------------------------------------------
# Role 1 helpers (batch shell).

# NCCL diagnostics for GPU jobs, each overridable from the environment: a failed or hung NCCL
# collective tears the process down with an error instead of hanging (async error handling),
# and on a watchdog timeout every rank dumps its last collectives (the flight recorder) to
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> in the run's folder for `python -m torch.distributed.flight_recorder`.
# NCCL_DEBUG=WARN prints NCCL's own reason for a failure; NCCL_DEBUG=INFO shows the transport
# (InfiniBand, GPUDirect: docs/CLUSTER.md).
scape__nccl_env() {
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    scape__log "NCCL: async error handling, dump on timeout (trace buffer $TORCH_NCCL_TRACE_BUFFER_SIZE), NCCL_DEBUG=$NCCL_DEBUG"
}

# Value of KEY=... among the Hydra overrides, if the user gave it (last one wins, as in Hydra).
scape__override_value() {
    local key=$1 arg val=""
    shift
    for arg in "$@"; do
        case $arg in "$key="* | "+$key="* | "++$key="*) val=${arg#*=} ;; esac
    done
    printf '%s' "$val"
}

scape__has_override() {
    local key=$1 arg
    shift
    for arg in "$@"; do
        case $arg in "$key="* | "+$key="* | "++$key="*) return 0 ;; esac
    done
    return 1
}

scape__json_field() {  # scape__json_field FILE KEY -> value or empty
    [[ -f $1 ]] || return 0
    python - "$1" "$2" <<'PY' 2>/dev/null || true
import json, sys
try:
    print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))
except Exception:
    pass
PY
}

scape__activate_venv() {
    local venv=${SCAPE_VENV:-}
    if [[ -n $venv ]]; then
        [[ -f $venv/bin/activate ]] || scape__die "SCAPE_VENV=$venv has no bin/activate"
    elif [[ -f $SCAPE_ROOT/.venv/bin/activate ]]; then
        venv=$SCAPE_ROOT/.venv
    fi
    if [[ -n $venv ]]; then
        # activate scripts reference unset variables; relax -u around them.
        set +u
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
        set -u
        scape__log "venv: $venv"
    else
        scape__log "no venv (set SCAPE_VENV); using $(command -v python || echo 'no python on PATH')"
    fi
    python -c 'import torch, hydra' 2>/dev/null \
        || scape__die "$(command -v python) cannot import torch and hydra; set SCAPE_VENV to the project's venv"
}

# Submit this script again, to continue the run once this job has ended.
scape__resubmit() {
    local info script partition account timelimit nodes name stdout outdir args=()
    info=$(scontrol show job -o "$SLURM_JOB_ID")
    field() { grep -o " $1=[^ ]*" <<<" $info" | head -n1 | cut -d= -f2-; }
    script=${SCAPE_SCRIPT:-$(field Command)}
    [[ -f $script ]] || { scape__log "cannot resubmit: batch script '$script' not found (set SCAPE_SCRIPT)"; return 1; }
    partition=$(field Partition)
    account=$(field Account)
    timelimit=$(field TimeLimit)
    nodes=$(field NumNodes)
    name=$(field JobName)
    stdout=$(field StdOut)
    args=(--parsable --dependency="afterany:$SLURM_JOB_ID" -J "$name" -N "${nodes%%-*}")
    [[ -n $partition ]] && args+=(-p "$partition")
    [[ -n $account && $account != "(null)" ]] && args+=(-A "$account")
    [[ -n $timelimit && $timelimit != UNLIMITED ]] && args+=(-t "$timelimit")
    if [[ -n $stdout ]]; then
        outdir=$(dirname "$stdout")
        args+=(-o "$outdir/%x-%j.out")
    fi
    # The new job must not inherit this job's SLURM_* variables (a stale SLURM_RESTART_COUNT or
    # node list would confuse it); everything else, including SBATCH_* defaults, carries over.
    local unset_args=() v new
    for v in ${!SLURM_@}; do unset_args+=(-u "$v"); done
    new=$(env "${unset_args[@]}" \
        SCAPE_RUN_NAME="$SCAPE_RUN_NAME_RESOLVED" SCAPE_OUT_DIR="$SCAPE_OUT_DIR_RESOLVED" \
        SCAPE_RESUBMITS=$((${SCAPE_RESUBMITS:-0} + 1)) SCAPE_ROOT="$SCAPE_ROOT" SCAPE_SCRIPT="$script" \
        sbatch "${args[@]}" "$script" "${SCAPE_USER_ARGS[@]}") || return 1
    scape__log "resubmitted as job $new (starts after job $SLURM_JOB_ID ends)"
}

# After a checkpoint on SIGUSR1: continue the run in a later job.
scape__continue_later() {
    local restarts=$(( ${SLURM_RESTART_COUNT:-0} + ${SCAPE_RESUBMITS:-0} ))
    local max=${SCAPE_MAX_RESTARTS:-50}
    if ((restarts >= max)); then
        scape__log "run continued $restarts times already (SCAPE_MAX_RESTARTS=$max): not requeueing"
        return 0
    fi
    case ${SCAPE_REQUEUE:-auto} in
        none)
            scape__log "SCAPE_REQUEUE=none: continue with: SCAPE_RUN_NAME=$SCAPE_RUN_NAME_RESOLVED sbatch ... (resume=auto)"
            ;;
        requeue | auto)
            scape__log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); it resumes from the checkpoint"
            if scontrol requeue "$SLURM_JOB_ID"; then
                return 0
            fi
            [[ ${SCAPE_REQUEUE:-auto} == auto ]] || scape__die "scontrol requeue failed"
            scape__log "scontrol requeue failed; resubmitting instead"
            scape__resubmit || scape__die "could not requeue or resubmit; continue by hand with SCAPE_RUN_NAME=$SCAPE_RUN_NAME_RESOLVED"
            ;;
        resubmit)
            scape__resubmit || scape__die "could not resubmit; continue by hand with SCAPE_RUN_NAME=$SCAPE_RUN_NAME_RESOLVED"
            ;;
        *) scape__die "SCAPE_REQUEUE must be auto, requeue, resubmit or none (got ${SCAPE_REQUEUE})" ;;
    esac
}

scape__on_usr1() {
    SCAPE_STOP_REQUESTED=1
    if [[ -z ${SCAPE_SRUN_PID:-} ]]; then
        scape__log "SIGUSR1 before training started: will requeue without starting"
        return 0
    fi
    if ! kill -0 "$SCAPE_SRUN_PID" 2>/dev/null; then
        scape__log "SIGUSR1 after training ended: nothing to stop"
        return 0
    fi
    scape__log "SIGUSR1: asking train.py on all $SLURM_JOB_NUM_NODES node(s) to checkpoint and stop"
    # A step that overlaps the running one, one task per node. Bounded: a wedged node must not
    # keep the batch shell from requeueing before the time limit.
    timeout "$((${SCAPE_SIGNAL_TIMEOUT:-120} + 30))" \
        srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
        bash "$SCAPE_HELPER" signal-workers USR1 \
        || scape__log "the signal step failed on some node; train.py may stop only at the time limit"
}

# ---------------------------------------------------------------------------------------------
# Role 1: the batch shell. Arguments: Hydra overrides for train.py.
scape_launch() {
    SCAPE_USER_ARGS=("$@")
    SCAPE_STOP_REQUESTED=0
    SCAPE_SRUN_PID=
    # Installed first so that a signal during setup is not lost (and does not kill the shell).
    trap scape__on_usr1 USR1
    trap 'scape__log "SIGTERM (time limit or scancel): train.py got it too and checkpoints; not requeueing"' TERM

    [[ -n ${SLURM_JOB_ID:-} ]] || scape__die "run this with sbatch (no SLURM_JOB_ID)"
    SCAPE_HELPER=$SCAPE_ROOT/slurm/launch_common.sh
    export SCAPE_TRAIN_SCRIPT=${SCAPE_TRAIN_SCRIPT:-$SCAPE_ROOT/train.py}
    [[ -f $SCAPE_TRAIN_SCRIPT ]] || scape__die "no $SCAPE_TRAIN_SCRIPT (submit from the repository root or set SCAPE_ROOT)"
    cd "$SCAPE_ROOT"

    local nproc extra=()
    if [[ ${SCAPE_CPU:-0} == 1 ]]; then
        nproc=${SCAPE_NPROC_PER_NODE:-2}
        # Each process gets one thread unless told otherwise: the cores are shared.
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        scape__has_override train.device "$@" || extra+=(train.device=cpu)
        scape__log "CPU mode: $nproc process(es) per node, gloo"
    else
        if declare -F scape_site_setup >/dev/null; then scape_site_setup; fi
        nproc=${SCAPE_NPROC_PER_NODE:-${SCAPE_GPUS_PER_NODE:-1}}
        # A GPU job trains on the GPU or fails at start (a CPU-only torch wheel must not fall
        # back to the CPU and gloo for the whole allocation).
        scape__has_override train.device "$@" || extra+=(train.device=cuda)
        scape__nccl_env
    fi
    scape__activate_venv

    # The run: named by the job unless given; every node and every restart agrees on it.
    local run_name out_dir run_dir
    run_name=$(scape__override_value run_name "$@")
    if [[ -z $run_name ]]; then
        # <job name>-<job id>; with the scripts' default job name (scape) the experiment names
        # the run instead, so `sbatch slurm/vista.sh +experiment=llama500m_scape99` writes to
        # llama500m_scape99-<job id> (and shows under that name in wandb).
        local base=${SLURM_JOB_NAME:-scape} experiment
        experiment=$(scape__override_value experiment "$@")
        [[ $base == scape && -n $experiment ]] && base=$experiment
        run_name=${SCAPE_RUN_NAME:-$base-$SLURM_JOB_ID}
    fi
    run_name=${run_name//[^A-Za-z0-9._-]/_}
    out_dir=$(scape__override_value out_dir "$@")
    [[ -n $out_dir ]] || out_dir=${SCAPE_OUT_DIR:-$SCAPE_ROOT/runs}
    [[ $out_dir == /* ]] || out_dir=$SCAPE_ROOT/$out_dir
    run_dir=$out_dir/$run_name
    SCAPE_RUN_NAME_RESOLVED=$run_name
    SCAPE_OUT_DIR_RESOLVED=$out_dir
    scape__has_override run_name "$@" || extra+=("run_name=$run_name")
    scape__has_override out_dir "$@" || extra+=("out_dir=$out_dir")
    scape__has_override resume "$@" || extra+=(resume=auto)

    # Rendezvous on the first node. The id changes on every restart so a new job never joins a
    # stale rendezvous of the previous one.
    SCAPE_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    SCAPE_MASTER_PORT=${SCAPE_MASTER_PORT:-$((29500 + SLURM_JOB_ID % 500))}
    SCAPE_RDZV_ID="${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
    export SCAPE_MASTER_ADDR SCAPE_MASTER_PORT SCAPE_RDZV_ID

    local restart=$(( ${SLURM_RESTART_COUNT:-0} + ${SCAPE_RESUBMITS:-0} ))
    scape__log "job $SLURM_JOB_ID (restart $restart) on ${SLURM_JOB_NUM_NODES} node(s) [$SLURM_JOB_NODELIST]," \
        "$nproc process(es) per node, rendezvous $SCAPE_MASTER_ADDR:$SCAPE_MASTER_PORT"
    scape__log "run dir: $run_dir"
    scape__log "train.py ${extra[*]} $*"
    mkdir -p "$run_dir"
    echo "$(date -Is) job=$SLURM_JOB_ID restart=$restart nodes=$SLURM_JOB_NODELIST start" >>"$run_dir/slurm_jobs.log"
    if [[ ${SCAPE_CPU:-0} != 1 ]]; then
        export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$run_dir/nccl_trace_rank_}
    fi

    if ((SCAPE_STOP_REQUESTED)); then
        scape__continue_later
        return 0
    fi

    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        bash "$SCAPE_HELPER" node "$nproc" -- "${extra[@]}" "$@" &
    SCAPE_SRUN_PID=$!
    local rc=0
    while :; do
        wait "$SCAPE_SRUN_PID" && rc=0 || rc=$?
        kill -0 "$SCAPE_SRUN_PID" 2>/dev/null || break
    done

    local state step
    state=$(scape__json_field "$run_dir/status.json" state)
    step=$(scape__json_field "$run_dir/status.json" step)
    echo "$(date -Is) job=$SLURM_JOB_ID restart=$restart end rc=$rc state=${state:-none} step=${step:-none}" \
        >>"$run_dir/slurm_jobs.log"
    scape__log "training ended: exit $rc, status ${state:-none} at step ${step:-?}"
    if ((rc != 0)); then
        return "$rc"
    fi
    if ((SCAPE_STOP_REQUESTED)) && [[ $state == preempted ]]; then
        scape__continue_later
    elif [[ $state == preempted ]]; then
        scape__log "preempted without our SIGUSR1 (SIGTERM or scancel): not continuing automatically"
    fi
    return 0
}

# Roles 2 and 3 when executed (not sourced).
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
        node) shift; scape__node "$@" ;;
        signal-workers) shift; scape__signal_workers "$@" ;;
        *) echo "usage: $0 node NPROC -- OVERRIDES... | signal-workers SIG (or source it and call scape_launch)" >&2; exit 2 ;;
    esac
fi
