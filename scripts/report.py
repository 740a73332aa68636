"""Rebuild the generated tables of docs/RESULTS.md and README.md from the JSON under docs/results.

    python scripts/report.py           # rewrite every block between its report markers
    python scripts/report.py --check   # exit 1 where a committed block differs from what it builds

A block is the text between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; each NAME is one
builder below, and each table names the artifacts it reads and the commands that wrote them. An
optional artifact that is not there yet becomes one visible line instead of a table; a required
one that is missing stops the report with its path.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
DOCS = (REPO / "docs" / "RESULTS.md", REPO / "README.md")
FIRST_SEED = "1337"  # the study chooses each arm's lr on this seed's losses
BLOCK = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


class MissingArtifact(Exception):
    """A required artifact is not under docs/results."""


def bundles() -> Dict[str, str]:
    """Each artifact kept inside a bundle -> the bundle's file name. A bundle holds the JSON files a
    study wrote in pieces (one invocation per lr or seed), each verbatim under its own name, so
    docs/results stays a short list (``--bundle``)."""
    return _bundles(RESULTS)


@functools.lru_cache(maxsize=None)
def _bundles(results: Path) -> Dict[str, str]:
    found = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("pieces"), dict):
            found.update({piece: path.name for piece in data["pieces"]})
    return found


def artifact_names() -> List[str]:
    """Every artifact a table can read: the files under docs/results and the pieces of its bundles."""
    return sorted({p.name for p in RESULTS.iterdir() if p.is_file()} | set(bundles()))


def load(name: str, optional: bool = False) -> Optional[dict]:
    path = RESULTS / name
    if path.is_file():
        return json.loads(path.read_text())
    bundle = bundles().get(name)
    if bundle is not None:
        return json.loads((RESULTS / bundle).read_text())["pieces"][name]
    if optional:
        return None
    raise MissingArtifact(f"docs/results/{name} is missing: restore it from git or rerun its command")


def link(name: str) -> str:
    bundle = None if (RESULTS / name).is_file() else bundles().get(name)
    return f"[{name}](results/{name})" if bundle is None else f"{name} in [{bundle}](results/{bundle})"


def bundle(target: str, names: Sequence[str]) -> None:
    """Move the artifacts ``names`` (files under docs/results) into the bundle ``target``, each
    verbatim under its own name; the bundle is written before any piece is removed."""
    path = RESULTS / target
    data = json.loads(path.read_text()) if path.is_file() else {"bundle": target, "pieces": {}}
    for name in names:
        data["pieces"][name] = json.loads((RESULTS / name).read_text())
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)
    for name in names:
        (RESULTS / name).unlink()
    _bundles.cache_clear()


def clean_command(command: str) -> str:
    """The command with its machine-local folders left out (they do not change a number), and the
    embedding table's lr multiple in today's spelling (a parameter group: optimizer.param_groups)
    where the command was recorded with the key it replaced."""
    command = re.sub(r"\s--(cache-dir|runs-dir|out)\s+\S+", "", command)
    command = re.sub(r"--set optimizer\.embedding_lr_scale=(\S+)",
                     r"--set 'optimizer.param_groups=[{match:embedding,lr_scale:\1}]'", command)
    command = re.sub(r"(--corpus\s+)\S*/(\S+)", r"\1\2", command)
    return re.sub(r"\s+", " ", command).strip()


def command_lines(names: Iterable[str]) -> List[str]:
    lines = []
    for name in names:
        data = load(name)
        lines.append(f"- {link(name)}: `{clean_command(str(data.get('command', '(no command recorded)')))}`")
    return lines


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: Optional[str] = None) -> List[str]:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


# ---- the study's arms: best lr on the first seed, the other seeds there, gap to a reference ----

def arm_runs(arm: str, files: Sequence[str]) -> Tuple[Dict[Tuple[float, str], float], Optional[float]]:
    """Every (lr, seed) -> final validation loss of one arm across study files, and its byte share."""
    runs: Dict[Tuple[float, str], float] = {}
    share = None
    for name in files:
        data = load(name)
        entry = data["arms"][arm]
        first = str(data["settings"]["seeds"][0])
        for lr, loss in entry["lr_losses_first_seed"].items():
            if loss is not None:
                runs[(float(lr), first)] = loss
        for seed, loss in entry["seed_losses_at_best_lr"].items():
            if loss is not None:
                runs[(float(entry["best_lr"]), str(seed))] = loss
        if share is None and entry.get("dense_bytes_per_rank"):
            share = entry["bytes_sent_per_rank"] / entry["dense_bytes_per_rank"]
    return runs, share


def best_of(runs: Dict[Tuple[float, str], float]) -> Tuple[float, Dict[str, float]]:
    chooser = FIRST_SEED if any(seed == FIRST_SEED for _, seed in runs) else min(s for _, s in runs)
    lrs = {lr: loss for (lr, seed), loss in runs.items() if seed == chooser}
    best = min(lrs, key=lrs.get)
    at_best = {seed: loss for (lr, seed), loss in runs.items() if lr == best}
    return best, {seed: at_best[seed] for seed in sorted(at_best, key=lambda s: (s != chooser, int(s)))}


def fmt_lr(lr: float) -> str:
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def fmt_gap(value: float, digits: int = 3) -> str:
    return "−" + f"{-value:.{digits}f}" if value < 0 else f"+{value:.{digits}f}"


def summarize(row: dict) -> dict:
    """A study row with its best lr, the seeds' losses there, their mean, the lrs tried and its byte share."""
    runs, share = arm_runs(row["arm"], row["files"])
    best, seeds = best_of(runs)
    return dict(row, best=best, seeds=seeds, mean=sum(seeds.values()) / len(seeds),
                tried=sorted({lr for lr, _ in runs}), share=share)


