"""Plot runs' metrics.jsonl side by side: a loss against step, training time and bytes sent.

    python scripts/plot_runs.py runs/tiny_adams runs/tiny_scape99 --out compare.png
    python scripts/plot_runs.py runs/a runs/b --metric train/loss --x step,bytes,emulated --bandwidth 1e9

The x axes answer different questions: per step (sample efficiency), per byte sent (what SCAPE
saves), per second (what the user waits for). Training time is rebuilt from the logged per-step
times (perf/step_time_s times the steps since the previous log line), so it leaves out start-up
and validation. ``emulated`` replaces the measured communication time by bytes / bandwidth, i.e.
the time the same run would take if the network were the only thing slower than here.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

X_AXES = {
    "step": "optimizer step",
    "time": "training time (s, from logged step times)",
    "bytes": "bytes sent per rank (cumulative)",
    "emulated": "emulated time (s): compute here + bytes / bandwidth",
}


def read_metrics(run_dir: Path) -> List[dict]:
    """Every logged record of a run, in step order (train lines and val lines alike)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {run_dir} a run directory of train.py?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["step"])


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def progress_axes(records: Sequence[dict], bandwidth_bits_per_s: float = 1e9) -> Dict[str, Dict[int, float]]:
    """For every logged train step: cumulative bytes, rebuilt training time and emulated time.

    Log lines come every ``log_every`` steps, so a line's per-step figures stand for every step
    since the previous line; bytes come cumulative from the trainer and need no rebuilding.
    """
    bytes_at: Dict[int, float] = {}
    time_at: Dict[int, float] = {}
    emulated_at: Dict[int, float] = {}
    elapsed = emulated = 0.0
    previous_step = 0
    for record in records:
        if "perf/step_time_s" not in record:
            continue
        step = int(record["step"])
        steps_covered = step - previous_step
        step_time = _float(record["perf/step_time_s"])
        comm_time = _float(record.get("perf/time_comm_s", 0.0))
        step_bytes = _float(record.get("comm/bytes_total", 0.0))
        elapsed += steps_covered * step_time
        emulated += steps_covered * (step_time - comm_time + 8.0 * step_bytes / bandwidth_bits_per_s)
        bytes_at[step] = _float(record.get("comm/bytes_cumulative", math.nan))
        time_at[step] = elapsed
        emulated_at[step] = emulated
        previous_step = step
    return {"step": {s: float(s) for s in bytes_at}, "bytes": bytes_at, "time": time_at, "emulated": emulated_at}


def _at_or_before(table: Dict[int, float], step: int) -> float:
    """The value logged at ``step``, else linearly interpolated between the neighbouring log lines."""
    if step in table:
        return table[step]
    steps = sorted(table)
    below = [s for s in steps if s < step]
    above = [s for s in steps if s > step]
    if not below or not above:
        return table[below[-1]] if below else (table[above[0]] if above else math.nan)
    s0, s1 = below[-1], above[0]
    return table[s0] + (table[s1] - table[s0]) * (step - s0) / (s1 - s0)


def metric_curve(records: Sequence[dict], metric: str, x_axis: str,
                 bandwidth_bits_per_s: float = 1e9) -> Tuple[List[float], List[float]]:
    """(x, y) points of ``metric`` against ``x_axis`` (step, time, bytes or emulated)."""
    if x_axis not in X_AXES:
        raise ValueError(f"x axis must be one of {', '.join(X_AXES)}, got {x_axis!r}")
    axes = progress_axes(records, bandwidth_bits_per_s)
    xs, ys = [], []
    for record in records:
        if metric not in record:
            continue
        step = int(record["step"])
        x = float(step) if x_axis == "step" else _at_or_before(axes[x_axis], step)
        y = _float(record[metric])
        if math.isfinite(x) and math.isfinite(y):
            xs.append(x)
            ys.append(y)
    return xs, ys


def plot_curves(runs: Dict[str, Sequence[dict]], out: Path, metric: str = "val/loss",
                x_axes: Iterable[str] = ("step", "bytes"), bandwidth_bits_per_s: float = 1e9,
                title: Optional[str] = None, log_bytes: bool = True) -> Path:
    """One PNG with a panel per x axis and a line per run (matplotlib's Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_axes = list(x_axes)
    fig, panels = plt.subplots(1, len(x_axes), figsize=(5.2 * len(x_axes), 4.0), squeeze=False)
    for panel, x_axis in zip(panels[0], x_axes):
        for label, records in runs.items():
            xs, ys = metric_curve(records, metric, x_axis, bandwidth_bits_per_s)
            if xs:
                panel.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label, linewidth=1.3)
        label = X_AXES[x_axis]
        if x_axis == "emulated":
            label += f" at {bandwidth_bits_per_s / 1e9:g} Gbit/s"
        panel.set_xlabel(label)
        panel.set_ylabel(metric)
        if x_axis == "bytes" and log_bytes:
            panel.set_xscale("log")
        panel.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare.png"))
    parser.add_argument("--metric", default="val/loss", help="val/loss (default), train/loss, ...")
    parser.add_argument("--x", default="step,time,bytes", help=f"comma-separated x axes: {', '.join(X_AXES)}")
    parser.add_argument("--bandwidth", type=float, default=1e9, help="bit/s for the emulated x axis")
    parser.add_argument("--labels", default=None, help="comma-separated labels (default: folder names)")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    runs = {label: read_metrics(run) for label, run in zip(labels, args.runs)}
    out = plot_curves(runs, args.out, args.metric, [x.strip() for x in args.x.split(",") if x.strip()],
                      args.bandwidth)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
