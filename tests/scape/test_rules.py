"""SCAPE's formulation options in one process: post-step scoring, lr-sum catch-up, the density
cap (docs/SCAPE.md, "Rules")."""
import pytest
import torch

from scape.synchronizer import ScapeSynchronizer
from scape.topk import topk_mask
from scape.update import ScapeOptimizer
from tests.scape.helpers import make_model, scape_config, train


@pytest.mark.parametrize("score", ["moment", "gradient"])
def test_post_step_score_is_taken_from_the_updated_momentum_and_the_cleared_residual(score):
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, score_timing="post_step", score=score),
                             num_partitions=2)
    seen = {}

    def after(step):
        seen[step] = (sync.score.clone(), sync.optimizer.momentum.clone(), sync.residual.cpu_copy(),
                      None if sync.mask is None else sync.mask.clone())

    train(model, sync, 4, rank=0, after=after)
    scores, momentum, residual, sent = seen[4]
    expected = (0.9 * momentum + residual).abs() if score == "moment" else residual.abs()
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-9)
    assert torch.count_nonzero(residual[sent]) == 0  # the coordinates just sent hold nothing...
    # ...so, with the moment score, they rank by their momentum only
    size, k = sync.layout.partition_size, sync.k_at(5)
    expected_mask = torch.empty(sync.layout.padded_numel, dtype=torch.bool)
    for p in range(2):
        topk_mask(expected[p * size:(p + 1) * size], k, expected_mask[p * size:(p + 1) * size])
    sync._wait_pending()
    assert torch.equal(sync.mask, torch.nonzero(expected_mask).squeeze(1))


def test_post_step_score_changes_the_mask_sequence():
    """The spec's pre-send score re-selects what was just sent; post-step does so far less."""
    overlaps = {}
    for timing in ("pre_send", "post_step"):
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, score_timing=timing))
        values = []
        train(model, sync, 8, rank=0, after=lambda step: values.append(float(sync._overlap))
              if sync._overlap is not None else None)
        overlaps[timing] = sum(values) / len(values)
    assert overlaps["post_step"] < overlaps["pre_send"]


def test_lr_sum_staleness_is_the_sum_of_learning_rates_since_last_sent_in_units_of_this_lr():
    param = torch.zeros(4)
    for mode, expected in (("steps", [3.0, 2.0, 1.0, 0.0]), ("lr_sum", [2.0, 5 / 3, 1.0, 0.0])):
        opt = ScapeOptimizer(param, decay_end=0, lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             stale_scale=mode, stale_scale_cap=100)
        for step, lr in ((1, 0.1), (2, 0.2), (3, 0.3)):
            opt._record_lr(step, lr)
        opt.last_sent.copy_(torch.tensor([0, 1, 2, 3], dtype=torch.int32))
        got = opt._staleness(torch.arange(4), lr=0.3, step=3)
        torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-7)
        opt.stale_scale_cap = 1.5
        assert opt._staleness(torch.arange(4), lr=0.3, step=3).max().item() == pytest.approx(1.5)


def test_lr_sum_table_grows_and_a_zero_cap_means_one_over_density():
    sync = ScapeSynchronizer(make_model(), scape_config(sparsity=0.9, stale_scale="lr_sum",
                                                        stale_scale_cap=0))
    assert sync.optimizer.stale_scale_cap == pytest.approx(10.0)
    opt = sync.optimizer
    for step in range(1, 1500):
        opt._record_lr(step, 1e-3)
    assert opt.lr_sums.numel() >= 1500
    assert opt.lr_sums[1499].item() == pytest.approx(1.499, rel=1e-9)
