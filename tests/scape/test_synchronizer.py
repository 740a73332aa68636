"""SCAPE in one process: update rules, ablations, offload, schedules, metrics, skipped steps."""
import math

import pytest
import torch

from scape.synchronizer import ScapeSynchronizer
from scape.update import ScapeOptimizer
from tests.scape.helpers import batch, make_model, scape_config, train
from core.flat import param_groups
from core.sync import DenseAllReduce


def test_lazy_update_moves_off_mask_weights_by_weight_decay_only():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, weight_decay=0.1))
    train(model, sync, 2, rank=0)
    before_p, before_m = sync.flat.data.clone(), sync.optimizer.momentum.clone()
    decay = torch.zeros_like(before_p)
    decay[:sync.optimizer.decay_end] = 1.0
    train(model, sync, 1, rank=0, start=2, lr=1e-2)
    off = torch.ones_like(before_p, dtype=torch.bool)
    off[sync.mask] = False
    expected = before_p * (1 - 1e-2 * 0.1 * decay)
    assert torch.equal(sync.flat.data[off], expected[off])
    assert torch.equal(sync.optimizer.momentum[off], before_m[off])
    assert not torch.equal(sync.flat.data[~off], expected[~off])


def test_table_lr_scale_multiplies_the_tables_step_and_decay():
    """ScapeOptimizer with the table range [2, 6) at k = 3: a lazy step moves the table's masked
    coordinates k times as far, decays the whole table at k lr; a dense step likewise; the other
    coordinates as at k = 1 (the same state, the same ghat)."""
    k, lr, wd = 3.0, 1e-2, 0.1
    torch.manual_seed(0)
    start, grad, momentum = torch.randn(10), torch.randn(10), torch.randn(10)
    indices = torch.tensor([0, 3, 4, 8])

    def run(update, scale):
        opt = ScapeOptimizer(start.clone(), 8, lr, (0.9, 0.95), 1e-8, wd, table_ranges=[(2, 6)], table_lr_scale=scale)
        opt.momentum.copy_(momentum)
        if update == "masked":
            opt.masked_update(indices, grad[indices], lr, step=3)
        else:
            opt.dense_update(grad, lr, step=3)
        return opt.param - start

    for update in ("masked", "dense"):
        one, scaled = run(update, 1.0), run(update, k)
        table = torch.zeros(10, dtype=torch.bool)
        table[2:6] = True
        torch.testing.assert_close(scaled[table], k * one[table])
        assert torch.equal(scaled[~table], one[~table])
    off_mask_table = torch.tensor([2, 5])
    torch.testing.assert_close(run("masked", k)[off_mask_table], -k * lr * wd * start[off_mask_table])


def test_update_all_moves_every_weight():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, update="all", stale_scale_cap=1, weight_decay=0.0))
    train(model, sync, 2, rank=0)
    before = sync.flat.data.clone()
    train(model, sync, 1, rank=0, start=2)
    moved = sync.flat.data[:sync.layout.numel] != before[:sync.layout.numel]
    nonzero_m = sync.optimizer.momentum[:sync.layout.numel] != 0
    assert torch.all(moved[nonzero_m])  # stale momentum moves every off-mask weight (the spec)


def test_base_adamw_at_density_one_equals_torch_adamw():
    model, reference = make_model(), make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.0, base="adamw"))
    dense = DenseAllReduce(reference, lambda ps: torch.optim.AdamW(
        param_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8))
    train(model, sync, 6, rank=0)
    train(reference, dense, 6, rank=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_offloaded_residual_in_chunks_matches_the_device_residual():
    results = []
    for offload in (False, True):
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, offload_residual=offload),
                                 residual_chunk_numel=333)  # many chunks, ragged last one
        assert len(sync.residual.bounds()) == (1 if not offload else
                                               math.ceil(sync.layout.padded_numel / 333))
        train(model, sync, 5, rank=0)
        results.append((sync.flat.data.clone(), sync.residual.cpu_copy()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_score_gradient_ranks_the_contribution_and_moment_adds_momentum():
    for score in ("moment", "gradient"):
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, score=score, score_timing="pre_send"))
        train(model, sync, 2, rank=0)
        captured = {}
        momentum = sync.optimizer.momentum.clone()
        train(model, sync, 1, rank=0, start=2,
              before_reduce=lambda s: captured.update(e=sync.residual.cpu_copy(),
                                                      g=sync.flat.grad.clone()))
        contribution = captured["e"] + 0.1 * captured["g"]
        expected = (contribution + 0.9 * momentum).abs() if score == "moment" \
            else contribution.abs()
        torch.testing.assert_close(sync.score, expected, rtol=1e-6, atol=1e-9)


