#!/usr/bin/env bash
# One prepared check for a machine with one GPU, under 10 minutes; exits non-zero on any mismatch.
#
#   bash scripts/gpu_check.sh             # from the repository root, in the project's venv
#   GPU_CHECK_STEPS=4 bash scripts/gpu_check.sh
#
#   1. bf16 training steps (the trainer's own step, fused AdamW) of tiny_llama and llama500m,
#      torch.compile off and on, SDPA and flash-attn (where installed): the first loss of every
#      variant must agree with eager SDPA's, every loss must be finite; step time, tokens/s and
#      MFU (against the dense bf16 peak) are printed.
#   2. The Triton SCAPE kernels against their PyTorch references on CUDA tensors, and AdamS with
#      the fused kernel against the reference AdamS.
#   3. One-rank runs of train.py on the GPU (the embedded corpus), SCAPE-99 and sparse averaging's
#      default (2-bit codec, cyclic mask): each must complete with a finite validation loss.
# Without CUDA it refuses at once (exit 2) with the torch build it found and the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-$PWD} TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-disabled}
STEPS=${GPU_CHECK_STEPS:-6}

python - <<'PY' || exit 2
import sys
import torch
from core.distributed import cuda_unavailable_message
if not torch.cuda.is_available():
    print("gpu_check: " + cuda_unavailable_message().replace("train.device=cuda but ", ""), file=sys.stderr)
    sys.exit(2)
from core.distributed import DistEnv, runtime_summary
print("gpu_check: " + runtime_summary(DistEnv(0, 1, 0, torch.device("cuda", 0)), "cuda"))
PY

failures=0
section() { echo; echo "=== gpu_check: $* ==="; }

section "1. bf16 steps: tiny_llama and llama500m, compile off/on, SDPA / flash-attn"
GPU_CHECK_STEPS=$STEPS python - <<'PY' || failures=$((failures + 1))
import dataclasses, importlib.util, itertools, math, os, sys, time
import torch
from core.optim import DenseOptimizerConfig, build_optimizer
from core.sync import DenseAllReduce
from models import build_model, flops_per_token, load_model_config
from trainer.metrics import peak_flops
from trainer.step import train_step

torch.backends.cuda.matmul.allow_tf32 = True
device, steps = torch.device("cuda", 0), int(os.environ["GPU_CHECK_STEPS"])
attentions = ["sdpa"] + (["flash"] if importlib.util.find_spec("flash_attn") else [])
if len(attentions) == 1:
    print("flash-attn is not installed: SDPA only")