def study_table(rows: Sequence[dict], reference_label: str = "AdamS") -> List[str]:
    """rows: label, arm, files, and ref (the index of the row it is compared with; none: a reference)."""
    built = [summarize(row) for row in rows]
    out = []
    for row in built:
        ref = built[row["ref"]] if row.get("ref") is not None else None
        gap = "—"
        if ref is not None:
            paired = [fmt_gap(loss - ref["seeds"][s]) for s, loss in row["seeds"].items() if s in ref["seeds"]]
            gap = f"**{fmt_gap(row['mean'] - ref['mean'])}**" + (f" ({', '.join(paired)})" if len(paired) > 1 else "")
        seeds = " / ".join(f"{row['seeds'][s]:.4f}" for s in row["seeds"])
        out.append([row["label"], ", ".join(fmt_lr(lr) for lr in row["tried"]), fmt_lr(row["best"]),
                    f"{seeds} (seeds {', '.join(row['seeds'])})", f"{row['mean']:.4f}", gap,
                    "—" if row["share"] is None else f"{row['share']:.1%}"])
    header = ["arm", "lrs tried", "best lr", "val loss at the best lr", "mean",
              f"gap to {reference_label} (per seed)", "of dense bytes"]
    return table(header, out)


def study_block(rows: Sequence[dict], reference_label: str = "AdamS") -> List[str]:
    files = list(dict.fromkeys(f for row in rows for f in row["files"]))
    return [*study_table(rows, reference_label), "", "Commands (machine-local folders left out):", *command_lines(files)]


FAIR = "fair_table_t.json"
SCAPE_X16 = ["ts300_scape_elr.json", "ts300_scape_elr_lr.json", "ts300_scape_elr_lr05.json",
             "ts300_scape_elr_lr1.json", "ts300_scape_elr_lr1_90.json", "ts300_scape_elr_lr2.json",
             "ts300_scape_elr_s1.json"]


def quality_rows() -> List[dict]:
    scape99 = [f for f in SCAPE_X16 if "scape99" in load(f)["arms"]]
    scape90 = [f for f in SCAPE_X16 if "scape90" in load(f)["arms"]]
    return [
        dict(label="AdamS (dense)", arm="adams+elr16", files=[FAIR]),
        dict(label="sparse averaging as it ships (`optimizer=sparse_avg`)", arm="sma99t+elr16", files=[FAIR], ref=0),
        dict(label="sparse averaging at density 1, 2-bit codes", arm="sma99t+sp0+minsp0+lrpow0+elr16", files=[FAIR], ref=0),
        dict(label="SCAPE-90 (`optimizer=scape optimizer.sparsity=0.9`)", arm="scape90", files=scape90, ref=0),
        dict(label="SCAPE-99 (`optimizer=scape`)", arm="scape99", files=scape99, ref=0),
    ]


def build_quality() -> List[str]:
    return study_block(quality_rows())


# The evaluation study (study_quality.py --preset evaluation): one file per evaluation corpus,
# each method as a tiny experiment ships it, compared best-lr against best-lr and at the lr its
# experiment ships with (the transfer a user gets without tuning).
EVALUATION = {"manpages": "evaluation_manpages.json", "perl-stdlib": "evaluation_perl-stdlib.json"}
EVALUATION_ARMS = [("AdamS (dense)", "adams+elr16", "tiny_adams"), ("SCAPE-90", "scape90t+elr16", "tiny_scape90"),
                   ("SCAPE-99", "scape99t+elr16", "tiny_scape99"),
                   ("sparse averaging", "sma99t+elr16", "tiny_sma99")]


EXPERIMENTS = REPO / "conf" / "experiment"  # the checkout's configs (not an artifact of the report)


