"""The memory pre-flight's table: per-rank bytes of a run, before anything is built.

    python -m scripts.plan_memory +experiment=llama1_8b_scape99 world=4         # one run, per part
    python -m scripts.plan_memory +experiment=llama500m_adamw world=1,4,32 device=cuda
    python -m scripts.plan_memory --grid [--json FILE]    # named sizes x optimizers x world sizes

The overrides are train.py's (composed from conf/ the same way); ``world=N[,M...]`` sets the number
of ranks (default 1) and ``device=cuda|cpu`` the device the run would use (default cuda: bf16
autocast and the stock kernels; cpu: fp32 and the CPU kernels). The estimate is trainer/memory.py's,
the one the Trainer refuses a run with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.memory import GIB, MemoryEstimate, estimate_memory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = ("gpt345m", "llama500m", "llama1_8b")
# each optimizer's experiment for a size, or (an experiment of the size, the override) where the
# size has no experiment of its own for it
OPTIMIZERS = {"adamw": "{size}_adamw", "adams": "{size}_adams", "scape99": "{size}_scape99",
              "sparse_avg": "{size}_sma99"}
WORLDS = (1, 4, 32)
_PHASES = ("persistent", "activations", "forward", "loss_backward", "backward", "step", "checkpoint", "host")


def compose(overrides: Sequence[str]):
    """The run's typed config, composed from conf/ as train.py composes it."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def split_arguments(arguments: Sequence[str]) -> Tuple[List[str], List[int], str]:
    """(the config overrides, the world sizes of ``world=``, the device of ``device=``)."""
    overrides, worlds, device = [], [1], "cuda"
    for argument in arguments:
        key, _, value = argument.partition("=")
        if key == "world":
            try:
                worlds = [int(n) for n in value.split(",")]
            except ValueError:
                raise SystemExit(f"world={value}: expected ranks as integers, e.g. world=4 or world=1,4,32")
            if not worlds or min(worlds) < 1:
                raise SystemExit(f"world={value}: the number of ranks must be at least 1")
        elif key == "device":
            if value not in ("cuda", "cpu"):
                raise SystemExit(f"device={value}: expected device=cuda or device=cpu")
            device = value
        else:
            overrides.append(argument)
    return overrides, worlds, device


def part_table(estimates: Dict[int, MemoryEstimate]) -> str:
    """One column per world size, one row per part (GiB), the peak last."""
    worlds = sorted(estimates)
    names: List[Tuple[str, str]] = []
    for est in estimates.values():
        for part in est.parts:
            if (part.phase, part.name) not in names:
                names.append((part.phase, part.name))
    names.sort(key=lambda key: _PHASES.index(key[0]))
    header = f"{'phase':<14} {'part':<64}" + "".join(f" {'world ' + str(w):>10}" for w in worlds)
    lines = [header, "-" * len(header)]
    for phase, name in names:
        cells = []
        for w in worlds:
            found = [p.bytes for p in estimates[w].parts if p.phase == phase and p.name == name]
            cells.append(f" {found[0] / GIB:>10.2f}" if found else f" {'':>10}")
        lines.append(f"{phase:<14} {name[:64]:<64}" + "".join(cells))
    lines.append("-" * len(header))
    lines.append(f"{'peak':<14} {'per rank (GiB)':<64}" + "".join(f" {estimates[w].device_peak / GIB:>10.2f}" for w in worlds))
    lines.append(f"{'host':<14} {'per rank besides the process (GiB)':<64}"
                 + "".join(f" {estimates[w].host_peak / GIB:>10.2f}" for w in worlds))
    return "\n".join(lines)


def grid_overrides(size: str, optimizer: str) -> List[str]:
    experiment = OPTIMIZERS[optimizer].format(size=size)
    if (REPO / "conf" / "experiment" / f"{experiment}.yaml").is_file():
        return [f"+experiment={experiment}"]
    return [f"+experiment={size}_adams", "optimizer=sparse_avg"]  # llama1_8b has no sparse_avg experiment


def grid(device: str) -> List[Dict[str, Any]]:
    rows = []
    for size in SIZES:
        for optimizer in OPTIMIZERS:
            overrides = grid_overrides(size, optimizer)
            cfg = compose(overrides)
            for world in WORLDS:
                est = estimate_memory(cfg, world, device)
                rows.append({"size": size, "optimizer": optimizer, "world": world, "overrides": overrides,
                             "micro_batch_size": cfg.train.micro_batch_size,
                             "activation_checkpointing": cfg.train.activation_checkpointing,
                             "peak_gib": round(est.device_peak / GIB, 2), "host_gib": round(est.host_peak / GIB, 2),
                             "largest_part": max(est.parts, key=lambda p: p.bytes).name,
                             "phases_gib": {phase: round(est.total(phase) / GIB, 2) for phase in _PHASES}})
    return rows


def grid_markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| size | optimizer | micro-batch, AC | " + " | ".join(f"{w} rank{'s' if w > 1 else ''}" for w in WORLDS)
             + " |", "|---|---|---|" + "---:|" * len(WORLDS)]
    for size in SIZES:
        for optimizer in OPTIMIZERS:
            cells = [r for r in rows if r["size"] == size and r["optimizer"] == optimizer]
            first = cells[0]
            lines.append(f"| {size} | {optimizer} | {first['micro_batch_size']}, "
                         f"{'yes' if first['activation_checkpointing'] else 'no'} | "
                         + " | ".join(f"{r['peak_gib']:.1f}" for r in cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.plan_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", action="store_true", help="the table of named sizes x optimizers x world sizes")
    parser.add_argument("--json", default=None, help="also write the numbers here (JSON)")
    parser.add_argument("arguments", nargs="*", help="train.py's overrides, world=N[,M...] and device=cuda|cpu")
    args = parser.parse_args(argv)
    overrides, worlds, device = split_arguments(args.arguments)
    command = "python -m scripts.plan_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.grid:
        rows = grid(device)
        print(grid_markdown(rows))
        result: Any = {"command": command, "device": device, "rows": rows}
    else:
        cfg = compose(overrides)
        estimates = {w: estimate_memory(cfg, w, device) for w in worlds}
        print(f"{cfg.run_name}: {device}, micro_batch_size={cfg.train.micro_batch_size}, activation_checkpointing="
              f"{str(cfg.train.activation_checkpointing).lower()}, optimizer={cfg.optimizer.name}")
        print(part_table(estimates))
        result = {"command": command, "device": device, "run_name": cfg.run_name,
                  "worlds": {str(w): {"peak_bytes": e.device_peak, "host_bytes": e.host_peak,
                                      "parts": [vars(p) for p in e.parts]} for w, e in estimates.items()}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
