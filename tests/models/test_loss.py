"""The chunked LM-head cross-entropy equals the plain head + F.cross_entropy, values and grads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models.loss as common
from models.loss import linear_cross_entropy


def _reference(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-1)


@pytest.mark.parametrize("chunk_rows", [7, 16, 1000])
def test_matches_plain_cross_entropy_across_chunk_boundaries(monkeypatch, chunk_rows: int) -> None:
    monkeypatch.setattr(common, "_chunk_rows", lambda vocab, device: chunk_rows)
    torch.manual_seed(0)
    hidden = torch.randn(45, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    targets = torch.randint(0, 100, (45,))
    targets[[0, 8, 44]] = -1
    loss = linear_cross_entropy(hidden, weight, targets)
    (2.5 * loss).backward()  # a non-unit incoming gradient must scale both grads
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    expected = _reference(hidden, weight, targets)
    (2.5 * expected).backward()
    torch.testing.assert_close(got[0], expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[2], weight.grad, atol=1e-6, rtol=1e-5)


def test_extreme_and_tied_logits() -> None:
    """The log-sum-exp is read off the largest probability: it must stay exact when every other
    probability underflows (a loss of ~200 on a confidently wrong row), with tied maxima, and
    far from zero."""
    vocab = 16
    logits = torch.zeros(5, vocab)
    logits[0, 0] = 200.0                                  # target 3: p underflows to 0
    logits[1, :2] = 50.0                                  # a tie for the maximum
    logits[3] = -1000.0 - torch.arange(vocab).float()     # all logits far below zero
    logits[4] = torch.linspace(-30.0, 30.0, vocab)
    targets = torch.tensor([3, 1, 7, 0, 15])
    # Identity head: the hidden states are the logits.
    hidden = logits.clone().requires_grad_()
    weight = torch.eye(vocab, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    expected = _reference(hidden, weight, targets)
    expected.backward()
    torch.testing.assert_close(got[0], expected.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got[1], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[2], weight.grad, atol=1e-5, rtol=1e-5)
    assert got[0] > 40  # row 0 alone contributes 200 / 5


def test_without_grad_and_all_ignored() -> None:
    hidden, weight = torch.randn(10, 8), torch.randn(20, 8)
    targets = torch.randint(0, 20, (10,))
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(evaluated, _reference(hidden, weight, targets))
    # Validation and training compute the loss the same way, to the last bit.
    assert evaluated.item() == linear_cross_entropy(hidden.requires_grad_(), weight, targets).item()
    assert torch.isnan(linear_cross_entropy(hidden, weight, torch.full((10,), -1)))


def test_bf16_autocast_uses_bf16_matmuls_and_fp32_loss() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    targets = torch.randint(0, 50, (64,))
    targets[[3, 40]] = -1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
        expected = _reference(hidden, weight, targets)
    assert loss.dtype == torch.float32
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected.backward()
    # bf16 matmuls: gradients to bf16 precision, ignored rows exactly zero.
    torch.testing.assert_close(got_grads[0], hidden.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got_grads[1], weight.grad, atol=2e-3, rtol=2e-2)
    assert not got_grads[0][[3, 40]].any()
    # bf16 logits: equal to the autocast reference to bf16 precision, not to the fp32 loss.
    torch.testing.assert_close(loss, expected, atol=2e-2, rtol=0)
    fp32 = _reference(hidden, weight, targets)
    assert (loss - fp32).abs() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_target_ignored_gives_nan_loss_and_zero_gradients(dtype) -> None:
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, torch.full((6,), -1))
    assert torch.isnan(loss)
    loss.backward()
    assert not hidden.grad.any() and not weight.grad.any()


def test_unit_gradient_handover_survives_a_second_backward_and_accumulation() -> None:
    """loss.backward() hands the saved gradients over as they are: a retained graph's second
    backward and the in-place accumulation into .grad must not alter what was saved."""
    torch.manual_seed(5)
    hidden = torch.randn(20, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (20,))
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    _reference(hidden, weight, targets).backward()
    torch.testing.assert_close(got[0], 3 * hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], 3 * weight.grad, atol=1e-6, rtol=1e-5)
