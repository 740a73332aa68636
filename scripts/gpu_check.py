"""The parts of scripts/gpu_check.sh, one function each; the script runs every part in its own process.

    python -m scripts.gpu_check parts                        # "name timeout_s" per line, in order
    python -m scripts.gpu_check run PART --out FILE [--dry]  # one part's checks as JSON; exit 1 on a miss
    python -m scripts.gpu_check report --out FILE --parts-dir DIR [--dry] [--wall-s S]
                                                             # the combined JSON; exit 1 on any miss

Every check compares against something that can fail: attention and the fused loss against float64
references on fixed inputs (with a control that a wrong kernel is caught), the SCAPE kernels on
NaN/Inf inputs (CUDA's NaN bit patterns), the SCAPE and sparse-averaging steps under
``torch.cuda.set_sync_debug_mode("error")``, the offloaded residual against the on-device one, and
llama500m / llama1_8b steps against MFU floors and the memory pre-flight's estimate
(trainer/memory.py). ``--dry`` runs every part on the CPU at tiny sizes (the GPU-only limits are
recorded as skipped), so the tests run them all and a typo cannot waste a GPU session.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

REPO = Path(__file__).resolve().parents[1]
# MFU floors for llama500m steps (dense bf16 peak) on the GPUs the users run: H100, GH200 (and H200,
# the same tensor cores); other GPUs record their MFU without a floor.
MFU_FLOOR = {"eager": 0.25, "compiled": 0.38}
MFU_FLOOR_GPUS = ("H100", "GH200", "H200")
MEMORY_TOLERANCE = 0.25  # |measured peak - pre-flight estimate| / measured peak
TIME_BUDGET_S = 600.0  # the whole check on one H100
# bf16 attention and loss against float64: relative Frobenius error of outputs and gradients
BF16_TOLERANCE, FP32_TOLERANCE = 2e-2, 1e-4
# the tiny model every part uses in --dry mode (and the two sync-audit / offload runs on the GPU)
DRY_MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=128",
             "model.seq_len=64", "model.vocab_size=512", "train.micro_batch_size=2"]


@dataclass
class Context:
    dry: bool
    device: torch.device

    def size(self, gpu, dry):
        return dry if self.dry else gpu


@dataclass
class Checks:
    """One part's checks: each has a name, ``ok`` and what was measured against what limit."""

    items: List[Dict[str, Any]] = field(default_factory=list)

    def expect(self, name: str, ok: bool, **measured: Any) -> bool:
        self.items.append({"name": name, "ok": bool(ok), **{k: _plain(v) for k, v in measured.items()}})
        return bool(ok)

    def skip(self, name: str, why: str) -> None:
        self.items.append({"name": name, "ok": True, "skipped": why})

    @property
    def ok(self) -> bool:
        return all(item["ok"] for item in self.items)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / Infinity
    return value


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (inf when ``got`` is not finite)."""
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------------
# attention and the loss against float64


def _values_and_grads(fn: Callable, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Softmax attention written out ([B, T, H, hd], grouped kv heads repeated), for float64 inputs."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[1]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.einsum("bhts,bshd->bthd", scores.softmax(dim=-1), v)


def _attention_variants(ctx: Context) -> Iterator[Tuple[str, str, str, torch.dtype]]:
    from models.ops import flash_attn_installed

    yield "sdpa fp32", "sdpa", "stock", torch.float32
    yield "sdpa bf16", "sdpa", "stock", torch.bfloat16
    if ctx.device.type == "cuda" and flash_attn_installed():
        yield "flash bf16", "flash", "stock", torch.bfloat16
    if ctx.device.type == "cpu":
        yield "cpu kernels' blocked attention fp32", "auto", "cpu", torch.float32


def part_attention(ctx: Context, checks: Checks) -> None:
    from models.ops import causal_attention, flash_attn_installed

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batch, length, heads, hd = ctx.size((2, 1024, 16, 64), (2, 48, 4, 16))
    gen = torch.Generator().manual_seed(0)
    if ctx.device.type == "cuda" and not flash_attn_installed():
        checks.skip("flash bf16", "flash-attn is not installed")
    for kv_heads in (heads, heads // 4):
        q = torch.randn(batch, length, heads, hd, generator=gen).to(ctx.device)
        k, v = (torch.randn(batch, length, kv_heads, hd, generator=gen).to(ctx.device) for _ in range(2))
        grad_out = torch.randn(batch, length, heads, hd, generator=gen).to(ctx.device)
        for label, backend, kernels, dtype in _attention_variants(ctx):
            inputs = [t.to(dtype) for t in (q, k, v)]  # the reference sees the same rounded inputs
            want, want_grads = _values_and_grads(attention_reference, [t.double() for t in inputs], grad_out)
            got, got_grads = _values_and_grads(lambda *t: causal_attention(*t, backend, kernels), inputs, grad_out)
            limit = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE
            errors = [relative_error(got, want)] + [relative_error(g, w) for g, w in zip(got_grads, want_grads)]
            checks.expect(f"{label}, {heads}/{kv_heads} heads: output, dq, dk, dv vs float64", max(errors) <= limit,
                          errors=errors, limit=limit)
        # the comparison catches a wrong kernel: attention without the causal mask is far off
        wrong = attention_reference(*(t.double() for t in (q, k, v)), causal=False)
        control = relative_error(wrong, attention_reference(q.double(), k.double(), v.double()))
        checks.expect(f"control, {heads}/{kv_heads} heads: non-causal attention is caught", control > 10 * BF16_TOLERANCE,
                      error=control)


def _loss_inputs(ctx: Context):
    rows, width, vocab = ctx.size((8192, 1024, 32000), (1100, 32, 8192))  # several of the loss's chunks
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) * (2.0 / math.sqrt(width))
    hidden, weight = hidden.to(ctx.device), weight.to(ctx.device)
    # half the targets the logits' argmax, so that a wrong pairing of rows and targets shows
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(ctx.device)
    chosen = (torch.rand(rows, generator=gen) < 0.5).to(ctx.device)
    targets = torch.where(chosen, (hidden @ weight.t()).argmax(dim=1), targets)
    targets[(torch.rand(rows, generator=gen) < 0.1).to(ctx.device)] = -1
    return hidden, weight, targets


def _float64_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(hidden.double() @ weight.double().t(), targets, ignore_index=-1)


def part_loss(ctx: Context, checks: Checks) -> None:
    from models.loss import LOSSES

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    hidden, weight, targets = _loss_inputs(ctx)
    scale = 0.25  # as (loss / accum).backward() with 4 micro-batches: the non-unit gradient path
    want, (want_h, want_w) = _values_and_grads(lambda h, w: _float64_loss(h, w, targets) * scale,
                                               [hidden.double(), weight.double()], torch.ones((), device=ctx.device))
    for name, loss in sorted(LOSSES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            def scaled(h, w):
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    return loss(h, w, targets) * scale
            got, (got_h, got_w) = _values_and_grads(scaled, [hidden, weight], torch.ones((), device=ctx.device))
            limit = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE
            errors = [relative_error(got, want), relative_error(got_h, want_h), relative_error(got_w, want_w)]
            checks.expect(f"{name} loss {str(dtype)[6:]}: loss, d hidden, d weight vs float64", max(errors) <= limit,
                          errors=errors, limit=limit, loss=float(got) / scale)
    shifted = _float64_loss(hidden, weight, targets.roll(1)) * scale  # a target off by one position
    control = abs(float(shifted - want)) / abs(float(want))
    checks.expect("control: a target shifted by one is caught", control > 10 * BF16_TOLERANCE, error=control)


# ------------------------------------------------------------------------------------------------
# NaN and Inf through every SCAPE kernel

# CUDA's canonical NaN, its negative, the CPU's quiet NaN and its negative (as int32 bit patterns)
NAN_BITS = (0x7FFFFFFF, -1, 0x7FC00000, -0x400000)


def _with_specials(n: int, device: torch.device, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A float32 vector with NaNs (every bit pattern of NAN_BITS), +Inf and -Inf at spread positions."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01
    positions = torch.linspace(3, n - 5, len(NAN_BITS) + 2).long()
    bits = values.view(torch.int32)
    for position, pattern in zip(positions[:len(NAN_BITS)], NAN_BITS):
        bits[position] = pattern
    values[positions[-2]], values[positions[-1]] = math.inf, -math.inf
    return values.to(device), positions.to(device)


def _same_specials(checks: Checks, name: str, got: torch.Tensor, want: torch.Tensor,
                   must_be_nonfinite: torch.Tensor) -> None:
    got, want = got.float(), want.float()
    nonfinite_kept = bool((~torch.isfinite(got[must_be_nonfinite])).all())
    same_pattern = torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want) & torch.isfinite(got)
    close = torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-7)
    checks.expect(f"{name}: NaN/Inf stay non-finite, as the reference's, the rest equal",
                  nonfinite_kept and same_pattern and close, nonfinite_kept=nonfinite_kept,
                  same_nan_inf_positions=same_pattern, finite_values_close=close)


def _probe_gather_scatter(ctx: Context, checks: Checks, backends) -> None:
    n = ctx.size(1_000_003, 4099)
    source, specials = _with_specials(n, ctx.device, 2)
    indices = torch.unique(torch.cat([specials, torch.arange(0, n, 7, device=ctx.device)]))
    where = torch.isin(indices, specials)
    for dtype in (torch.float32, torch.bfloat16):
        outs = [m.gather_and_clear(source.clone(), indices, torch.empty(indices.numel(), dtype=dtype,
                                                                         device=ctx.device)) for m in backends]
        _same_specials(checks, f"gather_and_clear to {str(dtype)[6:]}", outs[0], outs[1], where)
    values = source[indices]
    outs = [m.scatter(torch.zeros(n, device=ctx.device), indices, values) for m in backends]
    _same_specials(checks, "scatter", outs[0], outs[1], specials)


def _probe_updates(ctx: Context, checks: Checks, backends) -> None:
    n = ctx.size(1_000_003, 4099)
    grad, specials = _with_specials(n, ctx.device, 3)
    gen = torch.Generator().manual_seed(4)
    param, momentum = (torch.randn(n, generator=gen).to(ctx.device) for _ in range(2))
    indices = torch.unique(torch.cat([specials, torch.arange(0, n, 5, device=ctx.device)]))
    where = torch.isin(indices, specials)
    scale = torch.rand(indices.numel(), generator=gen).to(ctx.device) * 4
    scale[~where & (torch.arange(indices.numel(), device=ctx.device) % 97 == 0)] = math.nan  # a NaN scale too
    for with_scale in (None, scale):
        results = []
        for module in backends:
            p, m = param.clone(), momentum.clone()
            module.adams_masked_update(p, m, indices, grad[indices], 1e-3, 0.9, 0.95, 1e-8, 0.19, with_scale)
            results.append((p, m))
        label = "adams_masked_update" + (" with NaN scales" if with_scale is not None else "")
        _same_specials(checks, f"{label}: param", results[0][0], results[1][0], specials)
        _same_specials(checks, f"{label}: momentum", results[0][1], results[1][1], specials)
    results = []
    for module in backends:
        p, m = param.clone(), momentum.clone()
        module.adams_dense_update(p, m, grad, 1e-3, 0.9, 0.95, 1e-8, 0.19, 0.1, n // 2)
        results.append((p, m))
    _same_specials(checks, "adams_dense_update: param", results[0][0], results[1][0], specials)
    _same_specials(checks, "adams_dense_update: momentum", results[0][1], results[1][1], specials)


def _probe_quantizer(ctx: Context, checks: Checks, backends) -> None:
    from scape.quantize import BLOCK, STEP_PER_RMS

    values, specials = _with_specials(ctx.size(1_000_003, 4099), ctx.device, 5)
    blocks = torch.unique(specials // BLOCK)
    for bits, scale_dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (4, torch.float32)):
        outs = [m.quantize_blocks(values, bits, STEP_PER_RMS[bits], BLOCK, scale_dtype) for m in backends]
        label = f"quantize {bits}-bit, {str(scale_dtype)[6:]} scales"
        _same_specials(checks, f"{label}: scales", outs[0][1], outs[1][1], blocks)
        read_back = outs[0][2].view(-1)
        nonfinite_blocks = torch.stack([(~torch.isfinite(read_back[b * BLOCK:(b + 1) * BLOCK])).any() for b in blocks])
        checks.expect(f"{label}: every block holding a NaN/Inf reads back non-finite", bool(nonfinite_blocks.all()))


def part_nan_probe(ctx: Context, checks: Checks) -> None:
    from scape.kernels import reference

    if ctx.device.type == "cuda":
        from scape.kernels import triton_kernels as tested
    else:
        tested = reference
        checks.skip("Triton kernels", "no CUDA: the PyTorch references only")
    backends = (tested, reference)
    _probe_gather_scatter(ctx, checks, backends)
    _probe_updates(ctx, checks, backends)
    _probe_quantizer(ctx, checks, backends)


# ------------------------------------------------------------------------------------------------
# trainer steps: the sync audit, offload, llama500m and llama1_8b


def compose(overrides: Sequence[str]):
    """The run's typed config as train.py composes it (conf/config.yaml with ``overrides``)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


