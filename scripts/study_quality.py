"""The quality study: the papers' comparison tables in miniature, one torchrun of train.py per arm.

    python scripts/study_quality.py                          # every arm, tinyshakespeare, 4 gloo ranks
    python scripts/study_quality.py --arms adams,scape90     # some arms (finished arms are reused)
    python scripts/study_quality.py --report-only            # rebuild table, JSON and plots

Every arm trains the same tiny Llama on the same corpus with the same global batch, schedule and
seed for the same number of steps, so every arm sees the same tokens; FLOP-matched SDP runs 1/C
times the steps (sdp.flop_matched=true, as the SDP paper does), i.e. the same FLOPs as the dense
arms. Each arm is the real trainer with real gloo collectives, so the bytes in the table are the
ones the trainer counted (bytes sent per rank under ring algorithms, core/comm.py).

The outputs go to --out (docs/results by default): NAME.md (the table), NAME.json (settings,
machine, every arm's summary and validation curve, the targets of docs/specs/SCAPE.md and
SDP.md and whether they are met) and NAME_val_loss.png (validation loss against step and against
bytes sent, the two regimes the SCAPE spec asks for). Run folders go to --runs-dir/NAME/ARM; an
arm whose folder holds a completed run with the same overrides is not trained again.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_runs import plot_curves, read_metrics  # noqa: E402

DEFAULT_CORPUS = REPO.parent / "shared" / "corpora" / "tinyshakespeare.txt"
REFERENCE_ARM = "adams"


def reference_arm(names) -> Optional[str]:
    """The arm every gap is measured against: adams, else the first adams arm with parts
    (adams+elr16 in a study that trains every arm's embedding table at 16 lr)."""
    names = list(names)
    if REFERENCE_ARM in names:
        return REFERENCE_ARM
    return next((name for name in names if name.startswith(REFERENCE_ARM + "+")), None)
WARMUP_STEPS = 20  # the lr warm-up of every arm (model_overrides)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: Tuple[str, ...]
    note: str = ""
    in_all: bool = True  # part of `--arms all` (the issue's list); the others are attempts at the gap


SCAPE = ("optimizer=scape",)
SDP_COMMON = ("optimizer=adams", "sdp.coverage=0.5", "sdp.masking=forward", "sdp.strategy=cyclic")
ARMS: Dict[str, Arm] = {arm.name: arm for arm in [
    Arm("adamw", "AdamW (dense)", ("optimizer=adamw",)),
    Arm("adams", "AdamS (dense)", ("optimizer=adams",), "the reference of every gap"),
    Arm("scape90", "SCAPE-90", (*SCAPE, "optimizer.sparsity=0.9")),
    Arm("scape99", "SCAPE-99", (*SCAPE, "optimizer.sparsity=0.99")),
    Arm("scape99_adamw", "SCAPE-99, base=adamw", (*SCAPE, "optimizer.sparsity=0.99", "optimizer.base=adamw"),
        "ablation: Adam's second moment instead of AdamS"),
    Arm("scape99_gradient", "SCAPE-99, score=gradient",
        (*SCAPE, "optimizer.sparsity=0.99", "optimizer.score=gradient"),
        "ablation: top-k of the raw contribution |a| (DGC-style)"),
    Arm("scape99_nolag", "SCAPE-99, lag=false", (*SCAPE, "optimizer.sparsity=0.99", "optimizer.lag=false"),
        "ablation: mask from the current step, all-gather on the critical path"),
    Arm("bsdp50", "B-SDP C=0.5", (*SDP_COMMON, "sdp=block", "sdp.flop_matched=false"),
        "same steps as dense: half the block FLOPs"),
    Arm("bsdp50_fm", "B-SDP C=0.5, FLOP-matched", (*SDP_COMMON, "sdp=block", "sdp.flop_matched=true"),
        "1/C = 2x the steps"),
    Arm("nsdp50", "N-SDP C=0.5", (*SDP_COMMON, "sdp=neuron", "sdp.groups_per_block=4", "sdp.flop_matched=false"),
        "same steps as dense"),
    Arm("nsdp50_fm", "N-SDP C=0.5, FLOP-matched",
        (*SDP_COMMON, "sdp=neuron", "sdp.groups_per_block=4", "sdp.flop_matched=true"), "1/C = 2x the steps"),
    Arm("bsdp50_scape90", "B-SDP C=0.5 + SCAPE-90", (*SCAPE, "optimizer.sparsity=0.9", *SDP_COMMON[1:],
        "sdp=block", "sdp.flop_matched=false"),
        "SCAPE-90 inside each holder group: SDP's memory, SCAPE's bytes; same steps as dense"),
    # Attempts at the gap with the spec's own options ({quarter} = a quarter of the steps).
    Arm("scape90_warm", "SCAPE-90, sparsity warm-up 25%", (*SCAPE, "optimizer.sparsity=0.9",
        "optimizer.sparsity_warmup_steps={quarter}"), "density from 1 to 0.1 over the first quarter", False),
    Arm("scape90_cap8", "SCAPE-90, stale_scale_cap 8", (*SCAPE, "optimizer.sparsity=0.9",
        "optimizer.stale_scale_cap=8"), "lazy step scaled by steps since last sent (<= 8)", False),
    Arm("scape99_warm", "SCAPE-99, sparsity warm-up 25%", (*SCAPE, "optimizer.sparsity=0.99",
        "optimizer.sparsity_warmup_steps={quarter}"), "density from 1 to 0.01 over the first quarter", False),
    Arm("scape99_cap8", "SCAPE-99, stale_scale_cap 8", (*SCAPE, "optimizer.sparsity=0.99",
        "optimizer.stale_scale_cap=8"), "lazy step scaled by steps since last sent (<= 8)", False),
    Arm("scape99_warm_cap8", "SCAPE-99, warm-up 25% + cap 8", (*SCAPE, "optimizer.sparsity=0.99",
        "optimizer.sparsity_warmup_steps={quarter}", "optimizer.stale_scale_cap=8"), "both", False),
]}

# The spec's rule at both sparsities (the defaults of optimizer=scape are the study's rule), and
# sparse model averaging as it ships; any other rule is composed from its name (compose_arm).
for _pct, _sparsity in (("90", "0.9"), ("99", "0.99")):
    ARMS[f"scape{_pct}_spec"] = Arm(f"scape{_pct}_spec", f"SCAPE-{_pct}, the spec's rule",
                                    ("optimizer=scape_spec", f"optimizer.sparsity={_sparsity}"),
                                    "docs/specs/SCAPE.md as written: pre-send score, no catch-up, no warm-up", False)
ARMS["sma99t"] = Arm("sma99t", "sparse model averaging at SCAPE-99's bytes",
                     ("optimizer=sparse_avg",),
                     "optimizer=sparse_avg as it ships: 2-bit drifts of a fixed cycle of coordinates through a "
                     "compressed all-reduce, each step's density planned from the lr schedule to send SCAPE-99's "
                     "bytes over the run, local steps over one shared denominator", False)


# Composed SCAPE arms, named by their recipe: scape99+post+cap32+warm20 (see compose_arm).
_SPEC_RULE = ("optimizer.score_timing=pre_send", "optimizer.stale_scale_cap=1", "optimizer.stale_scale=steps",
              "optimizer.sparsity_warmup_steps=0")
_PARTS = {
    "post": (("optimizer.score_timing=post_step",), "post-step score"),
    "cap": (("optimizer.stale_scale=steps", "optimizer.stale_scale_cap={n}"), "catch-up x steps since sent, cap {n}"),
    "lrsum": (("optimizer.stale_scale=lr_sum", "optimizer.stale_scale_cap={n}"), "catch-up x lr-sum since sent, cap {n}"),
    "warm": (("optimizer.sparsity_warmup_steps={n}",), "sparsity warm-up {n} steps"),
    "noclip": (("optimizer.grad_clip=0",), "no clipping"),
    "gc": (("optimizer.grad_clip={n}",), "clipped at {n}"),
    "lr": (("optimizer.lr={n}",), "lr {n}"),
    "bound": (("optimizer.step_bound={n}",), "local steps bounded at {n}"),  # sparse_avg only
    # the embedding table's parameter group (optimizer.param_groups, one group: see table_group)
    "emb": (("group.step_bound={n}",), "local steps on the embedding table bounded at {n}"),  # sparse_avg only
    "elr": (("group.lr_scale={n}",), "lr x {n} on the embedding table"),  # adams / adamw / scape / sparse_avg
    "edbeta": (("group.denominator_beta={n}",), "D's beta {n} on the table"),  # sparse_avg only
    "mom": (("optimizer.betas=[{n},0.95]",), "b1 {n}"),
    "wd": (("optimizer.weight_decay={n}",), "weight decay {n}"),
    "sp": (("optimizer.sparsity={n}",), "sparsity {n}"),  # SCAPE
    # sparse_avg only: the byte budget, a fraction of the dense fp32 all-reduce a step (1: density 1)
    "budget": (("optimizer.byte_budget={n}",), "{n} of the dense bytes a step"),
    # sparse_avg only: N ranks train one copy (dense inside it), the exchange runs between copies
    "rpc": (("optimizer.ranks_per_copy={n}",), "{n} ranks per copy"),
    # sparse_avg only: the copies take {n} of their local step, x the mean drift / {n}
    "lss": (("optimizer.local_step_scale={n}",), "copies take {n} of their local step"),
    "lsp": (("optimizer.local_step_scale=0", "optimizer.local_step_scale_power={n}"),
            "copies take min(1, (4 / C)^{n}) of their local step"),
    "bfloat": (("optimizer.value_dtype=bf16",), "bf16 values"),
    # sparse_avg only: the drifts travel as N-bit codes (0: value_dtype values), the rest kept in the copy
    "q": (("optimizer.value_bits={n}",), "{n}-bit drifts"),
}


# sparse averaging's table settings where its table trains faster than the lr, as every sparse_avg
# arm with an elrX part above 1 was measured (tiny_sma99 states them); embN / edbetaX replace them
SPARSE_AVG_TABLE = {"step_bound": "4.47", "denominator_beta": "0.2"}


def table_group(settings: Dict[str, str], sparse_avg: bool) -> List[str]:
    """The override of the embedding table's parameter group from the group.* items of an arm's
    parts: one ``optimizer.param_groups`` entry (none without settings)."""
    if not settings:
        return []
    if sparse_avg and float(settings.get("lr_scale", "1")) > 1:
        settings = {**SPARSE_AVG_TABLE, **settings}
    fields = ",".join(f"{key}:{value}" for key, value in settings.items())
    return [f"optimizer.param_groups=[{{match:embedding,{fields}}}]"]


_PART_NAME = re.compile(r"([a-z]+?)((?:\d+\.?\d*|\.\d+)(?:e-?\d+)?)?")


def compose_arm(name: str) -> Optional[Arm]:
    """An arm named by its recipe, ``base+part+part...``: base scape90 / scape99 (the spec's rule at
    that sparsity), scape90t / scape99t (optimizer=scape as it ships), sma99t (optimizer=sparse_avg as it ships) or adams / adamw; parts: post, capN /
    lrsumN (catch-up capped at N; 0 = 1 / density), warmN, noclip, gcN (clipped at N), lrX, momX
    (b1 = X), wdX (weight decay X), elrX (the lr on the embedding table times X; for sparse averaging
    above 1 with the table's bound and memory of SPARSE_AVG_TABLE unless embN / edbetaX set them), spX (SCAPE's
    sparsity), bfloat (bf16 values), and for sparse averaging budgetX (the byte budget, X of the
    dense bytes a step), rpcN (N ranks train one copy), boundN / embN (the local steps'
    bound, on the embedding table), edbetaX (the shared D's beta on the table), lssX / lspX (the copies' share
    of their local step) and qN (N-bit drifts). None if the name is not of that form."""
    base, *parts = name.split("+")
    if not parts:
        return None
    if base in ("scape90", "scape99"):
        overrides, label = [*SCAPE, f"optimizer.sparsity=0.{base[-2:]}", *_SPEC_RULE], f"SCAPE-{base[-2:]}"
    elif base in ("scape90t", "scape99t"):  # optimizer=scape as it ships (the study's rule)
        overrides, label = list(ARMS[base[:-1]].overrides), f"SCAPE-{base[5:7]} as it ships"
    elif base == "sma99t":
        overrides, label = list(ARMS[base].overrides), ARMS[base].label
    elif base in ("adams", "adamw"):
        overrides, label = [f"optimizer={base}"], {"adams": "AdamS", "adamw": "AdamW"}[base]
    else:
        return None
    labels, group = [], {}
    for part in parts:
        # a part is letters then an optional number (0.787, 13, 6e-3): the shortest letters that
        # leave a number, so lrsum32 is lrsum + 32 and a name may end in e
        match = _PART_NAME.fullmatch(part)
        if match is None:
            return None
        key, number = match.group(1), match.group(2) or ""
        if key not in _PARTS or (("{n}" in " ".join(_PARTS[key][0])) != bool(number)):
            return None
        items, text = _PARTS[key]
        for item in (item.format(n=number) for item in items):
            if item.startswith("group."):
                field, value = item[len("group."):].split("=", 1)
                group[field] = value
            else:
                overrides.append(item)
        labels.append(text.format(n=number))
    overrides += table_group(group, base == "sma99t")
    return Arm(name, f"{label}, " + " + ".join(labels), tuple(merge_overrides(overrides)),
               "composed from its name", False)


# docs/specs/SCAPE.md "Quality targets" and SDP.md "Reference simulation": (arm, kind, bound).
# kind "gap": final val loss - AdamS's <= bound; kind "worse_than": final val loss > that arm's.
TARGETS: List[Tuple[str, str, object]] = [
    ("scape90", "gap", 0.02),
    ("scape99", "gap", 0.05),
    ("scape99_gradient", "worse_than", "scape99"),
    ("scape99_adamw", "worse_than", "scape99"),
    ("bsdp50_fm", "gap", 0.05),
]


def model_overrides(args: argparse.Namespace) -> List[str]:
    """The study's tiny Llama (1.3M parameters at vocab 2048) and its training settings.

    Spelled out here rather than taken from conf/experiment/tiny_* so the study does not move
    when someone retunes the quick-start experiments.
    """
    per_step_sequences = args.global_batch_tokens // args.seq_len
    if args.global_batch_tokens % (args.seq_len * args.nproc) or per_step_sequences % args.nproc:
        raise SystemExit(f"--global-batch-tokens {args.global_batch_tokens} must be a multiple of "
                         f"--seq-len x --nproc = {args.seq_len * args.nproc}")
    micro = min(per_step_sequences // args.nproc, args.max_micro_batch)
    while (per_step_sequences // args.nproc) % micro:
        micro -= 1
    eval_every = args.eval_every or max(1, args.steps // 10)
    return [
        "model=tiny_llama", "model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.n_kv_head=2",
        "model.ffn_hidden=384", f"model.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
        f"tokenizer.vocab_size={args.vocab}",
        "optimizer.lr=3e-3", f"optimizer.warmup_steps={WARMUP_STEPS}", "optimizer.min_lr_ratio=0.1",
        f"train.steps={args.steps}", f"train.global_batch_tokens={args.global_batch_tokens}",
        f"train.micro_batch_size={micro}", f"train.eval_every={eval_every}",
        f"train.eval_batches={args.eval_batches}", "train.ckpt_every=0", "train.keep_last=1",
        f"train.log_every={args.log_every}", f"seed={args.seed}", "logger=console",
    ]


STDLIB_SOURCE = "stdlib-source"


def stdlib_source_corpus(out: Path) -> Path:
    """``--corpus stdlib-source``: every .py file of this CPython's standard library outside its
    test suites and site-packages, one JSON document per file in path order. Large enough that a
    1,200-step study run reads no token twice (tinyshakespeare is read several times over), so a
    horizon measures the optimiser, not how fast it memorises (sizes: docs/RESULTS.md). Written
    once, atomically; the same CPython gives the same file, so the runs' cache folder is reused."""
    if out.is_file():
        return out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib.rglob("*.py")
                   if not {"test", "tests", "site-packages"} & set(path.relative_to(stdlib).parts))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as handle:
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                handle.write(json.dumps({"text": text}) + "\n")
    partial.replace(out)
    return out


def data_overrides(args: argparse.Namespace) -> List[str]:
    """The corpus as train.py overrides; the prepared cache folder is named after corpus and vocab."""
    if args.corpus == STDLIB_SOURCE:
        corpus = stdlib_source_corpus(Path(args.cache_dir).parent / "corpora" / "stdlib_source.jsonl")
        name = args.data_name or f"stdlib_source_v{args.vocab}"
        return ["data=local", f"data.paths=[{corpus}]", f"data.name={name}", f"data.cache_dir={args.cache_dir}"]
    if args.corpus == "embedded":
        name = args.data_name or ("embedded" if args.vocab == 8192 else f"embedded_v{args.vocab}")
        return ["data=embedded", f"data.name={name}", f"data.cache_dir={args.cache_dir}"]
    corpus = Path(args.corpus).resolve()
    if not corpus.is_file():
        raise SystemExit(f"--corpus {corpus}: no such file (pass --corpus embedded to use the built-in text)")
    name = args.data_name or f"{corpus.stem}_v{args.vocab}"
    return ["data=local", f"data.paths=[{corpus}]", f"data.name={name}", f"data.cache_dir={args.cache_dir}"]


def merge_overrides(*groups: Sequence[str]) -> List[str]:
    """Later groups win key by key (Hydra rejects the same key twice on one command line)."""
    merged: Dict[str, str] = {}
    for group in groups:
        for item in group:
            key = item.split("=", 1)[0]
            merged.pop(key, None)
            merged[key] = item
    # Group selections (model=, optimizer=, sdp=, data=, logger=) before their keys, for readability.
    return sorted(merged.values(), key=lambda item: "." in item.split("=", 1)[0])


def arm_command(arm: Arm, args: argparse.Namespace, run_dir: Path, point: Sequence[str] = ()) -> List[str]:
    """``point``: the sweep's lr and seed for this run (they win over the arm's and the study's)."""
    # only these two placeholders: an override's own braces (a parameter group) are Hydra's
    arm_specific = [item.replace("{quarter}", str(max(1, args.steps // 4))).replace("{warmup}", str(WARMUP_STEPS))
                    for item in arm.overrides]
    overrides = merge_overrides(model_overrides(args), data_overrides(args), arm_specific, point, args.set or [])
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            str(REPO / "train.py"), *overrides, f"out_dir={run_dir.parent}", f"run_name={run_dir.name}"]


def _completed_with(run_dir: Path, command: List[str]) -> bool:
    record, summary = run_dir / "study_arm.json", run_dir / "summary.json"
    if not (record.is_file() and summary.is_file()):
        return False
    same = json.loads(record.read_text()).get("command") == command[1:]  # the interpreter may differ
    return same and json.loads(summary.read_text()).get("state") == "completed"


def run_arm(arm: Arm, args: argparse.Namespace, study_runs: Path, run_name: Optional[str] = None,
            point: Sequence[str] = ()) -> dict:
    """Train one arm (unless an identical completed run exists); returns its record for the JSON."""
    run_dir = study_runs / (run_name or arm.name)
    command = arm_command(arm, args, run_dir, point)
    record = {"label": arm.label, "note": arm.note, "overrides": list(arm.overrides),
              "command": shlex.join(["torchrun", *command[3:]])}
    if not args.rerun and _completed_with(run_dir, command):
        print(f"[study] {arm.name}: reusing the completed run in {run_dir}", flush=True)
        return {**record, **json.loads((run_dir / "study_arm.json").read_text()).get("run", {})}
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"[study] {run_dir.name}: {record['command']}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank), WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    started = time.time()
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = -1
    run = {"returncode": returncode, "elapsed_s": round(time.time() - started, 1),
           "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "log": str(log_path)}
    if returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        run["error"] = "\n".join(tail)
        print(f"[study] {arm.name}: FAILED (exit {returncode}); last lines of {log_path}:\n  " +
              "\n  ".join(tail[-10:]), flush=True)
    else:
        print(f"[study] {arm.name}: done in {run['elapsed_s']:.0f} s", flush=True)
    if run_dir.is_dir():
        (run_dir / "study_arm.json").write_text(json.dumps({"command": command[1:], "run": run}, indent=1))
    return {**record, **run}


def val_curve(run_dir: Path) -> Dict[str, List[float]]:
    """Validation points with the cumulative bytes sent at the same step, and the mean training
    loss logged since the previous validation point (``train_loss``): on a corpus the run repeats,
    the two part where the run starts to fit the repeated text rather than the language."""
    records = read_metrics(run_dir)
    bytes_at = {r["step"]: float(r["comm/bytes_cumulative"]) for r in records if "comm/bytes_cumulative" in r}
    train_at = {r["step"]: float(r["train/loss"]) for r in records if "train/loss" in r}
    logged = sorted(bytes_at)
    steps, losses, sent, train = [], [], [], []
    for r in records:
        if "val/loss" not in r:
            continue
        step = r["step"]
        window = [loss for s, loss in train_at.items() if (steps[-1] if steps else 0) < s <= step]
        train.append(sum(window) / len(window) if window else math.nan)
        below = [s for s in logged if s <= step]
        above = [s for s in logged if s >= step]
        if below and above and below[-1] != above[0]:
            s0, s1 = below[-1], above[0]
            b = bytes_at[s0] + (bytes_at[s1] - bytes_at[s0]) * (step - s0) / (s1 - s0)
        else:
            b = bytes_at[below[-1]] if below else math.nan
        steps.append(step)
        losses.append(float(r["val/loss"]))
        sent.append(b)
    return {"step": steps, "val_loss": losses, "bytes_sent": sent, "train_loss": train}


def bytes_to_reach(curve: Dict[str, List[float]], loss: float) -> Optional[float]:
    """Bytes the curve's run had sent when its validation loss first reached ``loss`` (interpolated)."""
    previous = None
    for b, v in zip(curve["bytes_sent"], curve["val_loss"]):
        if v <= loss:
            if previous is None or previous[1] == v:
                return b
            b0, v0 = previous
            return b0 + (b - b0) * (v0 - loss) / (v0 - v)
        previous = (b, v)
    return None


def collect(study_runs: Path, arm_records: Dict[str, dict]) -> Dict[str, dict]:
    """Summaries and curves of every arm with a finished run folder."""
    results: Dict[str, dict] = {}
    for name, arm in ARMS.items():
        run_dir = study_runs / name
        record = dict(arm_records.get(name, {"label": arm.label, "note": arm.note, "overrides": list(arm.overrides)}))
        if (run_dir / "summary.json").is_file():
            summary = json.loads((run_dir / "summary.json").read_text())
            if name not in arm_records and (run_dir / "study_arm.json").is_file():
                launched = json.loads((run_dir / "study_arm.json").read_text())
                record["command"] = shlex.join(["torchrun", *launched["command"][2:]])
                record.update(launched.get("run", {}))
            record["summary"] = {k: summary.get(k) for k in (
                "state", "step", "steps_total", "final_val_loss", "best_val_loss", "bytes_sent_per_rank",
                "dense_bytes_per_rank", "parameters", "wall_time_s", "skipped_steps")}
            record["curve"] = val_curve(run_dir)
        elif name not in arm_records:
            continue
        results[name] = record
    return results


def evaluate_targets(results: Dict[str, dict]) -> List[dict]:
    def final(name: str) -> Optional[float]:
        summary = results.get(name, {}).get("summary") or {}
        return summary.get("final_val_loss") if summary.get("state") == "completed" else None

    reference = final(REFERENCE_ARM)
    out = []
    for name, kind, bound in TARGETS:
        value = final(name)
        if kind == "gap":
            text = f"{ARMS[name].label}: val loss <= AdamS + {bound}"
            if value is None or reference is None:
                out.append({"arm": name, "target": text, "met": None, "detail": "not run"})
                continue
            gap = value - reference
            out.append({"arm": name, "target": text, "met": gap <= bound, "value": round(gap, 4),
                        "detail": f"gap {gap:+.4f}" + ("" if gap <= bound else f", missed by {gap - bound:.4f}")})
        else:
            other = final(str(bound))
            text = f"{ARMS[name].label} worse than {ARMS[str(bound)].label}"
            if value is None or other is None:
                out.append({"arm": name, "target": text, "met": None, "detail": "not run"})
                continue
            out.append({"arm": name, "target": text, "met": value > other, "value": round(value - other, 4),
                        "detail": f"{value:.4f} vs {other:.4f} ({value - other:+.4f})"})
    return out


def _fmt(value: Optional[float], spec: str, missing: str = "—") -> str:
    return missing if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def markdown_table(results: Dict[str, dict], targets: List[dict], settings: dict) -> str:
    ref_name = reference_arm(results)
    reference = results.get(ref_name, {}).get("summary") or {}
    ref_loss = reference.get("final_val_loss")
    ref_curve = results.get(ref_name, {}).get("curve")
    lines = [
        "| arm | steps | final val loss | best val loss | gap to AdamS | MB sent / rank | of dense | "
        "AdamS bytes to this loss ÷ bytes sent | wall time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, record in results.items():
        summary = record.get("summary")
        if not summary or summary.get("state") != "completed":
            why = f"failed (exit {record.get('returncode')})" if record.get("returncode") not in (None, 0) else "not run"
            lines.append(f"| {record['label']} | — | {why} | | | | | | |")
            continue
        loss, sent = summary["final_val_loss"], summary["bytes_sent_per_rank"]
        dense = summary.get("dense_bytes_per_rank") or math.nan
        gap = None if ref_loss is None else loss - ref_loss
        per_byte = "—"
        if ref_curve and name != ref_name and sent:
            needed = bytes_to_reach(ref_curve, loss)
            if needed is None:
                per_byte = f"> {ref_curve['bytes_sent'][-1] / sent:.1f}×" if ref_curve["bytes_sent"] else "—"
            else:
                per_byte = f"{needed / sent:.2f}×"
        lines.append(
            f"| {record['label']} | {summary['step']} | {_fmt(loss, '.4f')} | {_fmt(summary['best_val_loss'], '.4f')} "
            f"| {'—' if name == ref_name else _fmt(gap, '+.4f')} | {sent / 1e6:,.1f} | {sent / dense:.1%} "
            f"| {per_byte} | {_fmt(summary.get('wall_time_s'), '.0f')} |")
    lines += ["", "| target | result | |", "|---|---|---|"]
    for t in targets:
        verdict = {True: "met", False: "**missed**", None: "not run"}[t["met"]]
        lines.append(f"| {t['target']} | {verdict} | {t['detail']} |")
    lines += ["", f"Settings: {settings['description']}"]
    return "\n".join(lines) + "\n"


# --- the fair protocol: every arm at its own best learning rate, several seeds --------------------
# The evaluation corpora (scripts/build_eval_corpora.py): no default was chosen on them.
EVAL_CORPORA_DIR = Path.home() / ".cache" / "scape-sdp" / "eval_corpora"
EVAL_CORPORA = ("manpages", "perl-stdlib")

PRESETS = {
    "fair": {"arms": "adams,scape90,scape99,sma99t",
             "lrs": "1e-3,2e-3,3e-3,6e-3", "seeds": "1337,1"},
    # the same protocol with the embedding table at 16 lr, each arm's best multiple: AdamS, sparse
    # averaging as it ships (SCAPE-99's bytes) and at density 1 with its 2-bit codes (a 90% method)
    "fair_table": {"arms": "adams+elr16,sma99t+elr16,sma99t+budget1+elr16",
                   "lrs": "1e-3,2e-3,3e-3,4e-3", "seeds": "1337,1"},
    # the methods as the tiny experiments ship them (each table at 16 lr), on each evaluation
    # corpus in turn (one study each, NAME_<corpus>); the grid holds every shipped lr (2e-3, 3e-3)
    "evaluation": {"arms": "adams+elr16,scape90t+elr16,scape99t+elr16,sma99t+elr16",
                   "lrs": "1e-3,2e-3,3e-3", "seeds": "1337,1", "corpora": EVAL_CORPORA},
}


def _point_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}/lr{lr:g}_s{seed}"


def _final_loss(run_dir: Path) -> Optional[float]:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    record = json.loads(summary.read_text())
    loss = record.get("final_val_loss")
    return float(loss) if record.get("state") == "completed" and loss is not None and math.isfinite(loss) else None


def best_lr(losses: Dict[float, Optional[float]]) -> Optional[float]:
    """The lr with the lowest final loss (first seed); None if no run finished."""
    done = {lr: loss for lr, loss in losses.items() if loss is not None}
    return min(done, key=done.get) if done else None


def run_sweep(args: argparse.Namespace, study_runs: Path) -> Dict[str, dict]:
    """Stage 1: every arm at every lr with the first seed. An arm whose best lr is an end of the
    grid gets the next lr beyond it (x2 or /2, up to --max-extend times). Stage 2: the other
    seeds at each arm's best lr. Completed runs are reused, so the sweep resumes."""
    first = args.seeds[0]
    arms: Dict[str, dict] = {}
    for name in args.arm_names:
        lrs = sorted(args.lrs)
        losses: Dict[float, Optional[float]] = {}
        for _ in range(args.max_extend + 1):
            for lr in lrs:
                if lr not in losses:
                    if not args.report_only:
                        run_arm(ARMS[name], args, study_runs, _point_name(name, lr, first),
                                (f"optimizer.lr={lr:g}", f"seed={first}"))
                    losses[lr] = _final_loss(study_runs / _point_name(name, lr, first))
            best = best_lr(losses)
            if best is None or (best != lrs[0] and best != lrs[-1]):
                break
            lrs.append(lrs[-1] * 2) if best == lrs[-1] else lrs.insert(0, lrs[0] / 2)
        best = best_lr(losses)
        seeds: Dict[int, Optional[float]] = {first: losses.get(best)} if best is not None else {}
        for seed in args.seeds[1:]:
            if best is None:
                break
            if not args.report_only:
                run_arm(ARMS[name], args, study_runs, _point_name(name, best, seed),
                        (f"optimizer.lr={best:g}", f"seed={seed}"))
            seeds[seed] = _final_loss(study_runs / _point_name(name, best, seed))
        arms[name] = {"label": ARMS[name].label, "overrides": list(ARMS[name].overrides),
                      "lr_losses_first_seed": {f"{lr:g}": loss for lr, loss in sorted(losses.items())},
                      "best_lr": best, "seed_losses_at_best_lr": {str(k): v for k, v in seeds.items()}}
        if best is not None:
            run_dir = study_runs / _point_name(name, best, first)
            summary = json.loads((run_dir / "summary.json").read_text())
            arms[name]["bytes_sent_per_rank"] = summary.get("bytes_sent_per_rank")
            arms[name]["dense_bytes_per_rank"] = summary.get("dense_bytes_per_rank")
            arms[name]["curve"] = val_curve(run_dir)
            arms[name]["run_dir"] = str(run_dir)
    return arms


def _mean(values: Sequence[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def sweep_gaps(arms: Dict[str, dict], shared_lr: float, first_seed: int) -> Dict[str, dict]:
    """Best-against-best gaps to AdamS (mean over seeds; per-seed paired gaps for the spread)
    and the gap at the shared lr (first seed)."""
    ref = arms.get(reference_arm(arms), {})
    ref_seeds = ref.get("seed_losses_at_best_lr", {})
    ref_mean = _mean(list(ref_seeds.values()))
    ref_shared = ref.get("lr_losses_first_seed", {}).get(f"{shared_lr:g}")
    out = {}
    for name, arm in arms.items():
        seeds = arm.get("seed_losses_at_best_lr", {})
        mean = _mean(list(seeds.values()))
        paired = [seeds[s] - ref_seeds[s] for s in seeds if seeds[s] is not None and ref_seeds.get(s) is not None]
        shared = arm.get("lr_losses_first_seed", {}).get(f"{shared_lr:g}")
        out[name] = {"mean": mean, "gap": None if mean is None or ref_mean is None else mean - ref_mean,
                     "paired_gaps": paired,
                     "shared_gap": None if shared is None or ref_shared is None else shared - ref_shared}
    return out


def _last_train_loss(arm: dict) -> Optional[float]:
    """The mean training loss over the last validation interval of an arm's best-lr run."""
    train = (arm.get("curve") or {}).get("train_loss") or [math.nan]
    return train[-1] if math.isfinite(train[-1]) else None


def sweep_table(arms: Dict[str, dict], gaps: Dict[str, dict], args: argparse.Namespace) -> str:
    lrs = sorted({float(lr) for arm in arms.values() for lr in arm["lr_losses_first_seed"]})
    head = " | ".join(f"lr {lr:g}" for lr in lrs)
    lines = [f"| arm | {head} | best lr | val loss at best lr ({', '.join(f's{s}' for s in args.seeds)}) | mean "
             f"| gap to AdamS, best vs best (per seed) | gap at lr {args.shared_lr:g} | of dense bytes "
             f"| train loss, last interval (s{args.seeds[0]}) | its gap to AdamS |",
             "|---|" + "---:|" * len(lrs) + "---:|---|---:|---|---:|---:|---:|---:|"]
    ref_name = reference_arm(arms)
    ref_train = _last_train_loss(arms.get(ref_name, {}))
    for name, arm in arms.items():
        cells = [_fmt(arm["lr_losses_first_seed"].get(f"{lr:g}"), ".4f", "") for lr in lrs]
        best = arm.get("best_lr")
        cells = [f"**{c}**" if best is not None and f"{lr:g}" == f"{best:g}" and c else c for c, lr in zip(cells, lrs)]
        seeds = " / ".join(_fmt(v, ".4f") for v in arm["seed_losses_at_best_lr"].values())
        g = gaps[name]
        paired = ", ".join(f"{v:+.4f}" for v in g["paired_gaps"])
        gap = "—" if name == ref_name else f"{_fmt(g['gap'], '+.4f')} ({paired})"
        share = (arm.get("bytes_sent_per_rank") or math.nan) / (arm.get("dense_bytes_per_rank") or math.nan)
        train = _last_train_loss(arm)
        train_gap = "—" if name == ref_name or train is None or ref_train is None else f"{train - ref_train:+.4f}"
        lines.append(f"| {arm['label']} | {' | '.join(cells)} | {'—' if best is None else f'{best:g}'} | {seeds} "
                     f"| {_fmt(g['mean'], '.4f')} | {gap} | "
                     f"{'—' if name == ref_name else _fmt(g['shared_gap'], '+.4f')} | {_fmt(share, '.1%')} "
                     f"| {_fmt(train, '.4f')} | {train_gap} |")
    lines += ["", f"Settings: {args.description}. Best lr chosen by the first seed's final validation loss "
              f"(in bold); the other seeds run at that lr; an arm whose best lr was an end of the grid got the "
              f"next lr beyond it. The training loss is the mean logged over the last validation interval at "
              f"the best lr (for sparse averaging, of the ranks' own copies, not of their average)."]
    return "\n".join(lines) + "\n"


def sweep_main(args: argparse.Namespace, study_runs: Path, invocation: str) -> int:
    machine_start = machine_info()
    arms = run_sweep(args, study_runs)
    gaps = sweep_gaps(arms, args.shared_lr, args.seeds[0])
    table = sweep_table(arms, gaps, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(table)
    report = {"study": args.name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": invocation, "protocol": "per-arm lr sweep (first seed), other seeds at the best lr",
              "settings": {"description": args.description, "lrs": args.lrs, "seeds": args.seeds,
                           "steps": args.steps, "global_batch_tokens": args.global_batch_tokens,
                           "nproc": args.nproc, "extra_overrides": args.set or []},
              "machine": {**machine_start, "load_avg_1_5_15min_end": [round(x, 2) for x in os.getloadavg()]},
              "gaps": gaps, "arms": arms}
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    finished = {f"{a['label']} (lr {a['best_lr']:g})": read_metrics(Path(a["run_dir"]))
                for a in arms.values() if a.get("run_dir")}
    if finished:
        plot_curves(finished, args.out / f"{args.name}_val_loss.png", "val/loss", ("step", "bytes"),
                    title=f"'{args.name}': each arm at its best lr, seed {args.seeds[0]}")
    print(table)
    print(f"[study] wrote {args.out / (args.name + '.md')}, .json and _val_loss.png")
    return 0 if all(a.get("best_lr") is not None for a in arms.values()) else 1



def machine_info() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": __import__("torch").__version__, "backend": "gloo (CPU)",
            "load_avg_1_5_15min": [round(x, 2) for x in os.getloadavg()]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="all", help=f"comma-separated, 'all' (the issue's arms) or "
                        f"'extra' (attempts at the gap): {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the dense arms")
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks per arm (SDP at C=0.5 wants 4)")
    parser.add_argument("--global-batch-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-micro-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary trained on the corpus")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS) if DEFAULT_CORPUS.is_file() else "embedded",
                        help="a text file, 'embedded', or 'stdlib-source' (this CPython's library source: "
                             "horizons without repeated data; default: tinyshakespeare when present)")
    parser.add_argument("--data-name", default=None, help="name of the prepared corpus's cache folder")
    parser.add_argument("--cache-dir", default=str(REPO / "cache" / "data"))
    parser.add_argument("--eval-every", type=int, default=0, help="0 = steps / 10")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="a train.py override for every arm (repeatable; wins over the study's)")
    parser.add_argument("--name", default="quality", help="study name: output file stem and run folder")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "study")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per arm")
    parser.add_argument("--rerun", action="store_true", help="train arms again even if a completed run matches")
    parser.add_argument("--report-only", action="store_true", help="only rebuild table, JSON and plots")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="fair: the issue's protocol (arms, lrs, seeds); fair_table: "
                        "the same with the embedding table at 16 lr; evaluation: the shipped methods on "
                        "each evaluation corpus (scripts/build_eval_corpora.py) unless --corpus is given")
    parser.add_argument("--lrs", default="", help="comma-separated learning rates: sweep each arm over them "
                        "(the fair protocol); empty = every arm at lr 3e-3")
    parser.add_argument("--seeds", default="", help="comma-separated seeds for a sweep (default: --seed)")
    parser.add_argument("--max-extend", type=int, default=2, help="lrs added beyond a grid end that wins")
    parser.add_argument("--shared-lr", type=float, default=3e-3, help="the lr of the shared-lr gap column")
    args = parser.parse_args(argv)
    if args.preset:
        preset = PRESETS[args.preset]
        given = set(argv if argv is not None else sys.argv[1:])
        args.arms = args.arms if "--arms" in given else preset["arms"]
        args.lrs = args.lrs or preset["lrs"]
        args.seeds = args.seeds or preset["seeds"]
    try:
        args.lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError as exc:
        parser.error(f"--lrs / --seeds: {exc}")
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        parser.error(f"--lrs must be positive numbers, got {args.lrs}")
    args.sweep = bool(args.lrs) or len(args.seeds) > 1
    if args.sweep and not args.lrs:
        args.lrs = [3e-3]
    corpus = Path(args.corpus).name if args.corpus != "embedded" else "embedded corpus"
    args.description = (f"{corpus}, BPE vocab {args.vocab}, tiny Llama (4 blocks, d 128), {args.nproc} gloo ranks, "
                        f"{args.global_batch_tokens} tokens per step, {args.steps} steps, "
                        f"{WARMUP_STEPS} warm-up steps then cosine to 10%")
    aliases = {"all": [n for n, a in ARMS.items() if a.in_all], "extra": [n for n, a in ARMS.items() if not a.in_all]}
    names = [n for item in args.arms.split(",") if item.strip()
             for n in aliases.get(item.strip(), [item.strip()])]
    for name in names:
        composed = None if name in ARMS else compose_arm(name)
        if composed is not None:
            ARMS[name] = composed
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    args.arm_names = names
    return args


def _without_name(argv: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """argv without its --name (NAME or --name=NAME), and that name."""
    rest, name, it = [], None, iter(argv)
    for item in it:
        if item == "--name":
            name = next(it, None)
        elif item.startswith("--name="):
            name = item.split("=", 1)[1]
        else:
            rest.append(item)
    return rest, name


def evaluation_main(argv: Sequence[str]) -> int:
    """``--preset evaluation`` without ``--corpus``: the study on every evaluation corpus in turn,
    each its own study named NAME_<corpus> (NAME: --name, else "evaluation")."""
    missing = [c for c in EVAL_CORPORA if not (EVAL_CORPORA_DIR / f"{c}.jsonl").is_file()]
    if missing:
        raise SystemExit(f"--preset evaluation: {', '.join(missing)} not found in {EVAL_CORPORA_DIR}; build them "
                         f"with `python scripts/build_eval_corpora.py --install`, or pass --corpus FILE")
    rest, name = _without_name(argv)
    return max(main([*rest, "--corpus", str(EVAL_CORPORA_DIR / f"{c}.jsonl"), "--name", f"{name or 'evaluation'}_{c}"])
               for c in EVAL_CORPORA)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.preset == "evaluation" and not any(a == "--corpus" or a.startswith("--corpus=") for a in argv):
        return evaluation_main(argv)
    study_runs = args.runs_dir / args.name
    invocation = shlex.join(["python", "scripts/study_quality.py", *argv])
    if args.sweep:
        return sweep_main(args, study_runs, invocation)
    machine_start = machine_info()
    arm_records: Dict[str, dict] = {}
    if not args.report_only:
        for name in args.arm_names:
            arm_records[name] = run_arm(ARMS[name], args, study_runs)
    previous = args.out / f"{args.name}.json"
    results = collect(study_runs, arm_records)
    if previous.is_file():  # keep how earlier invocations ran the arms this one reused
        old = json.loads(previous.read_text()).get("arms", {})
        for name, record in results.items():
            if name not in arm_records and name in old:
                results[name] = {**old[name], **record}
    targets = evaluate_targets(results)
    settings = {
        "corpus": args.corpus, "vocab": args.vocab, "nproc": args.nproc, "steps": args.steps,
        "global_batch_tokens": args.global_batch_tokens, "seq_len": args.seq_len,
        "tokens_per_arm": args.steps * args.global_batch_tokens, "extra_overrides": args.set or [],
        "description": (f"{Path(args.corpus).name if args.corpus != 'embedded' else 'embedded corpus'}, "
                        f"BPE vocab {args.vocab}, tiny Llama (4 blocks, d 128), {args.nproc} gloo ranks, "
                        f"{args.global_batch_tokens} tokens per step, {args.steps} steps "
                        f"({args.steps * args.global_batch_tokens:,} tokens; FLOP-matched SDP runs 2x the "
                        f"steps), lr 3e-3 cosine, one seed ({args.seed})."),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, targets, settings)
    (args.out / f"{args.name}.md").write_text(table)
    report = {"study": args.name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": invocation, "settings": settings,
              "machine": {**machine_start, "load_avg_1_5_15min_end": [round(x, 2) for x in os.getloadavg()]},
              "targets": targets, "arms": results}
    if args.report_only and previous.is_file():  # the study's own date and command, not this rebuild's
        old_report = json.loads(previous.read_text())
        report.update({k: old_report[k] for k in ("date", "command") if k in old_report},
                      report_rebuilt={"date": report["date"], "command": invocation})
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    finished = {results[n]["label"]: read_metrics(study_runs / n) for n in results if results[n].get("summary")}
    if finished:
        plot_curves(finished, args.out / f"{args.name}_val_loss.png", "val/loss", ("step", "bytes"),
                    title=f"quality study '{args.name}': {args.nproc} ranks x {args.global_batch_tokens} tokens/step, "
                          f"{args.steps} steps")
    print(table)
    print(f"[study] wrote {args.out / (args.name + '.md')}, .json and _val_loss.png")
    failed = [n for n in args.arm_names if arm_records.get(n, {}).get("returncode") not in (None, 0)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
