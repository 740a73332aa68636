"""Every file in conf/ composes against the schema; bad keys and types fail at start-up."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.train_helpers import REPO, compose_config, train_cli
from trainer.config import Config

CONF = REPO / "conf"
GROUPS = ["model", "data", "tokenizer", "optimizer", "sdp", "logger"]


@pytest.mark.parametrize("override", [f"{g}={p.stem}" for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
                         + [f"+experiment={p.stem}" for p in sorted((CONF / "experiment").glob("*.yaml"))])
def test_every_config_file_composes_and_validates(override):
    cfg = compose_config([override])
    obj = OmegaConf.to_object(cfg)  # resolves interpolations and checks every type
    assert isinstance(obj, Config)
    if override.startswith("+experiment="):
        assert cfg.run_name == override.split("=", 1)[1], "an experiment names its run after itself"


def test_defaults_are_the_embedded_quick_start():
    cfg = compose_config([])
    assert (cfg.model.name, cfg.data.name, cfg.tokenizer.name) == ("tiny_llama", "embedded", "bpe_local")


@pytest.mark.parametrize("steps,lr_warmup,expected",
                         [(300, 20, 100), (1200, 20, 400), (20000, 2000, 6666), (12000, 2000, 4000), (300, 150, 150)])
def test_the_sparse_averaging_warmup_is_a_third_of_the_run_at_least_the_lr_warmup(steps, lr_warmup, expected):
    cfg = compose_config(["optimizer=sparse_avg", f"train.steps={steps}", f"optimizer.warmup_steps={lr_warmup}"])
    assert cfg.optimizer.sparsity_warmup_steps == expected


@pytest.mark.parametrize("override,needle", [
    ("optimizer.lrr=0.1", "lrr"),
    ("train.steps=many", "steps"),
    ("+experiment=no_such_experiment", "no_such_experiment"),
])
def test_bad_keys_and_types_fail_at_start_naming_the_key(override, needle, tmp_path):
    proc = train_cli([override, f"out_dir={tmp_path}"], timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout
    assert not any(tmp_path.iterdir()), "a rejected config must not leave a run directory"


# the yaml files tie the sparsity warm-up to the run's own schedule; their dataclasses have none
RUN_DEPENDENT = {"scape": {"sparsity_warmup_steps": "${times:3,${.warmup_steps}}"},
                 "sparse_avg": {"sparsity_warmup_steps": "${longest:${.warmup_steps},${times:0.3333,${train.steps}}}"}}


@pytest.mark.parametrize("name", ["adamw", "adams", "scape", "scape_spec", "sparse_avg"])
def test_each_optimizer_file_equals_its_dataclass(name):
    from dataclasses import asdict

    from scape.config import OPTIMIZER_CONFIGS, ScapeConfig

    composed = OmegaConf.to_container(compose_config([f"optimizer={name}"]).optimizer, resolve=False)
    cls = OPTIMIZER_CONFIGS["scape" if name == "scape_spec" else name]
    expected = asdict(cls(**ScapeConfig.SPEC_RULE) if name == "scape_spec" else cls())
    for key, interpolation in RUN_DEPENDENT.get(name, {}).items():
        assert composed.pop(key) == interpolation and expected.pop(key) == 0, key
    assert composed == expected
    assert isinstance(OmegaConf.to_object(compose_config([f"optimizer={name}"])).optimizer, cls)


@pytest.mark.parametrize("overrides,needle", [
    (["+optimizer.lrr=1"], "optimizer.lrr=1 is not a key; optimizer=adamw does not use it"),
    (["optimizer=adamw", "optimizer.sparsity=1.5"], "optimizer.sparsity"),
    (["optimizer=adamw", "+optimizer.sparsity=0.5"], "optimizer.sparsity=0.5 is a SCAPE option; optimizer=adamw"),
    (["optimizer=adamw", "+optimizer.byte_budget=0.02"], "optimizer.byte_budget=0.02 is a sparse_avg option; optimizer=adamw"),
    (["optimizer=sparse_avg", "+optimizer.sparsity=0.7"], "optimizer.sparsity=0.7 is a SCAPE option; optimizer=sparse_avg"),
    (["optimizer=sparse_avg", "+optimizer.lag=false"], "optimizer.lag=False is a SCAPE option; optimizer=sparse_avg"),
    (["optimizer=scape", "+optimizer.value_bits=2"], "optimizer.value_bits=2 is a sparse_avg option; optimizer=scape"),
    # a parameter group: an unknown field, a second group, another optimizer's setting
    (["optimizer.param_groups=[{match:embedding,lr:2}]"],
     "optimizer.param_groups[0].lr is not a field of a parameter group (its fields: match, lr_scale, step_bound, "
     "denominator_beta): remove it"),
    (["optimizer=sparse_avg", "optimizer.param_groups=[{match:embedding,lr_scale:16},{match:embedding,step_bound:2}]"],
     "optimizer.param_groups holds 2 groups; one override group is supported"),
    (["+experiment=tiny_scape99", "optimizer.param_groups=[{match:embedding,lr_scale:16,denominator_beta:0.2}]"],
     "optimizer.param_groups[0].denominator_beta=0.2 sets the shared denominator's memory (sparse_avg), which "
     "optimizer=scape does not have"),
])
def test_a_key_the_optimizer_does_not_have_is_refused(overrides, needle, tmp_path):
    proc = train_cli([*overrides, f"out_dir={tmp_path}"], timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout
    assert not any(tmp_path.iterdir()), "a rejected config must not leave a run directory"