def shipped_lr(experiment: str) -> float:
    """The lr conf/experiment/EXPERIMENT.yaml ships with."""
    import yaml

    return float(yaml.safe_load((EXPERIMENTS / f"{experiment}.yaml").read_text())["optimizer"]["lr"])


def evaluation_rows(corpus: str, name: str) -> List[List[str]]:
    data = load(name)
    present = [(label, arm, exp) for label, arm, exp in EVALUATION_ARMS if arm in data["arms"]]
    built = {arm: summarize(dict(arm=arm, files=[name])) for _, arm, _ in present}
    ref_arm, ref_exp = EVALUATION_ARMS[0][1], EVALUATION_ARMS[0][2]
    ref = built.get(ref_arm)
    at_shipped = {arm: data["arms"][arm]["lr_losses_first_seed"].get(f"{shipped_lr(exp):g}") for _, arm, exp in present}
    rows = []
    for label, arm, exp in present:
        row, gap, transfer = built[arm], "—", "—"
        if ref is not None and arm != ref_arm:
            paired = [fmt_gap(loss - ref["seeds"][s]) for s, loss in row["seeds"].items() if s in ref["seeds"]]
            gap = f"**{fmt_gap(row['mean'] - ref['mean'])}** ({', '.join(paired)})"
            if at_shipped[arm] is not None and at_shipped.get(ref_arm) is not None:
                transfer = fmt_gap(at_shipped[arm] - at_shipped[ref_arm])
        seeds = " / ".join(f"{row['seeds'][s]:.4f}" for s in row["seeds"])
        shipped = at_shipped[arm]
        rows.append([corpus, label, ", ".join(fmt_lr(lr) for lr in row["tried"]), fmt_lr(row["best"]),
                     f"{seeds} (seeds {', '.join(row['seeds'])})", f"{row['mean']:.4f}", gap,
                     f"{fmt_lr(shipped_lr(exp))}: {'—' if shipped is None else f'{shipped:.4f}'}", transfer,
                     "—" if row["share"] is None else f"{row['share']:.1%}"])
    return rows


def evaluation_gaps(arm: str) -> str:
    """One arm's best-vs-best gap to AdamS on each evaluation corpus measured ("—" where none is)."""
    ref = EVALUATION_ARMS[0][1]
    cells = []
    for corpus, name in EVALUATION.items():
        data = load(name, optional=True)
        if data is None or arm not in data["arms"] or ref not in data["arms"]:
            continue
        row, base = summarize(dict(arm=arm, files=[name])), summarize(dict(arm=ref, files=[name]))
        n = len(row["seeds"])
        cells.append(f"{corpus} " + (f"{base['mean']:.4f}" if arm == ref else
                                     f"{fmt_gap(row['mean'] - base['mean'])} (lr {fmt_lr(row['best'])}, {n} seed{'s' * (n > 1)})"))
    return "; ".join(cells) if cells else "—"


def build_evaluation() -> List[str]:
    present = {corpus: name for corpus, name in EVALUATION.items() if load(name, optional=True) is not None}
    if not present:
        return ["*Not measured yet: `python scripts/study_quality.py --preset evaluation` writes "
                + " and ".join(f"docs/results/{n}" for n in EVALUATION.values()) + ".*"]
    header = ["corpus", "arm", "lrs tried", "best lr", "val loss at the best lr", "mean",
              "gap to AdamS, best vs best (per seed)", "shipped lr: val loss (seed 1337)",
              "gap to AdamS, both at their shipped lr", "of dense bytes"]
    rows = [row for corpus, name in present.items() for row in evaluation_rows(corpus, name)]
    return [*table(header, rows), "", "Commands (machine-local folders left out):", *command_lines(present.values())]


HORIZON = [
    dict(label="AdamS, lr 3e-3", arm="adams+elr16", files=["ts1200_elr_adams.json", "ts1200_elr_s1_adams.json"]),
    dict(label="sparse averaging as it ships, lr 2e-3", arm="sma99t+elr16", files=["ts1200_sma99t.json"], ref=0),
]


def build_horizon() -> List[str]:
    return study_block(HORIZON)


def batch_files(tokens: int) -> List[str]:
    return [name for name in artifact_names() if re.fullmatch(rf"ts300_b{tokens}_t3.*\.json", name)]


def build_batch() -> List[str]:
    rows: List[dict] = []
    for tokens in (1024, 4096, 8192):
        files = batch_files(tokens)
        rows.append(dict(label=f"AdamS, {tokens:,} tokens", arm="adams+elr16",
                         files=[f for f in files if "adams+elr16" in load(f)["arms"]]))
        rows.append(dict(label=f"sparse averaging, {tokens:,} tokens", arm="sma99t+elr16",
                         files=[f for f in files if "sma99t+elr16" in load(f)["arms"]], ref=len(rows) - 1))
    return study_block(rows)


