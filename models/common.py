"""What both families share: attention kernels, initialisation, the trunk's forward and loss.

The families (models/llama.py, models/gpt.py) only define their blocks and embeddings; the loop
over blocks, activation checkpointing, the LM head and the loss live here once, so the two
cannot drift apart.
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.config import ModelConfig
from models.ops import block_causal_attention



def resolved_kv_heads(cfg: ModelConfig) -> int:
    n_kv = cfg.n_head if (cfg.family == "gpt" or cfg.n_kv_head is None) else cfg.n_kv_head
    if cfg.n_head % n_kv:
        raise ValueError(f"model.n_head={cfg.n_head} must be a multiple of model.n_kv_head={n_kv}")
    return n_kv


def resolved_ffn_hidden(cfg: ModelConfig) -> int:
    """MLP width; when unset: gpt 4 d, llama 8/3 d rounded up to a multiple of 256 (Llama's rule)."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    if cfg.family == "gpt":
        return 4 * cfg.d_model
    return 256 * math.ceil(8 * cfg.d_model / 3 / 256)


def validate_config(cfg: ModelConfig) -> None:
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"model.d_model={cfg.d_model} must be a multiple of model.n_head={cfg.n_head}")
    resolved_kv_heads(cfg)
    if cfg.attention == "flash" and not flash_attn_installed():
        raise ValueError(
            "model.attention=flash but the flash-attn package is not installed (it needs CUDA; "
            "there are no aarch64 wheels). Install it with `pip install flash-attn`, or set "
            "model.attention=sdpa (PyTorch's fused attention) or model.attention=auto.")


_FLASH_ATTN = None


def flash_attn_installed() -> bool:
    global _FLASH_ATTN
    if _FLASH_ATTN is None:
        try:
            from flash_attn import flash_attn_func  # type: ignore[import-not-found]
            _FLASH_ATTN = flash_attn_func
        except ImportError:
            _FLASH_ATTN = False
    return _FLASH_ATTN is not False


# On CPU in fp32, ``auto`` attention up to this length is models.ops.block_causal_attention (its
# memory grows as T^2; beyond ~512 SDPA's flash kernel is the better trade).
BLOCK_ATTENTION_MAX_LENGTH = 512


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """Causal self-attention on [B, T, H, hd] queries and [B, T, H_kv, hd] keys/values.

    Returns [B, T, H, hd]. flash-attn takes this layout natively; SDPA wants heads first.
    ``auto``: flash-attn on CUDA when installed (bf16/fp16), blocked matmul attention on CPU for
    fp32 sequences up to BLOCK_ATTENTION_MAX_LENGTH, SDPA otherwise; ``sdpa`` always SDPA.
    """
    use_flash = (backend != "sdpa" and q.is_cuda and flash_attn_installed()
                 and q.dtype in (torch.float16, torch.bfloat16))
    if backend == "flash" and not use_flash:
        if not q.is_cuda:
            raise ValueError("model.attention=flash needs CUDA tensors; set model.attention=sdpa "
                             "or auto on this device")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"model.attention=flash needs bf16/fp16 activations (got {q.dtype}); "
                             "train under bf16 autocast or set model.attention=sdpa or auto")
    if use_flash:
        return _FLASH_ATTN(q, k, v, causal=True)
    if (backend == "auto" and q.device.type == "cpu" and q.dtype == torch.float32
            and q.shape[1] <= BLOCK_ATTENTION_MAX_LENGTH):
        return block_causal_attention(q, k, v)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Grouped-query attention without copying k/v per query head.
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return y.transpose(1, 2)


