#!/usr/bin/env bash
# End-to-end check of the Slurm launcher on a real one-node Slurm cluster (CI runs this; users
# can too). Exits non-zero on the first failed assertion, printing the job logs.
#
#   1. starts the cluster (scripts/slurm_local_cluster.sh; installs Slurm and munge from apt);
#   2. job A: slurm/vista.sh in CPU mode, a tiny model on 2 processes, to completion:
#      COMPLETED, status.json "completed", every step in metrics.jsonl, complete checkpoints;
#   3. job B: vista.sh again, longer; once it has trained a few steps it gets SIGUSR1 the way
#      Slurm delivers it before a time limit (to the batch shell only): it must checkpoint at
#      some step P, requeue itself (same job id), resume from step-P and finish, with every
#      step in metrics.jsonl exactly once;
#   4. job C: slurm/generic.sh with SCAPE_REQUEUE=resubmit, signalled the same way: it must
#      resubmit itself as a new job that resumes from the checkpoint and finishes;
#   5. sweep D: a two-point Hydra sweep through hydra-submitit-launcher (hydra/launcher=vista, the
#      gh-dev partition, CPU mode), each point a job of 2 tasks: both complete, every step logged
#      once, each point's run named by its value and job, on 2 ranks.
#
# Takes about 2-4 minutes on 2 idle cores (the first run also installs Slurm: ~15 s more); sweep D
# adds under a minute.
# Environment:
#   SCAPE_VENV               venv for train.py (default: the active one, else ./.venv)
#   SCAPE_CI_KEEP=1          keep the work directory and the cluster afterwards
#   SCAPE_CI_SKIP_GENERIC=1  skip job C
#   SCAPE_CI_SKIP_SWEEP=1    skip sweep D
#   SCAPE_CI_HONOR_BEGINTIME=1  let Slurm's ~2 minute hold on requeued jobs run out instead of
#                            releasing the requeued job after 2 s (slower; same mechanics)
#   SCAPE_CI_JOB_TIMEOUT     seconds any one job may take (default 420)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
JOB_TIMEOUT=${SCAPE_CI_JOB_TIMEOUT:-420}
T0=$SECONDS