COPIES = [
    dict(label="8 copies: AdamS", arm="adams+elr16", files=["src300_r8_elr_lr3.json", "src300_r8_s1.json"]),
    dict(label="8 copies: sparse averaging", arm="sma99e+elr16+emb4.47",
         files=["src300_r8_emb30.json", "src300_r8_emb30_s1.json"], ref=0),
    dict(label="16 copies: AdamS", arm="adams+elr16", files=["src300_r16_elr_lr3.json", "src300_r16_elr_s1_adams.json"]),
    dict(label="16 copies: sparse averaging", arm="sma99t+elr16",
         files=["src300_r16_t31lr.json", "src300_r16_t31lr4.json", "src300_r16_t31_s1.json"], ref=2),
    dict(label="16 copies, 1,200 steps: AdamS", arm="adams+elr16", files=["src1200_r16_adams31.json"]),
    dict(label="16 copies, 1,200 steps: sparse averaging", arm="sma99t+elr16", files=["src1200_r16_t31.json"], ref=4),
]


def build_copies() -> List[str]:
    return study_block(COPIES)


SDP_QUALITY = ["adams", "bsdp50", "bsdp50_fm", "nsdp50", "nsdp50_fm"]


def build_sdp_quality() -> List[str]:
    data = load("quality.json")
    arms = data["arms"]
    ref = arms["adams"]["summary"]["final_val_loss"]
    rows = []
    for key in SDP_QUALITY:
        s = arms[key]["summary"]
        gap = "—" if key == "adams" else fmt_gap(s["final_val_loss"] - ref)
        rows.append([arms[key]["label"], f"{s['final_val_loss']:.4f}", gap,
                     f"{s['bytes_sent_per_rank'] / s['dense_bytes_per_rank']:.1%}"])
    sdp = load("sdp_scape.json")["arms"]
    base = sdp["bsdp50"]["seed_losses_at_best_lr"][FIRST_SEED]
    for key in ("bsdp50", "bsdp50_scape90"):
        entry = sdp[key]
        loss = entry["seed_losses_at_best_lr"][FIRST_SEED]
        rows.append([f"{entry['label']} (later code)", f"{loss:.4f}",
                     "—" if key == "bsdp50" else fmt_gap(loss - base) + " against B-SDP",
                     f"{entry['bytes_sent_per_rank'] / entry['dense_bytes_per_rank']:.1%}"])
    return [*table(["arm (lr 3e-3, seed 1337)", "val loss", "gap to AdamS", "of dense bytes"], rows), "",
            *command_lines(["quality.json", "sdp_scape.json"])]


# ---- benchmarks ----

BENCH_COMM = "bench_comm.json"
BENCH_COMM_COMMAND = "python scripts/bench_comm.py --out docs/results/bench_comm.json"


def comm_compression() -> Dict[str, float]:
    """Each bench_comm arm's steady-state compression against the dense fp32 all-reduce."""
    return {name: arm["compression_vs_dense_fp32"] for name, arm in load(BENCH_COMM)["counted"]["arms"].items()}


def build_bytes() -> List[str]:
    data = load(BENCH_COMM)
    counted = data["counted"]
    rows = [[f"`{name}`", f"{arm['steady_total']:,.0f}", f"{arm['compression_vs_dense_fp32']:.2f}×"]
            for name, arm in counted["arms"].items()]
    layouts = [[name, str(world.split("_")[1]), f"{arms['dense_adams']['total']:.3e}",
                f"{arms['scape90_auto']['total']:.3e}", f"{arms['scape99_auto']['total']:.3e}"]
               for name, layout in data["formula"].items()
               for world, arms in layout.items() if world.startswith("world_")]
    return [*table([f"arm ({counted['world']} gloo ranks, {counted['model']}, {counted['parameters']:,} parameters)",
                    "bytes per rank per step", "fewer than dense fp32"], rows), "",
            "The same formula applied to the named sizes (bytes per rank per step):", "",
            *table(["model", "ranks", "dense fp32", "SCAPE-90", "SCAPE-99"], layouts), "",
            f"Command: `{BENCH_COMM_COMMAND}` ({link(BENCH_COMM)}; {data['machine']})."]


def build_optimizer_work() -> List[str]:
    data = load("bench_optimizer_h17b_loaded.json")
    sec = data["seconds"]
    dense = sec["dense_adams"]
    rows = [["dense AdamS step", f"{dense['min']['step']:.3f} / {dense['median']['step']:.3f}", "1"]]
    for arm in ("scape90", "scape90_threshold", "scape99", "scape99_threshold"):
        entry = sec[arm]
        rows.append([f"`{arm}`", f"{entry['min']['total']:.3f} / {entry['median']['total']:.3f}",
                     f"{entry['ratio_vs_dense_adams_min']:.2f} / {entry['ratio_vs_dense_adams_median']:.2f}"])
    return [*table([f"one optimizer step, {data['numel']:,} floats, {data['machine']}",
                    "seconds (min / median)", "against dense AdamS"], rows),
            "", "Command: `OMP_NUM_THREADS=1 python scripts/bench_optimizer.py --threads 1 --repeats 3` "
                "([bench_optimizer_h17b_loaded.json](results/bench_optimizer_h17b_loaded.json), at load 13)."]


