"""The replicated half of SCAPE: momentum (and AdamW's v for the ablation) and the update rules.

Every rank applies the same update to the same state with the same all-reduced ghat, so
parameters and momentum stay bit-identical across ranks without any broadcast.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from scape import kernels


class ScapeOptimizer:
    """AdamS (or AdamW, ``base='adamw'``) over one flat fp32 buffer, dense or on a mask.

    Weight decay applies to ``[0, decay_end)``: the synchroniser lays out matrices first, so
    "decay on ndim >= 2 only" is one contiguous range. ``param_groups`` mirrors torch's optimizers
    so code that reads the learning rate from ``sync.optimizer`` keeps working.

    ``table_ranges`` / ``table_lr_scale`` k (a parameter group's ``lr_scale``): the coordinates in
    those ``[start, end)`` ranges of the flat buffer (the embedding tables) train at k lr, their
    step and their weight decay, as the dense optimizers' third param group does.
    """

    def __init__(self, param: torch.Tensor, decay_end: int, lr: float, betas, eps: float,
                 weight_decay: float, base: str = "adams", stale_scale: str = "steps",
                 stale_scale_cap: float = 1.0, table_ranges: Sequence[Tuple[int, int]] = (),
                 table_lr_scale: float = 1.0) -> None:
        self.param = param
        self.decay_end = decay_end
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.base = base
        self.stale_scale = stale_scale
        self.stale_scale_cap = float(stale_scale_cap)
        self.table_lr_scale = float(table_lr_scale)
        self.table_ranges = [(int(a), int(b)) for a, b in table_ranges] if self.table_lr_scale != 1.0 else []
        self.param_groups = [{"lr": lr, "betas": (self.beta1, self.beta2), "eps": self.eps,
                              "weight_decay": self.weight_decay}]
        self.momentum = torch.zeros_like(param)
        self.second_moment = torch.zeros_like(param) if base == "adamw" else None
        # step at which each coordinate was last sent: staleness for stale_scale_cap > 1
        self.last_sent = torch.zeros(param.numel(), dtype=torch.int32, device=param.device) \
            if self.stale_scale_cap > 1 else None
        # lr_sums[t] = lr_1 + ... + lr_t (float64), for stale_scale=lr_sum; grows with the step
        self.lr_sums = torch.zeros(1024, dtype=torch.float64, device=param.device) \
            if self.last_sent is not None and stale_scale == "lr_sum" else None

    def _record_lr(self, step: int, lr: float) -> None:
        """lr_sums[step] = lr_sums[step - 1] + lr (once per step; a retried step overwrites it)."""
        if self.lr_sums is None:
            return
        if step >= self.lr_sums.numel():
            grown = torch.zeros(2 * step, dtype=torch.float64, device=self.lr_sums.device)
            grown[:self.lr_sums.numel()] = self.lr_sums
            self.lr_sums = grown
        self.lr_sums[step] = self.lr_sums[step - 1] + lr

    def _staleness(self, indices: torch.Tensor, lr: float, step: int) -> torch.Tensor:
        """min(staleness, cap) per coordinate of ``indices``: steps since last sent, or the sum of
        the learning rates since then in units of this step's lr (the two agree at constant lr)."""
        last = self.last_sent.index_select(0, indices)
        if self.lr_sums is None:
            since = (step - last).float()
        else:
            since = ((self.lr_sums[step] - self.lr_sums.index_select(0, last.long())) / lr).float()
        return since.clamp_(max=self.stale_scale_cap)

    def _table_scales(self, indices: torch.Tensor) -> torch.Tensor:
        """k on the tables' coordinates among ``indices``, 1 elsewhere (a factor of the lazy step)."""
        on = torch.zeros_like(indices, dtype=torch.bool)
        for start, end in self.table_ranges:
            on |= (indices >= start) & (indices < end)
        return torch.where(on, self.table_lr_scale, 1.0).to(self.param.dtype)

    def _decay(self, lr: float) -> None:
        """Decoupled weight decay on ``[0, decay_end)``, at k lr on the tables there."""
        if self.weight_decay == 0.0 or self.decay_end == 0:
            return
        self.param[:self.decay_end].mul_(1.0 - lr * self.weight_decay)
        for start, end in self.table_ranges:
            end = min(end, self.decay_end)
            if start < end:
                self.param[start:end].mul_((1.0 - self.table_lr_scale * lr * self.weight_decay)
                                           / (1.0 - lr * self.weight_decay))

    # --- the three update shapes -------------------------------------------------------------
    def dense_update(self, grad: torch.Tensor, lr: float, step: int, all_sent: bool = True) -> None:
        """Every coordinate gets ``grad`` (a dense step, or ``update='all'`` with zeros off-mask).

        ``all_sent``: every coordinate's contribution was sent (a dense step), so no staleness.
        The fused kernel takes one lr, so the tables' change (step and decay) is scaled by k after it.
        """
        self.param_groups[0]["lr"] = lr
        self._record_lr(step, lr)
        before = [(start, end, self.param[start:end].clone()) for start, end in self.table_ranges]
        if self.base == "adams":  # the fused kernel applies the weight decay itself
            kernels.adams_dense_update(self.param, self.momentum, grad, lr, self.beta1, self.beta2,
                                       self.eps, 1.0 - self.beta1 ** step, self.weight_decay,
                                       self.decay_end)
        else:
            self._adamw(self.param, self.momentum, self.second_moment, grad, lr, step, None)
        for start, end, old in before:
            self.param[start:end].sub_(old).mul_(self.table_lr_scale).add_(old)
        if self.last_sent is not None and all_sent:
            self.last_sent.fill_(step)

    def masked_update(self, indices: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """The lazy rule: decay everywhere, then the step on ``indices`` only (``grad`` = their ghat)."""
        self.param_groups[0]["lr"] = lr
        self._decay(lr)
        self._record_lr(step, lr)
        scale = None
        if self.last_sent is not None:
            scale = self._staleness(indices, lr, step)
            self.last_sent.index_fill_(0, indices, step)
        if self.table_ranges:
            tables = self._table_scales(indices)
            scale = tables if scale is None else scale * tables
        if self.base == "adams":
            kernels.adams_masked_update(self.param, self.momentum, indices, grad, lr, self.beta1,
                                        self.beta2, self.eps, 1.0 - self.beta1 ** step, scale)
        else:
            p, m, v = (t.index_select(0, indices) for t in
                       (self.param, self.momentum, self.second_moment))
            self._adamw(p, m, v, grad, lr, step, scale, decay=False)
            for full, part in ((self.param, p), (self.momentum, m), (self.second_moment, v)):
                full.index_copy_(0, indices, part)

    def _adamw(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               lr: float, step: int, scale: Optional[torch.Tensor], decay: bool = True) -> None:
        """torch.optim.AdamW's arithmetic (decoupled decay first, bias-corrected m and v)."""
        if decay and self.weight_decay != 0.0 and self.decay_end > 0:
            p[:self.decay_end].mul_(1.0 - lr * self.weight_decay)
        m.lerp_(grad, 1.0 - self.beta1)
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        denom = (v.sqrt() / (1.0 - self.beta2 ** step) ** 0.5).add_(self.eps)
        step_size = lr / (1.0 - self.beta1 ** step)
        if scale is None:
            p.addcdiv_(m, denom, value=-step_size)
        else:
            p.addcdiv_(m * scale, denom, value=-step_size)

    # --- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state = {"momentum": self.momentum.detach().cpu().clone()}
        if self.second_moment is not None:
            state["second_moment"] = self.second_moment.detach().cpu().clone()
        if self.last_sent is not None:
            state["last_sent"] = self.last_sent.cpu().clone()
        if self.lr_sums is not None:
            state["lr_sums"] = self.lr_sums.cpu().clone()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "sharded_over" in state:
            raise ValueError("this SCAPE checkpoint was written with optimizer.shard=true (each rank's "
                             "file holds its momentum shard): resume with optimizer.shard=true")
        for name, tensor in (("momentum", self.momentum), ("second_moment", self.second_moment),
                             ("last_sent", self.last_sent)):
            if tensor is None:
                continue
            if name not in state:
                raise ValueError(f"SCAPE checkpoint has no {name!r}: it was written with another "
                                 f"optimizer.base / optimizer.stale_scale_cap")
            if state[name].shape != tensor.shape:
                raise ValueError(f"SCAPE checkpoint {name!r} has shape {tuple(state[name].shape)}, "
                                 f"this model needs {tuple(tensor.shape)}")
            tensor.copy_(state[name])
        if self.lr_sums is not None:
            if "lr_sums" not in state:
                raise ValueError("SCAPE checkpoint has no 'lr_sums': it was written with another "
                                 "optimizer.stale_scale")
            self.lr_sums = state["lr_sums"].to(self.lr_sums.device, copy=True)
