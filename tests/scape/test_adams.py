"""AdamS against the spec's formula, element by element, written out independently."""
import math

import torch

from core.optim import AdamS


def _formula(p, g_seq, lr, b1, b2, eps, wd):
    p = p.clone().double()
    m = torch.zeros_like(p)
    for t, g in enumerate(g_seq, start=1):
        g = g.double()
        c = 1 - b1 ** t
        p = p * (1 - lr * wd)
        denom = torch.sqrt(b2 * (m / c) ** 2 + (1 - b2) * g ** 2) + eps
        m = b1 * m + (1 - b1) * g
        p = p - lr * (m / c) / denom
    return p, m


def test_adams_step_matches_formula_on_random_tensors():
    torch.manual_seed(0)
    p0 = torch.randn(7, 5)
    grads = [torch.randn(7, 5) * (i + 1) for i in range(6)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    param = torch.nn.Parameter(p0.clone())
    opt = AdamS([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected_p, expected_m = _formula(p0, grads, lr, b1, b2, eps, wd)
    torch.testing.assert_close(param.detach().double(), expected_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[param]["exp_avg"].double(), expected_m, rtol=1e-5, atol=1e-6)
    assert int(opt.state[param]["step"]) == len(grads)


def test_adams_update_is_bounded_after_warmup():
    """|m/c| / denom stays near 1 (the spec's ~1.03), unlike a raw gradient step."""
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.zeros(1000))
    opt = AdamS([param], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    prev = param.detach().clone()
    for t in range(1, 51):
        param.grad = torch.randn(1000) * 100.0
        opt.step()
        step = (param.detach() - prev).abs().max().item()
        prev = param.detach().clone()
        # Cauchy-Schwarz with a = m_{t-1}/c: |b1 a + (1-b1) g / c| / sqrt(b2 a^2 + (1-b2) g^2)
        # <= sqrt(b1^2/b2 + (1-b1)^2 / (c^2 (1-b2))), which tends to 1.026 as c -> 1.
        c = 1 - 0.9 ** t
        assert step <= math.sqrt(0.9 ** 2 / 0.95 + 0.1 ** 2 / (c * c * 0.05)) * (1 + 1e-5)
    assert step <= 1.035


def test_adams_rejects_bad_hyperparameters():
    p = torch.nn.Parameter(torch.zeros(2))
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.95)}):
        try:
            AdamS([p], **kwargs)
        except ValueError as exc:
            assert "optimizer." in str(exc)
        else:
            raise AssertionError(f"AdamS accepted {kwargs}")