def network_rows(data: dict, arms: Sequence[str]) -> List[List[str]]:
    rows = []
    for rate, entry in data["rates"].items():
        for arm in arms:
            if arm in entry:
                run = entry[arm]
                speed = entry["speedup_vs_adams"].get(arm)
                rows.append([rate, f"`{arm}`", f"{run['bytes_per_step']:,.0f}", f"{run['step_time_s']:.3f}",
                             "1" if arm == "adams" else f"{speed:.2f}×"])
    return rows


def build_network() -> List[str]:
    over = load("network_overlapped.json")
    avg = load("network_sparse_avg_idle.json")
    header = ["link", "arm (2 ranks over a tc-shaped veth pair)", "bytes per step", "step time (s)",
              "speed against DDP AdamS"]
    ttl = load("time_to_loss.json")["rates"]["1gbit"]["time_to_loss"]
    ttl_rows = [[f"`{arm}`", str(ttl[arm]["steps"]) if ttl[arm]["reached"] else f"not in {ttl[arm]['steps']}", f"{ttl[arm]['train_wall_s']:.1f}",
                 "1" if arm == ttl["reference"] else f"{ttl[arm]['wall_vs_reference']:.3f}",
                 "1" if arm == ttl["reference"] else f"{ttl[arm]['bytes_vs_reference']:.3f}"]
                for arm in (ttl["reference"], "scape90", "scape99", "sparse_avg") if arm in ttl]
    return [*table(header, network_rows(over, ["adams", "adams_after_backward", "scape90", "scape99"])), "",
            "Sparse averaging, in a run of its own:", "",
            *table(header, network_rows(avg, ["adams", "scape99", "sparse_avg"])), "",
            f"To dense AdamS's loss after {ttl['S']} steps ({ttl['target_val_loss']:.4f}), 1 Gbit/s:", "",
            *table(["arm", "steps", "train wall (s)", "wall against AdamS", "bytes against AdamS"], ttl_rows), "",
            *command_lines(["network_overlapped.json", "network_sparse_avg_idle.json", "time_to_loss.json"])]


WIRE_COMMAND = "the network helper's wire capture (scripts/bench_network.py)"


def build_wire() -> List[str]:
    data = load("network_wire.json", optional=True)
    if data is None:
        return ["*Not measured yet: docs/results/network_wire.json is missing (it holds the bytes a packet "
                "capture saw on the link against the bytes the counters counted).*"]
    bounded = any("within_bound" in a for a in data["arms"])
    rows = [[f"`{a['arm']}`", f"{a['counted_bytes']:,.0f}", f"{a['measured_bytes']:,.0f}", f"{a['ratio']:.3f}",
             *([("yes" if a.get("within_bound") else "**no**")] if bounded else [])] for a in data["arms"]]
    header = ["arm", "counted bytes", "bytes on the wire", "wire / counted", *(["within the bound"] if bounded else [])]
    return [*table(header, rows), "",
            f"Link: {data['link']}; the overhead bound: {data['overhead_bound']}.", "",
            *command_lines(["network_wire.json"])]


def build_gpu_check() -> List[str]:
    data = load("gpu_check.json", optional=True)
    if data is None:
        return ["*Not run yet: docs/results/gpu_check.json is missing (`bash scripts/gpu_check.sh` on one GPU "
                "writes it).*"]
    rows = []
    for name, part in data["parts"].items():
        checks = part.get("checks", [])
        misses = [c["name"] for c in checks if not c.get("ok")]
        rows.append([name, "ok" if part.get("ok") else "**failed**",
                     f"{len(checks) - len(misses)} of {len(checks)}", "; ".join(misses) or part.get("error", "") or "—"])
    wall = data.get("wall_s")
    return [*table(["part", "result", "checks passed", "missed"], rows, align="llrl"), "",
            f"Command: `{data.get('command', 'bash scripts/gpu_check.sh')}`"
            + (f", {wall:.0f} s" if isinstance(wall, (int, float)) else "") + f" ({link('gpu_check.json')})."]


