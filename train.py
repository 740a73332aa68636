"""Pretraining entry point: ``python train.py +experiment=NAME`` or under torchrun / Slurm.

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
    from trainer.loop import ConfigError, run
    from trainer.checkpoint import CheckpointError

    try:
        run(cfg)
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
