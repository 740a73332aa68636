"""The project's wandb workspace, as code (wandb-workspaces): build it and save it to a project.

    python -m scripts.dashboard --entity E --project P                # save as a new view
    python -m scripts.dashboard --entity E --project P --name "SCAPE study"
    python -m scripts.dashboard --entity E --project P --dry-run      # print the panels, save nothing

Sections follow the metric prefixes (val, train, perf, comm, scape, sdp, mem): validation loss
against step, tokens and bytes sent (the SCAPE comparison), the step time split, MFU, bytes sent
by kind, SCAPE's mask overlap and residual norm, SDP's per-worker memory. Runs are grouped by
optimizer. Every metric comes from trainer/metrics.py's list, so a panel cannot name a metric the
trainer does not log (tests/scripts/test_dashboard.py checks it against real runs). Saving needs
network and a wandb API key (`wandb login`); building does not.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.metrics import AXES, METRICS, is_known_metric  # noqa: E402

STEP = "Step"  # wandb's own x-axis: the step each record was logged at (ours, passed to log)
TOKENS, BYTES = AXES
# The per-kind byte counters (comm/bytes_<kind>), not the totals.
COMM_KINDS_REGEX = r"^comm/bytes_(?!total$|cumulative$).+"


def _metric(name: str) -> str:
    if not is_known_metric(name):
        raise KeyError(f"{name} is not in trainer/metrics.py's METRICS; add it there first")
    return name


def _plot(title: str, y: List[str], x: str = STEP, **kwargs):
    import wandb_workspaces.reports.v2 as wr

    return wr.LinePlot(title=title, x=x if x == STEP else _metric(x), y=[_metric(m) for m in y],
                       title_x=x, **kwargs)


def sections():
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def section(name: str, panels, is_open: bool = True):
        return ws.Section(name=name, panels=panels, is_open=is_open,
                          layout_settings=ws.SectionLayoutSettings(columns=3, rows=1 + (len(panels) - 1) // 3))

    return [
        section("val", [
            _plot("validation loss", ["val/loss"]),
            _plot("validation loss against tokens", ["val/loss"], x=TOKENS),
            _plot("validation loss against bytes sent per rank", ["val/loss"], x=BYTES, log_x=True),
        ]),
        section("train", [
            _plot("training loss", ["train/loss"], smoothing_type="exponential", smoothing_factor=0.6),
            _plot("learning rate", ["train/lr"]),
            _plot("gradient norm", ["train/grad_norm"]),
            _plot("gradient noise scale (tokens)", ["train/noise_scale"], log_y=True),
            _plot("skipped (non-finite) steps", ["train/skipped_steps"]),
        ]),
        section("perf", [
            _plot("step time split (s)", ["perf/time_data_s", "perf/time_fwd_bwd_s", "perf/time_comm_s",
                                          "perf/time_opt_s"], plot_type="stacked-area"),
            _plot("MFU (dense bf16 peak)", ["perf/mfu"]),
            _plot("tokens per second", ["perf/tokens_per_s"]),
            _plot("TFLOP/s per device", ["perf/tflops_per_device"]),
        ]),
        section("comm", [
            wr.LinePlot(title="bytes sent per rank per step, by kind", x=STEP, metric_regex=COMM_KINDS_REGEX),
            _plot("bytes sent per rank, cumulative", [BYTES], x=TOKENS),
            _plot("compression against a dense fp32 all-reduce", ["comm/compression"]),
        ]),
        section("scape", [
            _plot("mask overlap (this rank's mask kept by the next)", ["scape/mask_overlap"]),
            _plot("error-feedback residual norm", ["scape/residual_norm"]),
            _plot("density sent", ["scape/density"]),
        ]),
        section("sdp", [
            _plot("parameters held per worker (fraction of the model)", ["sdp/params_held_fraction"]),
            _plot("parameters held per worker", ["sdp/params_held"]),
        ]),
        section("mem", [
            _plot("peak memory per worker (GiB)", ["mem/peak_gib"]),
        ]),
    ]


def build_workspace(entity: str, project: str, name: str = "scape-sdp"):
    """The workspace object (nothing is sent): sections per prefix, runs grouped by optimizer."""
    import wandb_workspaces.workspaces as ws

    return ws.Workspace(
        entity=entity, project=project, name=name, sections=sections(),
        settings=ws.WorkspaceSettings(x_axis=STEP, group_by_prefix="first", max_runs=20),
        runset_settings=ws.RunsetSettings(groupby=[ws.Config("optimizer.name")]))


def panel_metrics(workspace) -> Iterator[Tuple[str, str, Optional[str], List[str], Optional[str]]]:
    """(section, title, x, y, metric_regex) of every panel; x is None for wandb's own step."""
    for section in workspace.sections:
        for panel in section.panels:
            x = None if panel.x == STEP else panel.x
            yield section.name, panel.title, x, list(panel.y), panel.metric_regex


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entity", required=True, help="wandb entity (user or team)")
    parser.add_argument("--project", required=True, help="wandb project (logger.project of the runs)")
    parser.add_argument("--name", default="scape-sdp", help="name of the saved view")
    parser.add_argument("--dry-run", action="store_true", help="print the panels; save nothing")
    args = parser.parse_args(argv)
    workspace = build_workspace(args.entity, args.project, args.name)
    if args.dry_run:
        for section, title, x, y, regex in panel_metrics(workspace):
            print(f"{section:<6} {title:<55} x={x or STEP:<22} y={', '.join(y) or regex}")
        print(f"{sum(1 for _ in panel_metrics(workspace))} panels over {len(METRICS)} known metrics; "
              f"runs grouped by optimizer.name")
        return 0
    try:
        saved = workspace.save_as_new_view()
    except Exception as exc:  # noqa: BLE001 - network, authentication, unknown entity/project
        print(f"error: could not save the workspace to {args.entity}/{args.project}: {type(exc).__name__}: "
              f"{exc}. Saving needs network and a wandb API key (`wandb login`); --dry-run builds it offline",
              file=sys.stderr)
        return 2
    print(f"saved workspace view {args.name!r}: {saved.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
