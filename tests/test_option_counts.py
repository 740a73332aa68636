"""The options that won, and nothing else: each method's own keys stay few (issue targets).

Counted are the keys an optimizer adds to the ones every optimizer shares (lr, betas, eps, weight
decay, clipping, the lr schedule, sharding, the gradient sync and the parameter groups:
core.optim.DenseOptimizerConfig). A new key has to displace one or justify raising the bound."""
from dataclasses import fields

from core.optim import DenseOptimizerConfig
from scape.config import OPTIMIZER_CONFIGS

SHARED = {f.name for f in fields(DenseOptimizerConfig)}
BOUND = {"adamw": 0, "adams": 0, "scape": 18, "sparse_avg": 15}


def own_keys(name: str) -> list:
    return [f.name for f in fields(OPTIMIZER_CONFIGS[name]) if f.name not in SHARED]


def test_each_optimizer_adds_at_most_its_bound_of_keys():
    assert set(BOUND) == set(OPTIMIZER_CONFIGS)
    over = {name: own_keys(name) for name in BOUND if len(own_keys(name)) > BOUND[name]}
    assert not over, f"optimizers over their key bound {BOUND}: {over}"


def test_the_shared_keys_stay_the_dense_optimizers_and_no_more():
    assert len(SHARED) <= 13, sorted(SHARED)