class StepRunner:
    """The trainer's synchroniser and step (trainer/parts.py, trainer/step.py) on random tokens."""

    def __init__(self, ctx: Context, overrides: Sequence[str], accum: int = 1) -> None:
        from core.comm import Collectives
        from trainer.parts import build_synchronizer

        self.ctx = ctx
        self.cfg = compose([*overrides, *(DRY_MODEL if ctx.dry else [])])
        t, model = self.cfg.train, self.cfg.model
        self.comm = Collectives()
        self.sync = build_synchronizer(self.cfg, ctx.device, self.comm)
        if t.activation_checkpointing:
            self.sync.model.set_activation_checkpointing(True)
        if t.compiles(ctx.device.type):  # as the Trainer does; on the CPU (--dry) without a C++ compiler
            self.sync.model.compile_blocks(**({"backend": "aot_eager"} if ctx.device.type == "cpu" else {}))
        # micro-batches a step: not the run's (its global batch), but enough for what is measured
        self.accum = 2 if ctx.dry else accum
        gen = torch.Generator().manual_seed(self.cfg.seed)
        self._tokens = lambda: torch.randint(0, model.vocab_size, (t.micro_batch_size, model.seq_len + 1),
                                             generator=gen)
        self.tokens_per_step = self.accum * t.micro_batch_size * model.seq_len

    def batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        while True:
            tokens = self._tokens()
            yield tokens[:, :-1], tokens[:, 1:]

    def step(self, batches):
        from trainer.step import train_step

        bf16 = self.ctx.device.type == "cuda"
        autocast = lambda: torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
        return train_step(self.sync.train_module, self.sync, batches, self.accum, self.cfg.optimizer.lr,
                          self.cfg.optimizer.grad_clip, self.comm, 1, autocast, device=self.ctx.device)


