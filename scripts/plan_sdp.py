"""Print an SDP plan's report for a config, or write the plan for ``sdp.plan_path``.

    python scripts/plan_sdp.py model=llama500m sdp=block sdp.coverage=0.5 sdp.workers=32 [--json PLAN]

The planner itself is sdp/plan.py; this entry point composes the run's config as train.py does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.config import ModelConfig  # noqa: E402
from sdp.config import SDPConfig  # noqa: E402
from sdp.plan import format_report, make_plan, report  # noqa: E402


# --------------------------------------------------------------------------- CLI

def compose_config(overrides: List[str]):
    """The run's config, composed from conf/ exactly as train.py composes it."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    conf_dir = str(Path(__file__).resolve().parent.parent / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose(config_name="config", overrides=overrides)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/plan_sdp.py",
        description="Print an SDP plan's report; --json PATH writes the plan (for sdp.plan_path).")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama500m sdp.kind=block")
    parser.add_argument("--json", dest="json_path", default=None, help="write the plan here")
    parser.add_argument("--report-json", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    from omegaconf import OmegaConf

    cfg = compose_config(args.overrides)
    model_cfg = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    sdp_cfg = SDPConfig(**OmegaConf.to_container(cfg.sdp, resolve=True))
    if sdp_cfg.kind == "none":
        print("sdp.kind=none: nothing to plan (set sdp.kind=block or sdp.kind=neuron)", file=sys.stderr)
        return 2
    try:
        plan = make_plan(model_cfg, sdp_cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    micro = int(cfg.train.micro_batch_size) if "train" in cfg else 8
    optimizer = str(cfg.optimizer.name) if "optimizer" in cfg else "adamw"
    checkpointing = bool(cfg.train.activation_checkpointing) if "train" in cfg else False
    rep = report(plan, model_cfg, optimizer=optimizer, micro_batch_size=micro, masking=sdp_cfg.masking,
                 activation_checkpointing=checkpointing)
    print(format_report(rep))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(plan.to_json(), f)
        print(f"plan written to {args.json_path}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