say() { echo "[ci_slurm +$((SECONDS - T0))s] $*" >&2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/scape-ci-slurm.XXXXXX")
JOBS=()
STARTED_CLUSTER=0
PASSED=0

dump_logs() {
    local f
    for f in "$WORK"/logs/*.out; do
        [[ -f $f ]] || continue
        echo "===== $f" >&2
        tail -n 80 "$f" >&2
    done
    for f in "$WORK"/runs/*/slurm_jobs.log; do
        [[ -f $f ]] && { echo "===== $f" >&2; cat "$f" >&2; }
    done
    for f in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; do
        [[ -f $f ]] && { echo "===== $f (tail)" >&2; tail -n 30 "$f" >&2; }
    done
}

cleanup() {
    local rc=$?
    local j
    for j in "${JOBS[@]}"; do
        # Only our own jobs, and only if still queued or running.
        if squeue -h -j "$j" 2>/dev/null | grep -q .; then scancel "$j" 2>/dev/null || true; fi
    done
    if ((PASSED == 0)); then
        dump_logs
        say "FAILED (exit $rc); files kept in $WORK"
    elif [[ ${SCAPE_CI_KEEP:-0} != 1 ]]; then
        rm -rf "$WORK"
    fi
    if ((STARTED_CLUSTER)) && [[ ${SCAPE_CI_KEEP:-0} != 1 ]]; then
        "$REPO/scripts/slurm_local_cluster.sh" stop || true
    fi
    exit "$rc"
}
trap cleanup EXIT

fail() { say "FAIL: $*"; exit 1; }

# ---- cluster ------------------------------------------------------------------------------------
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q UP; then
    say "using the running Slurm cluster"
else
    STARTED_CLUSTER=1
    "$REPO/scripts/slurm_local_cluster.sh" start
fi
sinfo -h -p gh-dev -o '%a %T' | grep -q '^up' || fail "partition gh-dev is not up (is this the local cluster?)"

# ---- python -------------------------------------------------------------------------------------
if [[ -z ${SCAPE_VENV:-} && -n ${VIRTUAL_ENV:-} ]]; then export SCAPE_VENV=$VIRTUAL_ENV; fi
export SCAPE_CPU=1 SCAPE_NPROC_PER_NODE=2 SCAPE_OUT_DIR=$WORK/runs
mkdir -p "$WORK/logs" "$WORK/runs"
# A tiny model: the point is the launcher, not the training, and the cores are few.
TINY=(+experiment=tiny_adamw logger=console
    model.n_layer=2 model.d_model=64 model.n_head=2 model.n_kv_head=1 model.ffn_hidden=128 model.seq_len=64
    train.global_batch_tokens=256 train.micro_batch_size=2 train.eval_every=0 train.eval_batches=2
    train.log_every=1 optimizer.warmup_steps=2)

# ---- helpers ------------------------------------------------------------------------------------
job_field() {  # job_field JOBID FIELD -> value from scontrol
    scontrol show job -o "$1" 2>/dev/null | grep -o " $2=[^ ]*" | head -n1 | cut -d= -f2-
}

# Runs in $(...): the caller records the id in JOBS (for the cleanup) itself.
submit() {  # submit SCRIPT JOBNAME [sbatch flags --] OVERRIDES... -> job id
    local script=$1 name=$2 flags=()
    shift 2
    if [[ " $* " == *" -- "* ]]; then
        while [[ $1 != -- ]]; do flags+=("$1"); shift; done
        shift
    fi
    local j
    j=$(sbatch --parsable -p gh-dev -t 00:15:00 -J "$name" -o "$WORK/logs/%x-%j.out" "${flags[@]}" \
        "$script" "$@") || fail "sbatch $script failed"
    j=${j%%;*}
    say "submitted $script as job $j ($name)"
    echo "$j"
}

# A job's final states. Everything else is on the way: PENDING, RUNNING, and the transient
# ones scontrol shows while Slurm works on a job (CONFIGURING for a moment after the allocation,
# COMPLETING, REQUEUED, ...), or nothing when scontrol did not answer this time.
job_ended() {  # job_ended STATE
    [[ $1 =~ ^(BOOT_FAIL|CANCELLED|COMPLETED|DEADLINE|FAILED|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|TIMEOUT)$ ]]
}

wait_job_end() {  # wait_job_end JOBID -> prints the final state
    local j=$1 state deadline=$((SECONDS + JOB_TIMEOUT))
    while :; do
        state=$(job_field "$j" JobState)
        if job_ended "$state"; then
            echo "$state"
            return 0
        fi
        ((SECONDS < deadline)) || fail "job $j still ${state:-unknown} after ${JOB_TIMEOUT}s"
        sleep 1
    done
}

metrics_steps() {  # metrics_steps RUN_DIR -> the "step" of every training-loss line, one per line
    python3 - "$1/metrics.jsonl" <<'PY'
import json, math, sys
for line in open(sys.argv[1]):
    if not line.strip():
        continue
    rec = json.loads(line)
    if "train/loss" in rec:
        if not math.isfinite(rec["train/loss"]):
            sys.exit(f"non-finite train/loss at step {rec['step']}")
        print(rec["step"])
PY
}

assert_steps_exactly() {  # assert_steps_exactly RUN_DIR N: training steps 1..N, each exactly once
    local got want
    got=$(metrics_steps "$1" | tr '\n' ' ') || fail "cannot read $1/metrics.jsonl"
    want=$(seq 1 "$2" | tr '\n' ' ')
    [[ $got == "$want" ]] || fail "$1/metrics.jsonl steps are [${got}], expected 1..$2 each once"
}

status_of() {  # status_of RUN_DIR -> "state step"
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["state"], s["step"])' "$1/status.json"
}

assert_checkpoint() {  # assert_checkpoint RUN_DIR STEP
    [[ -f $1/step-$2/meta.json ]] || fail "no complete checkpoint $1/step-$2 (meta.json); have: $(ls "$1")"
}