def _sparse_from_step_two() -> List[str]:
    return ["optimizer.dense_warmup_steps=1", "optimizer.sparsity_warmup_steps=0", "train.compile=false"]


def _on(flag: bool) -> str:
    return "true" if flag else "false"


def _repo_frame(exc: BaseException) -> str:
    """The deepest frame of this repository in a traceback: where the host waited."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(REPO) in f.filename
              and "gpu_check" not in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno} {frame.name}: {frame.line}"


def _audited_step(runner: StepRunner, batches) -> Tuple[Any, Optional[str]]:
    """One step under set_sync_debug_mode("error"): (its result, None) or (None, where it waited)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return runner.step(batches), None
    except RuntimeError as exc:
        return None, _repo_frame(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def part_sync_audit(ctx: Context, checks: Checks) -> None:
    for experiment in ("tiny_scape99", "tiny_sma99"):
        runner = StepRunner(ctx, [f"+experiment={experiment}", *_sparse_from_step_two()], accum=2)
        batches = runner.batches()
        for _ in range(3):  # the dense first step, then sparse ones with a lagged mask
            runner.step(batches).read()
        label = f"{experiment}: step 4"
        if ctx.device.type == "cuda":
            result, where = _audited_step(runner, batches)
            checks.expect(f"{label} waits for the GPU nowhere (set_sync_debug_mode('error'))", where is None,
                          first_host_wait=where)
        else:
            result = runner.step(batches)
            checks.skip(f"{label} under set_sync_debug_mode('error')", "no CUDA: nothing to audit")
        if result is not None:
            metrics = runner.sync.metrics()
            checks.expect(f"{label} is a sparse step with a finite loss",
                          metrics.get("scape/dense_step") == 0.0 and math.isfinite(result.loss),
                          loss=result.loss, density=metrics.get("scape/density"))


def part_offload(ctx: Context, checks: Checks) -> None:
    runs = {}
    for offload in (False, True):
        runner = StepRunner(ctx, ["+experiment=tiny_scape99", *_sparse_from_step_two(),
                                  f"optimizer.offload_residual={_on(offload)}"], accum=2)
        batches = runner.batches()
        losses = [runner.step(batches).loss for _ in range(5)]
        runs[offload] = (losses, torch.cat([p.detach().reshape(-1) for p in runner.sync.params]).cpu())
        del runner
    (on_device, params_device), (offloaded, params_host) = runs[False], runs[True]
    checks.expect("SCAPE-99, 5 steps: losses with the residual offloaded equal the on-device ones",
                  offloaded == on_device, on_device=on_device, offloaded=offloaded)
    diff = float((params_host - params_device).abs().max())
    checks.expect("SCAPE-99, 5 steps: parameters bit for bit", torch.equal(params_host, params_device),
                  max_abs_diff=diff)


def _measure(runner: StepRunner, warmup: int, measured: int) -> Tuple[List[float], float]:
    """Losses and the median step time (each step read at once: its wall time is honest)."""
    batches, losses, times = runner.batches(), [], []
    for i in range(warmup + measured):
        start = time.perf_counter()
        losses.append(runner.step(batches).loss)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return losses, sorted(times)[len(times) // 2]


def _check_memory(ctx: Context, checks: Checks, runner: StepRunner, label: str) -> None:
    """The measured peak against the pre-flight's estimate (trainer/memory.py), within 25%."""
    try:
        from trainer.memory import estimate_memory
    except ImportError as exc:
        checks.expect(f"{label}: peak memory vs the pre-flight estimate", False,
                      error=f"trainer/memory.py's estimate_memory is missing ({exc})")
        return
    estimate = estimate_memory(runner.cfg, 1, ctx.device.type).device_peak
    if ctx.device.type != "cuda":
        checks.skip(f"{label}: peak memory vs the pre-flight estimate ({estimate / 2**30:.2f} GiB)",
                    "no CUDA: no allocator peak to compare")
        return
    peak = torch.cuda.max_memory_allocated(ctx.device)
    error = abs(peak - estimate) / peak
    checks.expect(f"{label}: peak memory within {MEMORY_TOLERANCE:.0%} of the pre-flight estimate",
                  error <= MEMORY_TOLERANCE, peak_gib=peak / 2**30, estimate_gib=estimate / 2**30,
                  relative_error=error)


def _check_mfu(ctx: Context, checks: Checks, label: str, mfu: Optional[float], floor: float) -> None:
    if ctx.device.type != "cuda" or mfu is None:
        checks.skip(f"{label}: MFU >= {floor:.0%}", "no CUDA" if ctx.device.type != "cuda" else "unknown GPU peak")
        return
    name = torch.cuda.get_device_name(ctx.device)
    if not any(gpu in name for gpu in MFU_FLOOR_GPUS):
        checks.skip(f"{label}: MFU >= {floor:.0%} (MFU {mfu:.1%})", f"no floor for {name}")
        return
    checks.expect(f"{label}: MFU >= {floor:.0%}", mfu >= floor, mfu=mfu, floor=floor)


def _llama500m(ctx: Context, checks: Checks, mode: str) -> None:
    from models import flops_per_token
    from trainer.metrics import peak_flops

    runner = StepRunner(ctx, ["+experiment=llama500m_adamw", f"train.compile={_on(mode == 'compiled')}"])
    warmup = 3 if mode == "compiled" else 2
    losses, step_s = _measure(runner, warmup, ctx.size(6, 2))
    label = f"llama500m AdamW {mode}, {runner.tokens_per_step} tokens a step"
    checks.expect(f"{label}: finite losses", all(math.isfinite(x) for x in losses), losses=losses)
    tflops = flops_per_token(runner.cfg.model) * runner.tokens_per_step / step_s / 1e12
    peak = peak_flops(ctx.device)
    mfu = tflops * 1e12 / peak if peak else None
    checks.items.append({"name": f"{label}: speed", "ok": True, "step_s": step_s, "tflops": tflops, "mfu": mfu})
    _check_mfu(ctx, checks, label, mfu, MFU_FLOOR[mode])
    _check_memory(ctx, checks, runner, label)


def part_llama500m_eager(ctx: Context, checks: Checks) -> None:
    _llama500m(ctx, checks, "eager")


def part_llama500m_compiled(ctx: Context, checks: Checks) -> None:
    _llama500m(ctx, checks, "compiled")


def _two_steps(ctx: Context, checks: Checks, experiment: str, compiled: bool) -> None:
    runner = StepRunner(ctx, [f"+experiment={experiment}", f"train.compile={_on(compiled)}"])
    label = f"{experiment}{' compiled' if compiled else ''}, activation checkpointing " \
            f"{'on' if runner.cfg.train.activation_checkpointing else 'off'}"
    losses, step_s = _measure(runner, 1, 1)
    checks.expect(f"{label}: two steps with finite losses", all(math.isfinite(x) for x in losses),
                  losses=losses, second_step_s=step_s)
    _check_memory(ctx, checks, runner, label)


def part_llama1_8b_adamw(ctx: Context, checks: Checks) -> None:
    _two_steps(ctx, checks, "llama1_8b_adamw", compiled=True)


def part_llama1_8b_scape99(ctx: Context, checks: Checks) -> None:
    _two_steps(ctx, checks, "llama1_8b_scape99", compiled=False)


# name -> (function, timeout in seconds on the GPU)
PARTS: Dict[str, Tuple[Callable[[Context, Checks], None], int]] = {
    "attention": (part_attention, 90),
    "loss": (part_loss, 90),
    "nan_probe": (part_nan_probe, 120),
    "sync_audit": (part_sync_audit, 180),
    "offload": (part_offload, 180),
    "llama500m_eager": (part_llama500m_eager, 180),
    "llama500m_compiled": (part_llama500m_compiled, 300),
    "llama1_8b_adamw": (part_llama1_8b_adamw, 240),
    "llama1_8b_scape99": (part_llama1_8b_scape99, 180),
}


# ------------------------------------------------------------------------------------------------
# the command line


def run_part(name: str, dry: bool) -> Dict[str, Any]:
    """One part's result: its checks, ``ok``, its wall time, and the error if it raised."""
    ctx = Context(dry=dry, device=torch.device("cpu") if dry else torch.device("cuda", 0))
    checks, start, error = Checks(), time.perf_counter(), None
    try:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        PARTS[name][0](ctx, checks)
    except Exception as exc:  # a crash is a miss, reported with where it happened
        error = "".join(traceback.format_exception(exc)[-6:])
    result = {"part": name, "ok": checks.ok and error is None and bool(checks.items), "checks": checks.items,
              "wall_s": time.perf_counter() - start}
    if error is not None:
        result["error"] = error
    return result


def _environment(dry: bool) -> Dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    env = {"dry": dry, "torch": torch.__version__, "python": platform.python_version(), "commit": commit or None,
           "host": platform.node()}
    if not dry and torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def report(parts_dir: Path, dry: bool, wall_s: Optional[float]) -> Dict[str, Any]:
    """The combined result of every part (a part without a result file crashed or timed out)."""
    parts = {}
    for name in PARTS:
        path = parts_dir / f"{name}.json"
        if path.is_file():
            parts[name] = json.loads(path.read_text())
        else:
            rc = (parts_dir / f"{name}.rc").read_text().strip() if (parts_dir / f"{name}.rc").is_file() else None
            parts[name] = {"part": name, "ok": False, "checks": [],
                           "error": f"no result (exit status {rc}: crashed, killed or timed out)"}
    result = {**_environment(dry), "command": "bash scripts/gpu_check.sh" + (" --dry" if dry else ""),
              "wall_s": wall_s, "parts": parts}
    budget_ok = dry or wall_s is None or wall_s <= TIME_BUDGET_S
    result["within_time_budget"] = budget_ok
    result["ok"] = all(p["ok"] for p in parts.values()) and budget_ok
    return result


def _print_summary(result: Dict[str, Any]) -> None:
    for name, part in result["parts"].items():
        misses = [c["name"] for c in part["checks"] if not c["ok"]]
        status = "ok" if part["ok"] else "FAILED"
        print(f"gpu_check: {name:<20} {status}" + (f" ({'; '.join(misses)})" if misses else "")
              + (f" [{part['error'].strip().splitlines()[-1]}]" if part.get("error") else ""))
    if not result["within_time_budget"]:
        print(f"gpu_check: took {result['wall_s']:.0f} s, over the {TIME_BUDGET_S:.0f} s budget")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("parts", help="the parts and their timeouts, in order")
    run = commands.add_parser("run", help="run one part")
    run.add_argument("part", choices=sorted(PARTS))
    run.add_argument("--out", required=True)
    run.add_argument("--dry", action="store_true", help="on the CPU at tiny sizes")
    combine = commands.add_parser("report", help="combine the parts' results")
    combine.add_argument("--out", required=True)
    combine.add_argument("--parts-dir", required=True)
    combine.add_argument("--dry", action="store_true")
    combine.add_argument("--wall-s", type=float, default=None)
    args = parser.parse_args(argv)
    if args.command == "parts":
        print("\n".join(f"{name} {timeout}" for name, (_, timeout) in PARTS.items()))
        return 0
    result = run_part(args.part, args.dry) if args.command == "run" else \
        report(Path(args.parts_dir), args.dry, args.wall_s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    if args.command == "report":
        _print_summary(result)
    else:
        for check in result["checks"]:
            print(f"  {'ok  ' if check['ok'] else 'MISS'} {check['name']}"
                  + (f" (skipped: {check['skipped']})" if "skipped" in check else ""), flush=True)
        if result.get("error"):
            print(result["error"], file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
