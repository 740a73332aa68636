"""Print the runs' summaries side by side: validation loss, gap, bytes sent and saved.

    python scripts/compare_runs.py runs/tiny_adams runs/tiny_scape99
The first run is the reference for the gap and the byte ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.is_file():
        sys.exit(f"error: {path} not found; is {run_dir} a finished run directory?")
    return json.loads(path.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    rows = [(run.name, load_summary(run)) for run in args.runs]
    ref_loss = rows[0][1]["final_val_loss"]
    width = max(24, *(len(name) for name, _ in rows))
    print(f"{'run':<{width}} {'val loss':>9} {'gap':>8} {'MB sent/rank':>13} {'dense MB':>10} {'not sent':>9}")
    for name, s in rows:
        sent, dense = s["bytes_sent_per_rank"] / 1e6, s["dense_bytes_per_rank"] / 1e6
        saved = 1 - sent / dense if dense else 0.0
        print(f"{name:<{width}} {s['final_val_loss']:>9.4f} {s['final_val_loss'] - ref_loss:>+8.4f} "
              f"{sent:>13.2f} {dense:>10.2f} {saved:>9.1%}")


if __name__ == "__main__":
    main()