trained_steps() {  # trained_steps RUN_DIR -> training steps in metrics.jsonl so far
    if [[ -f $1/metrics.jsonl ]]; then grep -c '"train/loss"' "$1/metrics.jsonl" || true; else echo 0; fi
}

wait_steps() {  # wait_steps RUN_DIR JOBID N: until metrics.jsonl has N training steps
    local deadline=$((SECONDS + JOB_TIMEOUT)) state
    until (($(trained_steps "$1") >= $3)); do
        state=$(job_field "$2" JobState)
        if job_ended "$state"; then
            (($(trained_steps "$1") >= $3)) && break  # it got there just before ending
            fail "job $2 ended ($state) before training $3 steps"
        fi
        ((SECONDS < deadline)) || fail "job $2 trained only $(trained_steps "$1") steps in ${JOB_TIMEOUT}s"
        sleep 0.3
    done
}

# ---- job A: to completion -----------------------------------------------------------------------
A_STEPS=8
ja=$(submit slurm/vista.sh ci-complete "${TINY[@]}" train.steps=$A_STEPS train.ckpt_every=4)
JOBS+=("$ja")
state=$(wait_job_end "$ja")
[[ $state == COMPLETED ]] || fail "job $ja ended $state, expected COMPLETED"
[[ $(job_field "$ja" ExitCode) == 0:0 ]] || fail "job $ja exit code $(job_field "$ja" ExitCode)"
run_a=$WORK/runs/ci-complete-$ja
[[ -d $run_a ]] || fail "no run directory $run_a (named by the job id)"
[[ $(status_of "$run_a") == "completed $A_STEPS" ]] || fail "job $ja status.json: $(status_of "$run_a")"
assert_steps_exactly "$run_a" "$A_STEPS"
assert_checkpoint "$run_a" 4
assert_checkpoint "$run_a" "$A_STEPS"
grep -q "2 rank(s)" "$WORK/logs/ci-complete-$ja.out" || fail "job $ja did not train on 2 processes"
say "job A ok: completed $A_STEPS steps on 2 processes, metrics and checkpoints in $run_a"

# Long enough that the signal surely lands mid-run (about 25 s of steps at the speed job A saw),
# short enough that the resumed run finishes quickly.
step_s=$(python3 - "$run_a/metrics.jsonl" <<'PY'
import json, statistics, sys
t = [json.loads(l)["perf/step_time_s"] for l in open(sys.argv[1]) if '"perf/step_time_s"' in l]
print(statistics.median(t[1:] or t))
PY
)
LONG_STEPS=$(python3 -c "import sys; print(max(40, min(3000, int(25 / max(float(sys.argv[1]), 1e-3)))))" "$step_s")
say "median step ${step_s}s -> $LONG_STEPS steps for the preemption jobs"