def build_sdp_memory() -> List[str]:
    rows = []
    for name in ("bench_sdp_adams_block.json", "bench_sdp_scape90.json"):
        data = load(name)
        for r in data["results"]:
            optimizer = data["optimizer"] if data["sparsity"] is None else f"{data['optimizer']} {data['sparsity']}"
            rows.append([optimizer,
                         r["name"], f"{r['peak_bytes_max'] / 2**20:.1f}", f"{r['peak_vs_ddp']:.2f}",
                         f"{r['allreduce_bytes_per_step_max']:,.0f}", f"{r['allreduce_vs_ddp']:.2f}"])
    return [*table(["optimizer", "arm (4 workers, C = 0.5)", "peak MiB per worker", "against DDP",
                    "bytes per step", "against DDP"], rows), "",
            *command_lines(["bench_sdp_adams_block.json", "bench_sdp_scape90.json"])]


def build_optimizer_memory() -> List[str]:
    data = load("optimizer_memory.json")
    per = data["per_rank_max"]
    arms = sorted({key.split("@")[0] for key in per}, key=lambda a: (a.replace("_sharded", ""), a))
    worlds = sorted({int(key.split("@")[1]) for key in per})
    rows = [[f"`{arm}`", *(f"{per[f'{arm}@{w}'] / 2**20:.1f}" for w in worlds)] for arm in arms]
    return [*table(["optimizer state per rank, MiB", *(f"{w} rank{'s' if w > 1 else ''}" for w in worlds)], rows), "",
            f"{data['model']} ({data['parameters']:,} parameters). Command: `python scripts/bench_optimizer_memory.py --out docs/results/optimizer_memory.json` "
            f"([optimizer_memory.json](results/optimizer_memory.json))."]


def build_model_speed() -> List[str]:
    data = load("bench_model_redesign.json")
    rows = [[name, f"{r['ours_tokens_per_s']:,.0f}", f"{r['hf_tokens_per_s']:,.0f}", f"{r['speedup']:.3f}×",
             f"{r['speedup_cpu_time']:.3f}×"] for name, r in data["results"].items()]
    return [*table(["model (fp32, batch 8 × 256)", "ours tokens/s", "HF tokens/s", "speed-up", "by CPU time"], rows),
            "", f"{data['machine']}, torch {data['torch']}, transformers {data['transformers']}. "
                "Command: `python scripts/bench_model.py --rounds 8` "
                "([bench_model_redesign.json](results/bench_model_redesign.json))."]


# ---- the quick start ----

QUICKSTART = "quickstart.txt"
QUICKSTART_ROW = re.compile(r"^(?P<run>tiny_\w+)-\d{8}-\d{6}\s+(?P<loss>[\d.]+)\s+(?P<gap>[-+][\d.]+)\s+"
                            r"(?P<sent>[\d.]+)\s+(?P<dense>[\d.]+)\s+(?P<saved>-?[\d.]+)%$")


QUICKSTART_NAMES = {"tiny_adams": "AdamS", "tiny_scape99": "SCAPE-99", "tiny_sma99": "sparse averaging"}


def minutes(text: str, kind: str) -> Optional[str]:
    """bash's `time` line of this kind (real, user) as minutes and seconds."""
    found = re.search(rf"^{kind}\s+(\d+)m([\d.]+)s$", text, re.M)
    return f"{int(found.group(1))} min {float(found.group(2)):.0f} s" if found else None


def quickstart() -> Tuple[List[dict], str]:
    path = RESULTS / QUICKSTART
    if not path.is_file():
        raise MissingArtifact(f"docs/results/{QUICKSTART} is missing: keep the output of "
                              "`time bash scripts/quickstart.sh` there (its first line says how)")
    text = path.read_text()
    rows = [m.groupdict() for m in map(QUICKSTART_ROW.match, text.splitlines()) if m]
    if not rows:
        raise MissingArtifact(f"docs/results/{QUICKSTART} holds no comparison table")
    load_line = re.search(r"^load average: ([\d.]+)", text, re.M)
    took = ", ".join(x for x in (f"{minutes(text, 'real')} of wall time" if minutes(text, "real") else "",
                                 f"{minutes(text, 'user')} of CPU" if minutes(text, "user") else "") if x)
    where = f"the 2-core CPU machine at load {float(load_line.group(1)):.0f}" if load_line else "the 2-core CPU machine"
    return rows, f"{took or 'an unrecorded time'} on {where}, set up already"


def build_quickstart() -> List[str]:
    rows, took = quickstart()
    out = table(["run", "val loss after 300 steps", "gap to AdamS", "MB sent per rank", "of it not sent"],
                [[f"`{r['run']}`", r["loss"], r["gap"], r["sent"], f"{r['saved']}%"] for r in rows])
    return [*out, "", f"`bash scripts/quickstart.sh`: {took}; its output is kept in {link(QUICKSTART)}."]


