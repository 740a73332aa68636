"""Which wandb run a run folder logs to, in which mode, and what describes it there: shared by the
trainer's logger and by evaluation, which logs to the run that trained the checkpoint.

The wandb id is drawn once, when a run folder is first used, and kept in ``<run_dir>/wandb_id``:
the run name cannot be the id, because experiments have fixed run names outside Slurm, so a second
run of the same experiment (or a colleague's on the same entity) would append to the first one's
curves. A resumed or requeued job, in-loop evaluation and ``scripts/evaluate.py`` read the file.
"""
from __future__ import annotations

import os
import platform
import secrets
import string
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

RUN_ID_FILE = "wandb_id"
_ID_ALPHABET = string.ascii_lowercase + string.digits  # what wandb's own generated ids use
_REPO = Path(__file__).resolve().parents[1]


def wandb_mode(requested: str) -> str:
    """``auto`` is online with an API key (environment or ~/.netrc), offline otherwise."""
    if requested != "auto":
        return requested
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file() and \
        "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if has_key else "offline"


def new_run_id() -> str:
    """A fresh wandb run id: 12 characters of [a-z0-9] (wandb's own ids are 8)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))


def read_run_id(run_dir: Path) -> Optional[str]:
    """The id stored in ``run_dir``, or None for a run folder that has none (yet)."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        return None
    value = path.read_text().strip()
    if not value or any(c not in _ID_ALPHABET + "-_" for c in value):
        raise ValueError(f"{path} holds {value!r}, not a wandb run id; delete the file to give the run "
                         f"a new wandb run, or write the id of its wandb run into it")
    return value


def ensure_run_id(run_dir: Path) -> str:
    """The run folder's wandb id, drawn and stored (atomically) at its first use."""
    existing = read_run_id(run_dir)
    if existing is not None:
        return existing
    run_id = new_run_id()
    tmp = Path(run_dir) / f".{RUN_ID_FILE}.tmp"
    tmp.write_text(run_id + "\n")
    os.replace(tmp, Path(run_dir) / RUN_ID_FILE)
    return run_id


def legacy_run_id(run_name: str) -> str:
    """The id runs trained before the ``wandb_id`` file used: their run name, sanitised."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_name)[:128]


def run_id_for(run_dir: Path, run_name: str) -> str:
    """The wandb id of the run that trained in ``run_dir`` (the legacy id for older runs)."""
    return read_run_id(run_dir) or legacy_run_id(run_name)


def rewind_point(run_id: str, start_step: int, logged_through: int) -> Optional[str]:
    """wandb's ``resume_from`` for a run that continues at ``start_step + 1`` after it had logged
    through ``logged_through``: wandb only accepts increasing steps and would drop the re-logged
    ones, so the run is rewound to the checkpoint's step (wandb keeps its history through that step
    and takes the next step as the next one; wandb-core's handler, 0.31). None when nothing is
    re-logged (a clean stop at a checkpoint), where a plain resume keeps every point."""
    if logged_through <= start_step:
        return None
    return f"{run_id}?_step={start_step}"


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> Dict[str, Any]:
    """What produced a run, beyond its config: code version, libraries, hardware, Slurm job."""
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    cuda = torch.cuda.is_available()
    return {
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "python": platform.python_version(), "host": platform.node(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")) if "SLURM_JOB_ID" in os.environ
        else None,
        "slurm_nodes": os.environ.get("SLURM_JOB_NUM_NODES"),
    }


def _percent(fraction: Any) -> str:
    return f"{float(fraction) * 100:g}"


def grouping(config: Dict[str, Any]) -> Tuple[str, List[str]]:
    """The wandb group and tags of a run's resolved config.

    The group names what the run trains the way experiments are named (model_optimizer[_sdp], e.g.
    ``llama500m_scape99``) but from the values, so a ``optimizer.sparsity=0.9`` override lands in
    ``..._scape90``; ``logger.group`` wins. Tags make optimizer, sparsity and SDP filterable."""
    model = (config.get("model") or {}).get("name", "model")
    opt = config.get("optimizer") or {}
    sdp = config.get("sdp") or {}
    name = opt.get("name", "optimizer")
    tags = [f"model:{model}", f"optimizer:{name}"]
    short = {"scape": "scape", "sparse_avg": "sma"}.get(name)
    label = name
    if short is not None and opt.get("sparsity") is not None:
        label = f"{short}{_percent(opt['sparsity'])}"
        tags.append(f"sparsity:{float(opt['sparsity']):g}")
    group = f"{model}_{label}"
    kind = sdp.get("kind", "none")
    if kind != "none":
        group += f"_{kind[0]}sdp{_percent(sdp.get('coverage', 1.0))}"
        tags += [f"sdp:{kind}", f"sdp_coverage:{float(sdp.get('coverage', 1.0)):g}"]
    logger = config.get("logger") or {}
    return (logger.get("group") or group), tags + [t for t in logger.get("tags") or [] if t not in tags]
