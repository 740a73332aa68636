"""SCAPE, sharded SCAPE, ZeRO-1 and sparse averaging make no host read between log steps but the
ones they name.

tests/trainer/test_step.py counts the dense loop's host reads; this counts SCAPE's, sharded
SCAPE's, ZeRO-1's and sparse averaging's, in the Trainer's own loop on 2 gloo ranks, with a counting shim at two
levels: the Python methods that read a tensor on the host (``item``, ``float``, ``bool``,
``int``, ``tolist``, ``numpy``) and a dispatch mode that sees every ATen op, and fails on those
that wait for the device (``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``equal``,
``unique``, boolean indexing, ...), wherever in the step they run (backward hooks included).

The reads each path is allowed between log steps, and no more:

- SCAPE, sharded SCAPE and sparse averaging: ``MaskedSynchronizer._skips``, the skip flag, once
  a step (their step counts, schedules and bias corrections are host numbers, as dense AdamS's
  are);
- SCAPE with the backward overlap or an offloaded residual: ``MaskExchange.host_view`` once a
  step, the mask's bucket / chunk positions (and, offloaded, the mask itself) for the host's
  slicing; on CUDA a pinned copy behind an event queued when the mask was decoded;
- ZeRO-1 with torch's fused AdamW (the CUDA arm): none.

The CPU-only sampled bracket of ``scape/topk.py`` (CUDA runs ``torch.topk`` itself) is turned
off here so that the selection runs the sync-free path CUDA takes, and the overlap's buckets are
made small (``BUCKET``) so that the tiny model's backward finishes several of them in its hooks.
"""
from __future__ import annotations

import traceback
from collections import defaultdict

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.train_helpers import REPO, TINY

LOG_EVERY, STEPS = 4, 9
BUCKET = 1 << 14  # flat coordinates per overlap bucket
READS = ("item", "__float__", "__bool__", "__int__", "__index__", "tolist", "numpy")

SCAPE = ["optimizer=scape", "optimizer.dense_warmup_steps=2", "optimizer.sparsity_warmup_steps=3"]
VARIANTS = {  # overrides, {permitted reader: reads allowed per quiet step}
    "scape": (SCAPE, {"skip": 1, "host_view": 1}),
    "scape_bitmap_offload": ([*SCAPE, "optimizer.sparsity=0.9", "optimizer.offload_residual=true",
                              "optimizer.mask_transport=bitmap"], {"skip": 1, "host_view": 1}),
    "scape_unoverlapped": ([*SCAPE, "optimizer.overlap_backward=false"], {"skip": 1, "host_view": 0}),
    "scape_sharded": ([*SCAPE, "optimizer.shard=true"], {"skip": 1, "host_view": 0}),
    "zero1_fused_adamw": (["optimizer=adamw", "optimizer.shard=true"], {"skip": 0, "host_view": 0}),
    "sparse_avg": (["optimizer=sparse_avg"], {"skip": 1, "host_view": 0}),
}


def _waits_for_device(func, args) -> bool:
    """ATen ops whose result size or value the host must wait for."""
    from torch._ops import OpOverload

    aten = torch.ops.aten
    if not isinstance(func, OpOverload):
        return False
    packet = func.overloadpacket
    if packet in (aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
                  aten.unique_consecutive, aten._unique2, aten.unique_dim, aten.allclose):
        return True
    if packet is aten.repeat_interleave:
        return True
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or [])
    return False