def build_readme_quickstart() -> List[str]:
    rows, took = quickstart()
    ref = float(rows[0]["loss"])
    losses = [f"{QUICKSTART_NAMES.get(r['run'], r['run'])} {float(r['loss']):.3f}"
              + ("" if i == 0 else f" ({fmt_gap(float(r['loss']) - ref, 2)}, {r['saved']}% of the bytes not sent)")
              for i, r in enumerate(rows)]
    return ["It trains a tiny Llama for 300 steps on 2 processes with each of dense AdamS, SCAPE-99 and",
            "sparse averaging, then prints their validation losses and bytes side by side: "
            + "; ".join(losses) + ".",
            f"It took {took} ([docs/results/{QUICKSTART}](docs/results/{QUICKSTART}))."]


TEST_SUITE = "test_suite.txt"


def build_readme_tests() -> List[str]:
    path = RESULTS / TEST_SUITE
    if not path.is_file():
        return ["It prints pytest's progress and summary for the fast tests, then the slow ones, then the Slurm",
                f"check (its time is not stored yet: docs/results/{TEST_SUITE} is missing)."]
    lines = [line for line in path.read_text().splitlines() if re.search(r"\d+ passed", line)]
    wall = re.search(r"^real\s+(\d+)m([\d.]+)s$", path.read_text(), re.M)
    took = f"{int(wall.group(1))} min" if wall else "(no time recorded)"
    return ["It prints pytest's progress and summary for the fast tests, then the slow ones, then the Slurm",
            f"check: {'; '.join(l.strip('= ') for l in lines)}, {took} in all",
            f"([docs/results/{TEST_SUITE}](docs/results/{TEST_SUITE}))."]


# ---- "which optimizer when" ----

def gap_against(rows: Sequence[dict], index: int, ref: int = 0) -> str:
    built = [summarize(rows[ref]), summarize(rows[index])]
    n = len(built[1]["seeds"])
    return (f"{fmt_gap(built[1]['mean'] - built[0]['mean'])} (lr {fmt_lr(built[1]['best'])}, "
            f"{n} seed{'s' if n > 1 else ''})")


def sdp_numbers() -> Dict[str, float]:
    """B-SDP's memory and bytes against DDP, its FLOP-matched gap, SCAPE-in-SDP's bytes and gap."""
    dense = {r["name"]: r for r in load("bench_sdp_adams_block.json")["results"]}
    in_sdp = {r["name"]: r for r in load("bench_sdp_scape90.json")["results"]}
    q = load("quality.json")["arms"]
    sdp = load("sdp_scape.json")["arms"]
    loss = {k: v["seed_losses_at_best_lr"][FIRST_SEED] for k, v in sdp.items()}
    return dict(memory=dense["bsdp_forward"]["peak_vs_ddp"], fewer=1 / dense["bsdp_forward"]["allreduce_vs_ddp"],
                matched=q["bsdp50_fm"]["summary"]["final_val_loss"] - q["adams"]["summary"]["final_val_loss"],
                in_sdp_fewer=dense["ddp"]["allreduce_bytes_per_step_max"]
                / in_sdp["bsdp_forward"]["allreduce_bytes_per_step_max"],
                in_sdp_gap=loss["bsdp50_scape90"] - loss["bsdp50"])


def adamw_row() -> List[str]:
    adamw = summarize(dict(arm="adamw", files=["screen_shnorm.json"]))
    adams = summarize(dict(arm="adams", files=["fair.json"]))
    gap = adamw["seeds"][FIRST_SEED] - adams["seeds"][FIRST_SEED]
    return ["AdamW (`optimizer=adamw`)", "dense (1×)", "—",
            f"{fmt_gap(gap)} with one lr for the whole model (lr {fmt_lr(adamw['best'])} against AdamS's "
            f"{fmt_lr(adams['best'])}, 1 seed)", "dense training where bytes do not matter (the default of `python train.py`)",
            "with the table at 16 lr; against the sparse methods"]