class RotaryEmbedding(nn.Module):
    """RoPE tables in Llama's (HF's) half-split layout, so weights map to transformers unpermuted.

    cos/sin are [T, 1, hd/2] (both halves of a head share the same angles; models/ops.py's
    apply_rotary uses them for each), cached per (length, device) in fp32 and kept out of the
    state dict; they are recomputed after a move between devices.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._cache: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (length, str(device))
        if key not in self._cache:
            inv_freq = 1.0 / (self.theta ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
                / self.head_dim))
            positions = torch.arange(length, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [T, hd/2]
            self._cache[key] = (freqs.cos()[:, None, :], freqs.sin()[:, None, :])
        return self._cache[key]


# ---------------------------------------------------------------------------------------------
# Initialisation

RESIDUAL_OUTPUT_SUFFIXES = ("attn.o_proj.weight", "mlp.down_proj.weight", "mlp.proj.weight")


def _parameter_seed(base_seed: int, name: str) -> int:
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63 - 1)


@torch.no_grad()
def initialise(model: nn.Module, cfg: ModelConfig, full_shapes: Dict[str, torch.Size],
               slices: Dict[str, Tuple[int, torch.Tensor]], base_seed: int) -> None:
    """N(0, init_std) for matrices, init_std/sqrt(2 L) for residual output projections (GPT-2 /
    nanoGPT / Megatron), zeros for biases, ones for norm weights.

    Each tensor draws from its own generator seeded by (base_seed, parameter name), and a sliced
    tensor is cut from its full-size draw, so a subnetwork starts exactly at the full model's
    values restricted to what it holds (SDP holders must start identical). Only one full-size
    tensor exists transiently at a time; unheld blocks are never drawn.
    """
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        if name.endswith(".bias"):
            param.zero_()
            continue
        if "norm" in name:
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(RESIDUAL_OUTPUT_SUFFIXES) else cfg.init_std
        generator = torch.Generator(device=param.device)
        generator.manual_seed(_parameter_seed(base_seed, name))
        if name in slices:
            dim, indices = slices[name]
            full = torch.empty(full_shapes[name], device=param.device, dtype=param.dtype)
            full.normal_(0.0, std, generator=generator)
            param.copy_(full.index_select(dim, indices.to(param.device)))
        else:
            param.normal_(0.0, std, generator=generator)


# ---------------------------------------------------------------------------------------------
# The trunk


class CausalLM(nn.Module):
    """Embeddings -> held blocks -> final norm -> LM head, with the training loss.

    ``blocks`` is a ModuleDict keyed by the layer index, so parameter names are
    ``blocks.<layer>.…`` as in the full model even when a subnetwork holds only some blocks
    (an unheld block is simply absent: the identity on the residual stream).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        self.blocks = nn.ModuleDict()

    # Families provide these.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block_context(self, length: int, device: torch.device) -> tuple:
        return ()

    def head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""
        self.activation_checkpointing = bool(enabled)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, T, V] without targets; with targets (already shifted, -1 = ignore), the
        mean next-token cross-entropy over all positions, computed in fp32."""
        _, length = idx.shape
        if length > self.cfg.seq_len:
            raise ValueError(f"sequence length {length} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        context = self.block_context(length, idx.device)
        checkpointing = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks.values():
            if checkpointing:
                x = checkpoint(block, x, *context, use_reentrant=False)
            else:
                x = block(x, *context)
        x = self.final_norm(x)
        if targets is None:
            return F.linear(x, self.head_weight())
        return linear_cross_entropy(x.reshape(-1, x.shape[-1]), self.head_weight(), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# LM head + loss


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


_LOG2_E = 1.4426950408889634  # log2(e)


def _chunk_rows(vocab_size: int, device: torch.device) -> int:
    # About 16 MB of fp32 logits per chunk on CPU (512 rows of a 8192 vocabulary: smaller
    # chunks re-read the head weight more often and run the matmuls slower, measured with
    # scripts/bench_model.py), 256 MB on an accelerator (big enough for full-speed matmuls,
    # small next to [N, V]).
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
    matmul runs ~17% faster than the [rows, V] one (MKL, cold caches) and needs no transposed
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
            # scale, and exp2 is ~40% cheaper than exp here (both 1-ulp SLEEF kernels on CPU).
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