def _fused_adamw_for_groups(groups, cfg, adams_kernel=None):  # noqa: ARG001 - optimizer_for_groups' signature
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def _body(rank: int, world: int, cache: str, out_dir: str, variant: str) -> None:
    from hydra import compose, initialize_config_dir
    from torch.utils._python_dispatch import TorchDispatchMode

    import core.zero
    import scape.synchronizer
    import scape.topk
    from core.distributed import init_distributed
    from models.loss import _LinearCrossEntropy
    from scape.masking import MaskedSynchronizer, _HostView
    from scape.synchronizer import ScapeSynchronizer
    from trainer.config import register_configs, to_config
    from trainer.step import StepResult
    from trainer.trainer import Trainer

    overrides, allowed = VARIANTS[variant]
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *TINY, *overrides, f"data.cache_dir={cache}", f"out_dir={out_dir}", f"run_name={variant}",
            f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.ckpt_every=0"])
    cfg = to_config(cfg)
    scape.topk.SAMPLE_SIZE = 1 << 40  # the CUDA path's selection (see the module doc)
    core.zero.optimizer_for_groups = _fused_adamw_for_groups  # the CUDA arm's optimizer, on the CPU
    buckets = scape.synchronizer.OverlappedValues
    scape.synchronizer.OverlappedValues = lambda *args: buckets(*args[:6], BUCKET, *args[7:])
    run = Trainer(cfg, init_distributed(cfg.train.device, cfg.train.dist_timeout_s)).build()
    assert run.sync.takes_skip_flag
    if variant.startswith("scape"):
        assert isinstance(run.sync, ScapeSynchronizer)
        overlap = run.sync.backward_overlap
        assert (overlap is not None) == ("unoverlapped" not in variant and "sharded" not in variant)
        assert overlap is None or len(overlap.buckets) > 4
        assert run.sync.residual.offload == ("offload" in variant)
    elif variant == "sparse_avg":
        assert type(run.sync).__name__ == "SparseAverageSynchronizer"
    else:
        assert run.sync.skips_on_device

    counts = defaultdict(int)  # step -> host reads outside the permitted places
    where = {}  # step -> the first such read, for the failure message
    permitted_reads = {name: defaultdict(int) for name in allowed}  # reader -> step -> reads
    depth = {"permitted": 0}

    def flag(what: str) -> None:
        if not depth["permitted"]:
            counts[run.step] += 1
            where.setdefault(run.step, f"{what}:\n" + "".join(traceback.format_stack(limit=10)[:-2]))

    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            flag(f"Tensor.{name}")
            return originals[name](self, *args, **kwargs)
        return read

    class DeviceWaits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _waits_for_device(func, args):
                flag(str(func))
            return func(*args, **(kwargs or {}))

    def permitted(fn, reader=None, counts_if=None):
        def wrapper(*args, **kwargs):
            if reader is not None and (counts_if is None or counts_if(*args)):
                permitted_reads[reader][run.step] += 1
            depth["permitted"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth["permitted"] -= 1
        return wrapper

    patches = [(_LinearCrossEntropy, "backward", staticmethod(permitted(_LinearCrossEntropy.backward))),
               (StepResult, "read", permitted(StepResult.read)),
               (MaskedSynchronizer, "_skips", permitted(MaskedSynchronizer._skips, "skip")),
               # a host view is read once per mask; later calls return what was read
               (_HostView, "read", permitted(_HostView.read, "host_view", lambda view: view._read is None)),
               (type(run.metrics), "step_metrics", permitted(type(run.metrics).step_metrics)),
               (type(run.validator), "maybe_validate", permitted(type(run.validator).maybe_validate)),
               (type(run.checkpointer), "save", permitted(type(run.checkpointer).save)),
               *[(torch.Tensor, name, counting(name)) for name in READS]]
    saved = [(owner, name, owner.__dict__.get(name, getattr(owner, name))) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with DeviceWaits():
            summary = run.train()
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    assert summary["state"] == "completed"
    log_steps = {s for s in range(1, STEPS + 1) if run.metrics.due(s)}
    assert log_steps == {1, 4, 8, 9}, log_steps
    quiet = [s for s in range(1, STEPS + 1) if s not in log_steps]
    reads = {s: counts[s] for s in quiet if counts[s]}
    assert reads == {}, f"{variant}: host reads between log steps: {reads}; the first:\n{where[min(reads)] if reads else ''}"
    for reader, per_step in allowed.items():
        seen = {s: permitted_reads[reader][s] for s in quiet}
        sparse = [s for s in quiet if s > 2]  # steps 1-2 are dense: no mask to slice
        assert all(seen[s] <= per_step for s in quiet), f"{variant}: {reader} reads {seen}, at most {per_step} a step"
        assert all(seen[s] == per_step for s in sparse), f"{variant}: {reader} reads {seen}, {per_step} a sparse step"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_host_reads_between_log_steps_but_the_named_ones(variant, tmp_path, prepared_cache):
    run_distributed(_body, 2, (str(prepared_cache), str(tmp_path), variant))