# Signal like --signal=B:USR1@N does (batch shell only), wait for the checkpoint, and check the
# stopped run's files before the next job touches them.
preempt_and_check() {  # preempt_and_check JOBID RUN_DIR -> prints P
    local j=$1 run=$2 p st state
    wait_steps "$run" "$j" 3
    scancel --signal=USR1 --batch "$j" || fail "scancel --signal=USR1 --batch $j failed"
    say "sent SIGUSR1 to the batch shell of job $j" >&2
    # The stopped job writes an "end" line with its final status to slurm_jobs.log.
    local deadline=$((SECONDS + JOB_TIMEOUT))
    until grep -q "job=$j restart=0 end" "$run/slurm_jobs.log" 2>/dev/null; do
        ((SECONDS < deadline)) || fail "job $j did not stop after SIGUSR1"
        state=$(job_field "$j" JobState)
        if job_ended "$state"; then
            grep -q "job=$j restart=0 end" "$run/slurm_jobs.log" 2>/dev/null && break
            fail "job $j ended $state without a clean stop"
        fi
        sleep 0.5
    done
    st=$(grep "job=$j restart=0 end" "$run/slurm_jobs.log" | tail -n1)
    [[ $st == *"rc=0 state=preempted"* ]] || fail "job $j stopped with: $st"
    p=${st##*step=}
    if ! [[ $p =~ ^[0-9]+$ ]] || ((p < 3 || p >= LONG_STEPS)); then
        fail "preempted at step '$p' (expected 3 <= P < $LONG_STEPS)"
    fi
    assert_checkpoint "$run" "$p"
    grep -q "sent SIGUSR1 to train.py workers" "$WORK"/logs/*-"$j".out || fail "job $j log does not show the workers signalled"
    grep -q "preempted at step $p" "$WORK"/logs/*-"$j".out || fail "job $j: train.py did not report preemption at step $p"
    echo "$p"
}

check_resumed_run() {  # check_resumed_run RUN_DIR P LOG
    local run=$1 p=$2 log=$3
    [[ $(status_of "$run") == "completed $LONG_STEPS" ]] || fail "$run status.json: $(status_of "$run")"
    assert_steps_exactly "$run" "$LONG_STEPS"
    grep -q "resuming from .*step-$p\b" "$log" || fail "$log: the second run did not resume from step-$p"
}

# ---- job B: SIGUSR1 -> checkpoint -> requeue -> resume ------------------------------------------
jb=$(submit slurm/vista.sh ci-requeue "${TINY[@]}" train.steps="$LONG_STEPS" train.ckpt_every=0)
JOBS+=("$jb")
run_b=$WORK/runs/ci-requeue-$jb
p=$(preempt_and_check "$jb" "$run_b")
# Requeued: same job id, restart count 1, pending again.
deadline=$((SECONDS + 60))
until [[ $(job_field "$jb" Restarts) == 1 ]]; do
    ((SECONDS < deadline)) || fail "job $jb was not requeued (state $(job_field "$jb" JobState), restarts $(job_field "$jb" Restarts))"
    sleep 0.5
done
# Between the two runs the files must show exactly the steps up to the checkpoint.
if [[ $(job_field "$jb" JobState) == PENDING ]]; then
    [[ $(status_of "$run_b") == "preempted $p" ]] || fail "after the stop, status.json: $(status_of "$run_b")"
    assert_steps_exactly "$run_b" "$p"
fi
say "job B checkpointed at step $p and was requeued"
if [[ ${SCAPE_CI_HONOR_BEGINTIME:-0} != 1 && $(job_field "$jb" Reason) == BeginTime ]]; then
    # Slurm holds a requeued job for about two minutes; release it early to keep CI short, but
    # not at once. The hold exists because slurmd revoked the first run's credential and refuses
    # any credential of this job created in the same second or earlier (cred_revoked compares
    # whole seconds: ctime <= revoked). Released within that second, the job is killed as
    # "non-startable ... Job credential revoked" and ends FAILED. Two seconds after the requeue
    # was seen, the new credential is certainly newer than the revocation.
    sleep 2
    scontrol update JobId="$jb" StartTime=now
fi
state=$(wait_job_end "$jb")
[[ $state == COMPLETED ]] || fail "job $jb ended $state after the requeue"
[[ $(job_field "$jb" Restarts) == 1 ]] || fail "job $jb restarts: $(job_field "$jb" Restarts)"
check_resumed_run "$run_b" "$p" "$WORK/logs/ci-requeue-$jb.out"
grep -q "job=$jb restart=1 end rc=0 state=completed step=$LONG_STEPS" "$run_b/slurm_jobs.log" \
    || fail "slurm_jobs.log lacks the completed second run"
say "job B ok: requeued, resumed from step-$p, completed $LONG_STEPS steps, no step repeated or lost"

# ---- job C: generic.sh, resubmission instead of requeue -----------------------------------------
if [[ ${SCAPE_CI_SKIP_GENERIC:-0} != 1 ]]; then
    jc=$(submit slurm/generic.sh ci-resubmit --export=ALL,SCAPE_REQUEUE=resubmit -- \
        "${TINY[@]}" train.steps="$LONG_STEPS" train.ckpt_every=0)
    JOBS+=("$jc")
    run_c=$WORK/runs/ci-resubmit-$jc
    p=$(preempt_and_check "$jc" "$run_c")
    state=$(wait_job_end "$jc")
    [[ $state == COMPLETED ]] || fail "job $jc ended $state (a resubmitting job ends normally)"
    jc2=$(grep -o 'resubmitted as job [0-9]*' "$WORK/logs/ci-resubmit-$jc.out" | grep -o '[0-9]*$' || true)
    [[ -n $jc2 ]] || fail "job $jc did not resubmit itself"
    JOBS+=("$jc2")
    state=$(wait_job_end "$jc2")
    [[ $state == COMPLETED ]] || fail "resubmitted job $jc2 ended $state"
    check_resumed_run "$run_c" "$p" "$WORK/logs/ci-resubmit-$jc2.out"
    say "job C ok: generic.sh resubmitted as job $jc2, resumed from step-$p, completed $LONG_STEPS steps"
fi

# ---- sweep D: Hydra multirun, one Slurm job per point (hydra/launcher=vista) ---------------------
if [[ ${SCAPE_CI_SKIP_SWEEP:-0} != 1 ]]; then
    if [[ -n ${SCAPE_VENV:-} ]]; then sweep_py=$SCAPE_VENV/bin/python
    elif [[ -x $REPO/.venv/bin/python ]]; then sweep_py=$REPO/.venv/bin/python
    else sweep_py=python3; fi
    SWEEP_STEPS=4
    say "sweep D: two points through hydra/launcher=vista"
    # The submitting command waits for both jobs; the run folders go to $SCAPE_OUT_DIR.
    timeout "$JOB_TIMEOUT" "$sweep_py" train.py -m hydra/launcher=vista hydra.launcher.partition=gh-dev \
        hydra.launcher.timeout_min=15 hydra.launcher.tasks_per_node=2 hydra.sweep.dir="$WORK/sweep" \
        "${TINY[@]}" train.steps=$SWEEP_STEPS train.ckpt_every=0 optimizer.lr=1e-3,3e-3 \
        >"$WORK/logs/sweep.out" 2>&1 || { tail -n 40 "$WORK/logs/sweep.out" >&2; fail "the sweep failed"; }
    sweep_jobs=()
    for lr in 0.001 0.003; do
        runs=("$WORK"/runs/tiny_adamw-lr$lr-*)
        [[ ${#runs[@]} == 1 && -d ${runs[0]} ]] || fail "sweep point lr=$lr: expected one run folder, have: $(ls "$WORK/runs")"
        run=${runs[0]}
        sweep_jobs+=("${run##*-}")
        [[ $(status_of "$run") == "completed $SWEEP_STEPS" ]] || fail "$run status.json: $(status_of "$run")"
        assert_steps_exactly "$run" "$SWEEP_STEPS"
        grep -q "^  lr: $lr\$" "$run/config.yaml" || fail "$run/config.yaml does not have lr $lr"
    done
    [[ ${sweep_jobs[0]} != "${sweep_jobs[1]}" ]] || fail "both sweep points ran in job ${sweep_jobs[0]}"
    for j in "${sweep_jobs[@]}"; do
        JOBS+=("$j")
        # The command returns once the results are written; the jobs end a moment later.
        state=$(wait_job_end "$j")
        [[ $state == COMPLETED ]] || fail "sweep job $j ended $state"
    done
    ranks=$(grep -rl "2 rank(s)" "$WORK/sweep/.submitit" 2>/dev/null | wc -l)
    ((ranks == 2)) || fail "$ranks of the 2 sweep jobs' logs show training on 2 ranks (logs in $WORK/sweep/.submitit)"
    say "sweep D ok: jobs ${sweep_jobs[*]} trained lr=1e-3 and lr=3e-3 on 2 ranks each, $SWEEP_STEPS steps"
fi

PASSED=1
say "PASSED in $((SECONDS - T0))s"