def build_readme_optimizers() -> List[str]:
    rows = quality_rows()
    comm = comm_compression()
    copies = {r["label"]: r for r in (summarize(row) for row in COPIES)}
    on = {n: copies[f"{n} copies: sparse averaging"]["mean"] - copies[f"{n} copies: AdamS"]["mean"] for n in (8, 16)}
    sdp = sdp_numbers()
    table_rows = [
        adamw_row(),
        ["AdamS (`optimizer=adams`)", "dense (1×)", evaluation_gaps("adams+elr16"),
         f"the reference ({summarize(rows[0])['mean']:.4f})",
         "the dense base of SCAPE and of sparse averaging; half AdamW's optimizer state", "—"],
        ["SCAPE-99 (`optimizer=scape`)", f"{comm['scape99_auto']:.1f}× fewer", evaluation_gaps("scape99t+elr16"),
         gap_against(rows, 4),
         "a slow link, where its gap is acceptable (the largest here: the paper's regime is unmeasured); "
         "works with `optimizer.shard=true`",
         "longer runs and other batch sizes with the table at 16 lr"],
        ["SCAPE-90 (`optimizer.sparsity=0.9`)", f"{comm['scape90_auto']:.1f}× fewer", evaluation_gaps("scape90t+elr16"),
         gap_against(rows, 3),
         "as SCAPE-99, with more bytes and a smaller gap", "as SCAPE-99"],
        ["sparse averaging (`optimizer=sparse_avg`)", "SCAPE-99's, over a run", evaluation_gaps("sma99t+elr16"),
         gap_against(rows, 1),
         f"SCAPE-99's bytes with the smallest gap of the sparse methods, on 4 copies or fewer (in sample "
         f"{fmt_gap(on[8], 2)} on 8 copies, {fmt_gap(on[16], 2)} on 16; `optimizer.ranks_per_copy` keeps the copies few)",
         "models beyond the tiny ones; the in-sample column is the fitted density rule's, which sent 1.45× "
         "SCAPE-99's bytes over a cosine run (docs/JOURNAL.md); the evaluation column is the byte budget's"],
        ["B-SDP (`sdp=block`, C = 0.5)", f"{sdp['fewer']:.1f}× fewer", "—",
         f"{fmt_gap(sdp['matched'])} FLOP-matched (twice the steps, lr 3e-3, 1 seed)",
         f"{sdp['memory']:.2f}× DDP's peak memory per worker", "with the table at 16 lr; beyond the tiny sizes"],
        ["SCAPE in SDP (`optimizer=scape sdp=block`)", f"{sdp['in_sdp_fewer']:.1f}× fewer (SCAPE-90)", "—",
         f"{fmt_gap(sdp['in_sdp_gap'])} against B-SDP alone (lr 3e-3, 1 seed)",
         "SDP's memory with SCAPE's bytes", "FLOP-matched; at 99%"],
    ]
    sources = [*(n for n in EVALUATION.values() if (RESULTS / n).is_file()), "fair_table_t.json", "bench_comm.json", "screen_shnorm.json", "fair.json", "quality.json",
               "sdp_scape.json", "bench_sdp_adams_block.json", "bench_sdp_scape90.json"]
    header = ["optimizer", "bytes per step", "against AdamS off the tuning set (evaluation corpora)",
              "in sample (tuning corpus)", "use it for", "unmeasured"]
    return [*table(header, table_rows, align="llllll"), "",
            "Built by `python scripts/report.py` from " + ", ".join(f"[{n}](docs/results/{n})" for n in sources)
            + " and the tables of [docs/RESULTS.md](docs/RESULTS.md)."]


BUILDERS: Dict[str, Callable[[], List[str]]] = {
    "quality": build_quality, "horizon": build_horizon, "batch": build_batch, "copies": build_copies,
    "sdp-quality": build_sdp_quality, "bytes": build_bytes, "optimizer-work": build_optimizer_work,
    "network": build_network, "wire": build_wire, "evaluation": build_evaluation, "gpu-check": build_gpu_check, "sdp-memory": build_sdp_memory,
    "optimizer-memory": build_optimizer_memory, "model-speed": build_model_speed,
    "quickstart": build_quickstart, "readme-quickstart": build_readme_quickstart,
    "readme-tests": build_readme_tests, "readme-optimizers": build_readme_optimizers,
}


def render(text: str, path: Path) -> str:
    def replace(match: "re.Match[str]") -> str:
        name = match.group("name")
        if name not in BUILDERS:
            raise SystemExit(f"error: {path.relative_to(REPO)} has a report block {name!r} that no builder makes; "
                             f"the builders are {', '.join(sorted(BUILDERS))}")
        return match.group(1) + "\n".join(BUILDERS[name]()) + "\n" + match.group(4)
    return BLOCK.sub(replace, text)


def cited_artifacts() -> List[str]:
    """Every file under docs/results that a document links to (README and every page of docs/)."""
    names = set()
    for doc in sorted({*DOCS, *(REPO / "docs").glob("*.md")}):
        if doc.is_file():
            names.update(re.findall(r"results/([\w+-]+(?:\.[\w+-]+)*)", doc.read_text()))
    return sorted(names)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document is stale")
    parser.add_argument("--bundle", nargs="+", metavar=("BUNDLE", "ARTIFACT"),
                        help="move the ARTIFACTs (names under docs/results) into BUNDLE, then rebuild")
    args = parser.parse_args(argv)
    if args.bundle:
        bundle(args.bundle[0], args.bundle[1:])
    stale = []
    try:
        for path in DOCS:
            text = path.read_text()
            new = render(text, path)
            if new != text:
                stale.append(path)
                if not args.check:
                    path.write_text(new)
    except MissingArtifact as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in stale:
        verb = "is stale: run `python scripts/report.py`" if args.check else "rewritten"
        print(f"{path.relative_to(REPO)} {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
