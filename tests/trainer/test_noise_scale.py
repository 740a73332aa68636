"""The simple gradient noise scale: the estimator on a problem with known Sigma and G, the step's
two squared norms against a hand computation, and train/noise_scale in real runs of every optimizer."""
from __future__ import annotations

import math

import pytest
import torch

from tests.train_helpers import TINY, check, read_metrics, train_cli
from trainer.noise_scale import NoiseScaleMeter, noise_terms, simple_noise_scale


def test_the_two_size_estimates_are_exact_on_their_expectations():
    g2, trace, b_small, b_big = 2.0, 300.0, 16.0, 256.0
    trace_hat, g2_hat = noise_terms(g2 + trace / b_small, g2 + trace / b_big, b_small, b_big)
    assert trace_hat == pytest.approx(trace) and g2_hat == pytest.approx(g2)
    assert simple_noise_scale(g2 + trace / b_small, g2 + trace / b_big, b_small, b_big) == pytest.approx(150.0)
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_terms(1.0, 1.0, 8.0, 8.0)


def _sampled_scale(gen: torch.Generator, mean: torch.Tensor, sigma: torch.Tensor, steps: int,
                   b_small: int, b_big: int) -> float:
    """The meter fed as the step feeds it: the small batch is the first part of the big one."""
    meter = NoiseScaleMeter()
    for _ in range(steps):
        samples = mean + sigma * torch.randn(b_big, mean.numel(), generator=gen, dtype=torch.float64)
        small, big = samples[:b_small].mean(0), samples.mean(0)
        meter.add(small.square().sum(), big.square().sum(), float(b_small), float(b_big))
    return meter.take()


def test_the_meter_recovers_a_known_noise_scale_within_its_noise():
    gen = torch.Generator().manual_seed(0)
    dim, b_small, b_big = 64, 4, 32
    mean = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.1
    sigma = torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5
    truth = float(sigma.square().sum() / mean.square().sum())
    assert b_small < truth / 4  # a regime where the noise dominates the small batch's gradient
    estimates = torch.tensor([_sampled_scale(gen, mean, sigma, 200, b_small, b_big) for _ in range(12)])
    spread = float(estimates.std() / math.sqrt(len(estimates)))
    assert spread < 0.1 * truth, (estimates, truth)  # the check below can fail: the noise is small
    assert abs(float(estimates.mean()) - truth) < 3 * spread, (float(estimates.mean()), truth, spread)


def test_non_finite_steps_are_left_out_and_one_size_gives_nothing():
    meter = NoiseScaleMeter()
    meter.add(torch.tensor(3.0), torch.tensor(2.0), 1.0, 2.0)
    meter.add(torch.tensor(math.nan), torch.tensor(2.0), 1.0, 2.0)
    assert meter.take() == pytest.approx(simple_noise_scale(3.0, 2.0, 1.0, 2.0))
    assert meter.take() is None  # taken: the next interval starts empty
    meter.add(torch.tensor(3.0), torch.tensor(3.0), 4.0, 4.0)
    assert meter.take() is None


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.w(x).squeeze(-1) - y).square().mean()


def test_the_step_measures_the_first_micro_batch_and_the_whole_backward():
    from core.comm import Collectives
    from core.sync import DenseAllReduce
    from trainer.step import train_step

    torch.manual_seed(0)
    model = _Linear()
    batches = [(torch.randn(4, 8), torch.randn(4)) for _ in range(3)]
    grads = []
    for x, y in batches:
        model.zero_grad()
        model(x, y).backward()
        grads.append(model.w.weight.grad.clone())
    sync = DenseAllReduce(model, lambda p: torch.optim.SGD(p, lr=0.0), grad_sync="after_backward")
    result = train_step(model, sync, iter(batches), 3, 0.0, 0.0, Collectives())
    sq_small, sq_big = result.device_values[5:7].tolist()
    assert sq_small == pytest.approx(float(grads[0].square().sum()), rel=1e-5)
    assert sq_big == pytest.approx(float((sum(grads) / 3).square().sum()), rel=1e-5)
    assert result.noise_batch_sizes == (4.0, 12.0)  # tokens: y's elements per micro-batch, times 3


# Every optimizer on 2 gloo ranks, 2 micro-batches a step (1,024 tokens): the metric is logged,
# finite and positive; DDP's whole-backward gradient is the mean of both ranks'.
ARMS = {"adamw_ddp": ["optimizer=adamw"], "adams": ["optimizer=adams"],
        "scape": ["optimizer=scape", "optimizer.sparsity_warmup_steps=0"],
        "sparse_avg": ["optimizer=sparse_avg"], "sdp": ["optimizer=adams", "sdp=block", "sdp.coverage=0.5"]}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_optimizer_logs_the_noise_scale(arm, tmp_path, prepared_cache):
    check(train_cli([*TINY, *ARMS[arm], f"out_dir={tmp_path}", f"data.cache_dir={prepared_cache}", "run_name=n",
                     "train.steps=4", "train.log_every=2", "train.global_batch_tokens=1024"], nproc=2))
    scales = [r["train/noise_scale"] for r in read_metrics(tmp_path / "n") if "train/noise_scale" in r]
    assert scales and all(math.isfinite(s) and s > 0 for s in scales), scales