def test_stale_scale_multiplies_the_lazy_step_by_capped_staleness():
    param = torch.zeros(8)
    opt = ScapeOptimizer(param, decay_end=0, lr=1.0, betas=(0.9, 0.95), eps=1e-8,
                         weight_decay=0.0, stale_scale_cap=3)
    opt.last_sent.copy_(torch.tensor([9, 8, 5, 0, 9, 9, 9, 9], dtype=torch.int32))
    indices = torch.tensor([0, 1, 2, 3])
    opt.masked_update(indices, torch.ones(4), lr=1.0, step=10)
    step = param[0].item()
    assert step < 0
    torch.testing.assert_close(param[:4], torch.tensor([1.0, 2.0, 3.0, 3.0]) * step)
    assert opt.last_sent[:4].tolist() == [10] * 4 and opt.last_sent[4].item() == 9


def test_sparsity_warmup_lowers_density_geometrically():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.99, sparsity_warmup_steps=10))
    densities = [sync.density_at(t) for t in range(1, 13)]
    assert densities[0] == pytest.approx(0.01 ** 0.1)
    assert densities[9:] == [pytest.approx(0.01)] * 3
    ks = [sync.k_at(t) for t in range(1, 13)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] == sync.layout.k(0.01)


def test_dense_warmup_steps_are_dense_and_metrics_are_reported():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9, dense_warmup_steps=3))
    logged = []
    train(model, sync, 5, rank=0, after=lambda s: logged.append(sync.metrics()))
    assert [m["scape/dense_step"] for m in logged] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert logged[0]["scape/residual_norm"] == 0.0 and logged[4]["scape/residual_norm"] > 0
    assert logged[4]["scape/density"] == pytest.approx(
        sync.k_at(5) / sync.layout.partition_size)
    assert 0.0 <= logged[4]["scape/mask_overlap"] <= 1.0
    for key in ("scape/time_topk_s", "scape/time_pack_s", "scape/time_wait_s"):
        assert all(m[key] >= 0 for m in logged)
    assert logged[2]["scape/time_topk_s"] > 0  # the first mask is chosen after the last dense step


def test_non_finite_step_is_rolled_back_and_the_mask_reused():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9))
    train(model, sync, 3, rank=0)
    residual, params, mask = sync.residual.cpu_copy(), sync.flat.data.clone(), sync.mask.clone()
    sync.zero_grad()
    x, y = batch(0, 4)
    model(x, y).backward()
    sync.flat.grad[int(mask[0])] = float("nan")  # on the mask: ghat is NaN on every rank
    sync.reduce_gradients()
    assert math.isnan(sync.clip_gradients(1.0))  # the loop skips step() and after_step()
    sync.zero_grad()
    restored = sync.residual.cpu_copy()
    torch.testing.assert_close(restored, residual, rtol=0, atol=1e-7)
    assert torch.equal(sync.flat.data, params)
    train(model, sync, 1, rank=0, start=4)  # the retry uses the same mask
    assert sync.step_count == 4 and torch.isfinite(sync.flat.data).all()


def test_state_dict_requires_matching_layout():
    sync = ScapeSynchronizer(make_model(), scape_config())
    state = sync.state_dict()
    other = ScapeSynchronizer(torch.nn.Linear(300, 300), scape_config())
    with pytest.raises(ValueError, match="numel"):
        other.load_state_dict(state)
