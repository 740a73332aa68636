"""Pretraining entry point: ``python train.py +experiment=NAME`` or under torchrun / Slurm.

``python train.py -m optimizer.lr=1e-4,3e-4`` sweeps (one run per point, trainer/sweep.py), one
after another here or as Slurm jobs with ``hydra/launcher=vista``.

Hydra composes conf/ against the structured schema in trainer/config.py, so a misspelt key or a
wrong type stops the run before anything is built or written.
"""
import sys

import hydra
from omegaconf import DictConfig

from trainer.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from data import DataPipelineError
    from trainer.checkpoint import CheckpointError
    from core.comm import CollectiveError
    from core.distributed import RankZeroError
    from trainer.sweep import finish_point, prepare_point
    from trainer.trainer import run

    submitit_job = False
    try:
        submitit_job = prepare_point(cfg)  # multirun: a run name per point; Slurm jobs via submitit
        finish_point(run(cfg), submitit_job)
    except (ValueError, OSError, CheckpointError, DataPipelineError, RankZeroError, CollectiveError) as exc:
        # Bad input (config values, paths, data, checkpoints): the message names the key and the
        # fix; a traceback would only hide it. A peer that died or hung: name it, no 40-frame
        # traceback. Bugs still raise with their traceback.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        if submitit_job:
            raise  # submitit records the error, and the sweep command reports the failed point
        sys.exit(1 if isinstance(exc, CollectiveError) else 2)


if __name__ == "__main__":
    main()
