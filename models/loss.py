"""The training loss, a selectable component (``model.loss``): the LM head and cross-entropy.

``fused`` (the default) is the chunked linear + cross-entropy below, which never materialises the
[N, V] logits; ``standard`` is F.linear then F.cross_entropy, the textbook form. Both take the
final hidden states [N, d], the head weight [V, d] and targets [N] (-1 = ignore) and return the
mean over the counted positions in fp32.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F

def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


_LOG2_E = 1.4426950408889634  # log2(e)


def _chunk_rows(vocab_size: int, device: torch.device) -> int:
    # About 16 MB of fp32 logits per chunk on CPU (512 rows of a 8192 vocabulary: smaller
    # chunks re-read the head weight more often), 256 MB on an accelerator (big enough for
    # full-speed matmuls, small next to [N, V]).
    elements = (1 << 22) if device.type == "cpu" else (1 << 26)
    return max(16, elements // vocab_size)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` without materialising the [N, V] logits.

    Rows are processed in chunks through one reused buffer; each chunk's logits become, in
    place, the gradient of the loss with respect to them, which is immediately multiplied into
    the hidden-state and weight gradients. Backward only scales those by the incoming gradient.
    Same matmuls as the plain head + F.cross_entropy, but no [N, V] log-softmax, no [N, V]
    gradient buffer and fewer passes over the logits.

    A chunk's logits are held vocabulary-major, [V, rows] (``weight @ hidden.T``): on CPU that
    matmul runs faster than the [rows, V] one (MKL; docs/RESULTS.md) and needs no transposed
    copy of the weight, and the two gradient matmuls run as fast either way. The softmax is
    left unnormalised, e = exp(z - max) with column sums s >= 1, so lse = max + log s; the
    gradient (softmax - one-hot) = (e - s * one-hot) / s gets its 1/s with the other per-row
    scales on the [rows, d] side.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype, need_grads: bool) -> torch.Tensor:
        rows = _chunk_rows(weight.shape[0], hidden.device)
        vocab = weight.shape[0]
        valid = targets != -1
        count = valid.sum()
        scale = 1.0 / count.to(torch.float32)  # inf when every target is ignored: nan, as F.cross_entropy
        finite_scale = torch.where(count > 0, scale, 0.0)  # for gradients: zero, not nan
        w = weight.to(compute_dtype)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grads else None
        # Written (not accumulated) by the first chunk; zeros only if there is no chunk at all.
        new_weight_grad = torch.empty if hidden.shape[0] else torch.zeros
        grad_weight = new_weight_grad(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        # One fp32 logits buffer for all chunks: allocating a fresh multi-MB block per chunk
        # costs page faults on CPU (glibc returns big blocks to the OS when they are freed).
        buffer = torch.empty(vocab * min(rows, hidden.shape[0]), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h = hidden[start:start + rows].to(compute_dtype)
            chunk_valid = valid[start:start + rows]
            safe_targets = targets[start:start + rows].clamp(min=0)[None, :]
            logits = buffer[:vocab * h.shape[0]].view(vocab, h.shape[0])  # contiguous [V, rows]
            if compute_dtype == torch.float32:
                torch.mm(w, h.t(), out=logits)
            else:
                logits.copy_(w @ h.t())
            target_logits = logits.gather(0, safe_targets).squeeze(0)
            column_max = logits.amax(dim=0)
            # e = exp(z - max) as 2^(z log2(e) - max log2(e)): one fused pass for the shift and
            # scale; exp2 is cheaper than exp on CPU (both 1-ulp SLEEF kernels).
            torch.add(column_max * -_LOG2_E, logits, alpha=_LOG2_E, out=logits).exp2_()
            sums = logits.sum(dim=0)
            loss_sum += torch.where(chunk_valid, column_max + sums.log() - target_logits, 0.0).sum()
            if not need_grads:  # (the same loss as with gradients, to the last bit)
                continue
            logits.scatter_add_(0, safe_targets, -sums[None, :])  # s * (softmax - one-hot)
            first = start == 0  # the first chunk writes grad_weight, the others accumulate
            if compute_dtype == torch.float32 and hidden.dtype == torch.float32:
                # d loss / d logits = (softmax - one-hot) / count on valid rows, applied as one
                # scale per row on the [rows, d] operand and result, not on the [V, rows] matrix.
                row_scale = torch.where(chunk_valid, scale / sums, 0.0)[:, None]
                torch.mm(logits.t(), w, out=grad_hidden[start:start + rows]).mul_(row_scale)
                grad_weight.addmm_(logits, h * row_scale, beta=0.0 if first else 1.0)
                continue
            # Reduced precision: normalise in fp32, mask rows exactly, scale in fp32 after the
            # matmul (1/count is not exact in bf16, and a rounded scale would bias every
            # gradient the same way).
            grad_logits = logits.div_(sums).to(compute_dtype)
            row_scale = torch.where(chunk_valid, scale, 0.0)[:, None]
            grad_hidden[start:start + rows] = ((grad_logits.t() @ w).float() * row_scale).to(hidden.dtype)
            partial = (grad_logits @ (h * chunk_valid[:, None])).float() * finite_scale
            if first:
                grad_weight.copy_(partial)
            else:
                grad_weight += partial
        if need_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss_sum * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if (grad_loss.device.type == "cpu" and not torch.compiler.is_compiling()
                and grad_loss.item() == 1.0):
            # loss.backward(): hand the gradients over as they are (autograd takes them as the
            # parameters' .grad without a copy); a product would be one more pass and a fresh
            # [V, d] block, which on CPU is new pages faulted in. (Not when compiling: .item()
            # would break the graph.)
            return grad_hidden, grad_weight, None, None, None
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), \
            None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 mean cross-entropy of the logits ``hidden @ weight.T`` [N, V] against targets [N]
    (-1 = ignored), equal to F.cross_entropy(F.linear(hidden, weight).float(), targets,
    ignore_index=-1) but chunked (see _LinearCrossEntropy). Honours autocast's matmul dtype."""
    need_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    compute_dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, compute_dtype, need_grads)


def standard_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.linear then F.cross_entropy over the full [N, V] logits, in fp32."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-1)


LOSSES: Dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fused": linear_cross_entropy,
    "standard": standard_cross_entropy,
}


def loss_function(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    return LOSSES[name]  # the choice is checked in ModelConfig
