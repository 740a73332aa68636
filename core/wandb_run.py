"""How a run is named and which mode it takes on wandb: shared by the trainer's logger and by
evaluation, which logs to the run that trained the checkpoint."""
from __future__ import annotations

import os
from pathlib import Path


def wandb_mode(requested: str) -> str:
    """``auto`` is online with an API key (environment or ~/.netrc), offline otherwise."""
    if requested != "auto":
        return requested
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file() and \
        "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if has_key else "offline"


def wandb_id(run_name: str) -> str:
    """The wandb run id of a run name (stable, so a resumed job continues the same run)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_name)[:128]