peak, bad = peak_flops(device), []
for name, micro in (("tiny_llama", 8), ("llama500m", 4)):
    base = load_model_config(name)
    reference = None
    for attention, compile_ in itertools.product(attentions, (False, True)):
        cfg = dataclasses.replace(base, attention=attention)
        torch.manual_seed(0)
        model = build_model(cfg, device=device)
        sync = DenseAllReduce(model, lambda ps: build_optimizer(ps, DenseOptimizerConfig(lr=3e-4)))
        module = torch.compile(sync.train_module) if compile_ else sync.train_module
        gen = torch.Generator(device=device).manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (steps, micro, cfg.seq_len + 1), device=device, generator=gen)
        batches = iter([(t[:, :-1], t[:, 1:]) for t in tokens])
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
        losses, times = [], []
        for _ in range(steps):
            wall = time.perf_counter()
            result = train_step(module, sync, batches, 1, 3e-4, 1.0, sync.comm, 1, autocast, device=device)
            losses.append(result.loss)  # reads the step: one step's wall time is honest here
            times.append(time.perf_counter() - wall)
        step_s = sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else times[0]
        tokens_per_s = micro * cfg.seq_len / step_s
        tflops = flops_per_token(cfg) * tokens_per_s / 1e12
        mfu = f"{tflops * 1e12 / peak:.1%}" if peak else "n/a (unknown GPU peak)"
        label = f"{name} {attention} compile={'on' if compile_ else 'off'}"
        print(f"{label}: losses {[round(x, 4) for x in losses]}, step {step_s * 1e3:.1f} ms (median after the "
              f"first), {tokens_per_s:,.0f} tok/s, {tflops:.1f} TFLOP/s, MFU {mfu}, "
              f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        if not all(math.isfinite(x) for x in losses):
            bad.append(f"{label}: non-finite loss")
        if reference is None:
            reference = losses[0]
        elif abs(losses[0] - reference) > 2e-2 * max(1.0, abs(reference)):  # bf16: same weights, same tokens
            bad.append(f"{label}: first loss {losses[0]:.4f} vs eager SDPA {reference:.4f}")
        del model, sync, module
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
for line in bad:
    print("MISMATCH " + line, file=sys.stderr)
sys.exit(1 if bad else 0)
PY

section "2. Triton SCAPE kernels and fused AdamS against the references, on CUDA"
python - <<'PY' || failures=$((failures + 1))
import sys
import torch
from core.optim import AdamS
from scape import kernels
from scape.kernels import reference
from scape.kernels import triton_kernels as tk

dev, gen, bad = torch.device("cuda", 0), torch.Generator(device="cuda").manual_seed(0), []
n = 1_000_003  # not a multiple of any block: the tails are exercised


def check(name, got, want, exact=False):
    ok = torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    diff = 0.0 if exact or got.dtype == torch.bool else (got.float() - want.float()).abs().max().item()
    print(f"{name}: {'ok' if ok else 'MISMATCH'}" + ("" if exact else f" (max |diff| {diff:.2e})"))
    if not ok:
        bad.append(name)


mask = torch.rand(8 * (n // 8), device=dev, generator=gen) < 0.1
packed = [m.pack_bits(mask, torch.empty(mask.numel() // 8, dtype=torch.uint8, device=dev)) for m in (tk, reference)]
check("pack_bits", packed[0], packed[1], exact=True)
unpacked = [m.unpack_bits(packed[1], torch.empty(mask.numel(), dtype=torch.bool, device=dev)) for m in (tk, reference)]
check("unpack_bits", unpacked[0], unpacked[1], exact=True)
indices = torch.nonzero(mask).reshape(-1)
source = torch.randn(mask.numel(), device=dev, generator=gen)
for dtype in (torch.float32, torch.bfloat16):
    outs = []
    for m in (tk, reference):
        s = source.clone()
        outs.append((m.gather_and_clear(s, indices, torch.empty(indices.numel(), dtype=dtype, device=dev)), s))
    check(f"gather_and_clear {dtype}: values", outs[0][0], outs[1][0], exact=True)
    check(f"gather_and_clear {dtype}: remainder", outs[0][1], outs[1][1], exact=True)
values = torch.randn(indices.numel(), device=dev, generator=gen)
check("scatter", tk.scatter(torch.zeros_like(source), indices, values),
      reference.scatter(torch.zeros_like(source), indices, values), exact=True)
p0, m0 = torch.randn(mask.numel(), device=dev, generator=gen), 0.01 * torch.randn(mask.numel(), device=dev, generator=gen)
g = 0.01 * torch.randn(indices.numel(), device=dev, generator=gen)
scale = torch.rand(indices.numel(), device=dev, generator=gen) * 4
for with_scale in (None, scale):
    got, want = (p0.clone(), m0.clone()), (p0.clone(), m0.clone())
    tk.adams_masked_update(*got, indices, g, 1e-3, 0.9, 0.95, 1e-8, 0.19, with_scale)
    reference.adams_masked_update(*want, indices, g, 1e-3, 0.9, 0.95, 1e-8, 0.19, with_scale)
    check(f"adams_masked_update scale={'yes' if with_scale is not None else 'no'}: param", got[0], want[0])
    check(f"adams_masked_update scale={'yes' if with_scale is not None else 'no'}: momentum", got[1], want[1])
gd = 0.01 * torch.randn(mask.numel(), device=dev, generator=gen)
got, want = (p0.clone(), m0.clone()), (p0.clone(), m0.clone())
tk.adams_dense_update(*got, gd, 1e-3, 0.9, 0.95, 1e-8, 0.19, 0.1, n // 2)
reference.adams_dense_update(*want, gd, 1e-3, 0.9, 0.95, 1e-8, 0.19, 0.1, n // 2)
check("adams_dense_update: param", got[0], want[0])
check("adams_dense_update: momentum", got[1], want[1])
# AdamS as the dense arm runs it on CUDA (the fused kernel per tensor) against the reference loop
torch.manual_seed(0)
shapes = [(512, 384), (384,), (1000, 7)]
fused_params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
ref_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
groups = lambda ps: [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]
fused, ref = AdamS(groups(fused_params), lr=1e-3, kernel=kernels.adams_dense_update), AdamS(groups(ref_params), lr=1e-3)
for step in range(3):
    for a, b in zip(fused_params, ref_params):
        a.grad = torch.randn(a.shape, device=dev, generator=gen) * 0.01
        b.grad = a.grad.clone()
    fused.step()
    ref.step()
for i, (a, b) in enumerate(zip(fused_params, ref_params)):
    check(f"AdamS fused kernel vs reference, tensor {i}", a.detach(), b.detach())
# sparse averaging's 2-bit codec (on CUDA the fused Triton kernel, on the CPU the PyTorch
# reference): the sender's read-back is what a receiver decodes, bit for bit; against the CPU the
# block scales may differ in rounding (another summation order), so nearly all, not all, scales
# and code bytes must agree
from scape.quantize import dequantize, quantize
drift = 1e-3 * torch.randn(n, device=dev, generator=gen)
for bits, midtread in ((1, False), (2, False), (4, False), (2, True)):
    name = f"quantize {bits}-bit{' mid-tread' if midtread else ''}"
    codes, scales, read_back = quantize(drift, bits, torch.bfloat16, midtread)
    check(f"{name}: read-back = dequantize", read_back, dequantize(codes, scales, bits, n, midtread), exact=True)
    cpu_codes, cpu_scales, _ = quantize(drift.cpu(), bits, torch.bfloat16, midtread)
    same = min((codes.cpu() == cpu_codes).float().mean().item(), (scales.cpu() == cpu_scales).float().mean().item())
    print(f"{name}: {same:.4%} of code bytes and scales as on the CPU: {'ok' if same > 0.999 else 'MISMATCH'}")
    if same <= 0.999:
        bad.append(f"{name} against the CPU")
sys.exit(1 if bad else 0)
PY

section "3. one-rank runs of train.py on the GPU: SCAPE-99 and sparse averaging (the 99% default)"
for experiment in tiny_scape99 tiny_sma99; do
    out=$(mktemp -d)
    if python train.py +experiment=$experiment train.device=cuda train.precision=bf16 logger=console \
            data.embedded_docstrings=false train.steps=30 train.log_every=10 train.eval_every=0 train.ckpt_every=0 \
            "out_dir=$out" run_name=gpu_check; then
        python - "$out/gpu_check/summary.json" $experiment <<'PY' || failures=$((failures + 1))
import json, math, sys
summary = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]} one rank: state {summary['state']}, validation loss {summary['final_val_loss']}, "
      f"{summary['wall_time_s']:.1f} s")
sys.exit(0 if summary["state"] == "completed" and math.isfinite(summary["final_val_loss"]) else 1)
PY
    else
        echo "MISMATCH the $experiment run failed" >&2
        failures=$((failures + 1))
    fi
    rm -rf "$out"
done

echo
if ((failures)); then
    echo "gpu_check: $failures section(s) FAILED" >&2
    exit 1
fi
echo "gpu_check: all sections passed"
