"""Hydra multirun (``python train.py -m KEY=A,B``): each sweep point is a run of its own.

With Hydra's basic launcher the points run one after another in this process; with
``hydra/launcher=vista`` (conf/hydra/launcher/, hydra-submitit-launcher) each point is a Slurm job
(an array task) that runs train.py's task function in every task of the job. For every point this
module names the run after the values it sets (so points never share a run folder or a wandb run)
and, under submitit, does what slurm/launch_common.sh does for a batch job: turns Slurm's
environment into torch.distributed's, resumes its own checkpoint after a requeue (``resume=auto``),
and turns the pre-time-limit signal into a checkpoint at the next step and a requeue.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Set

# Overrides that say where or how a point runs, not what it trains: not part of its name.
_NOT_IN_NAME = ("experiment", "logger", "out_dir", "resume", "data.cache_dir", "train.device",
                "logger.wandb", "logger.console", "logger.project", "logger.entity", "logger.group")
_MAX_TAG = 60


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def swept_keys(sweep_dir: Path) -> Optional[Set[str]]:
    """The keys the sweep varies, from the command line Hydra's basic sweeper saved in
    ``multirun.yaml`` (None when there is none, e.g. another sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return None
    task = OmegaConf.load(path).hydra.overrides.task
    return {o.get_key_element().lstrip("+~") for o in OverridesParser.create().parse_overrides(list(task))
            if o.is_sweep_override()}


def point_name(base: str, overrides: Sequence[str], job_id: Optional[str] = None,
               swept: Optional[Set[str]] = None) -> str:
    """``base`` plus the point's values of the swept keys (``optimizer.lr=1e-3`` -> ``lr1e-3``;
    every key when ``swept`` is None), plus the Slurm job id when there is one (as slurm/vista.sh
    names runs). A long list becomes a short hash."""
    parts = []
    for override in overrides:
        key = _key(override)
        if "=" not in override or key in _NOT_IN_NAME or key.startswith("hydra") or \
                swept is not None and key not in swept:
            continue
        value = override.split("=", 1)[1]
        parts.append(re.sub(r"[^A-Za-z0-9._-]", "_", f"{key.rsplit('.', 1)[-1]}{value}"))
    tag = "-".join(parts)
    if len(tag) > _MAX_TAG:
        tag = "p" + hashlib.sha1(",".join(sorted(overrides)).encode()).hexdigest()[:10]
    return "-".join(p for p in (base, tag, job_id) if p)


def _forward_to_stop_signal(signum, frame) -> None:  # noqa: ARG001
    """submitit's pre-time-limit signal -> the Trainer's SIGUSR1 (checkpoint at the next step)."""
    os.kill(os.getpid(), signal.SIGUSR1)


def prepare_point(cfg) -> bool:
    """Adjust a sweep point's config in place before it is built; True under submitit."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return False
    overrides = list(HydraConfig.get().overrides.task)
    given = {_key(o) for o in overrides}
    submitit_job = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
    if "run_name" not in given:
        cfg.run_name = point_name(cfg.run_name, overrides, os.environ.get("SLURM_JOB_ID") if submitit_job else None,
                                  swept_keys(HydraConfig.get().sweep.dir))
    if not submitit_job:
        return False
    import submitit

    if "out_dir" not in given and os.environ.get("SCAPE_OUT_DIR"):
        cfg.out_dir = os.environ["SCAPE_OUT_DIR"]
    if "resume" not in given:
        cfg.resume = "auto"  # a requeued point continues from its newest checkpoint
    if submitit.JobEnvironment().num_tasks > 1:
        dist_env = submitit.helpers.TorchDistributedEnvironment()
        # submitit draws the port from 20000-60000, mostly inside Linux's ephemeral range
        # (32768-60999), where srun's own message sockets listen: a draw that hits one fails
        # rank 0 with EADDRINUSE and leaves the others waiting. slurm/launch_common.sh's port,
        # below that range:
        dist_env.master_port = 29500 + int(os.environ["SLURM_JOB_ID"]) % 500
        dist_env.export()
    # Replaces submitit's own handler, which would requeue at once and lose the steps since the
    # last checkpoint; the Trainer stops cleanly instead and finish_point requeues.
    signal.signal(getattr(signal, f"SIG{submitit.JobEnvironment.USR_SIG}"), _forward_to_stop_signal)
    return True


def finish_point(summary: Dict[str, Any], submitit_job: bool) -> None:
    """After a point's run: one stopped by the time-limit signal requeues its Slurm job (rank 0)."""
    if not submitit_job or summary.get("state") != "preempted" or int(os.environ.get("RANK", "0")) != 0:
        return
    job = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    limit = int(os.environ.get("SCAPE_MAX_RESTARTS", "50"))
    if restarts >= limit:
        print(f"sweep point requeued {restarts} times already (SCAPE_MAX_RESTARTS={limit}): not requeueing",
              flush=True)
        return
    print(f"sweep point preempted at step {summary.get('step')}: requeueing job {job}; it resumes from the "
          f"checkpoint", flush=True)
    if subprocess.run(["scontrol", "requeue", job]).returncode != 0:
        print(f"scontrol requeue {job} failed; continue the point by hand with run_name="
              f"{os.path.basename(summary.get('run_dir', ''))} resume=auto", file=sys.stderr, flush=True)
