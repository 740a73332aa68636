"""The training loop makes no device-wide synchronisation between log steps (a counting shim on CPU).

On CUDA every host read of a device tensor (``.item()``, ``float()``, ``bool()``, ``.tolist()``)
and every ``torch.cuda.synchronize()`` stalls the GPU until the work queued so far is done. The
shim counts them in the Trainer's loop on 2 gloo ranks, with the dense arm as it runs on CUDA
(DDP and torch's fused AdamW, which skips a non-finite step on the device). The one read allowed
between log steps is ``StepResult.read`` of the *previous* step, which on CUDA waits for that
step's event only, once the next step is queued; the test checks it comes one step late.
"""
from __future__ import annotations

import traceback
from collections import defaultdict

import torch

from tests.dist_helpers import run_distributed
from tests.train_helpers import REPO, TINY

LOG_EVERY, STEPS = 4, 9
READS = ("item", "__float__", "__bool__", "__int__", "tolist", "numpy")


def _fused_adamw(params, cfg, adams_kernel=None, embeddings=frozenset()):  # noqa: ARG001 - build_optimizer's signature
    from core.flat import param_groups

    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             eps=cfg.eps, fused=True)


def _body(rank: int, world: int, cache: str, out_dir: str) -> None:
    from hydra import compose, initialize_config_dir

    import trainer.parts
    import trainer.trainer as trainer_module
    from core.comm import Collectives
    from core.distributed import init_distributed
    from trainer.config import register_configs, to_config
    from trainer.step import StepResult
    from trainer.trainer import Trainer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *TINY, "optimizer=adamw", f"data.cache_dir={cache}", f"out_dir={out_dir}", "run_name=nosync",
            f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.ckpt_every=0"])
    cfg = to_config(cfg)
    trainer.parts.build_optimizer = _fused_adamw  # the CUDA arm's optimizer, on the CPU
    run = Trainer(cfg, init_distributed(cfg.train.device, cfg.train.dist_timeout_s)).build()
    assert run.sync.takes_skip_flag and run.sync.skips_on_device and run.sync.ddp is not None

    counts = defaultdict(int)  # step -> host reads outside the allowed places
    where = {}  # step -> the first such read's stack, for the failure message
    blocking = defaultdict(int)  # step -> blocking collectives
    lateness = {}  # step of a result -> the loop's step when it was read
    step_of = {}  # id(result) -> its step
    allowed = {"depth": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            if not allowed["depth"]:
                counts[run.step] += 1
                where.setdefault(run.step, f"Tensor.{name}:\n" + "".join(traceback.format_stack(limit=8)[:-1]))
            return originals[name](self, *args, **kwargs)
        return read

    def permitted(fn):
        def wrapper(*args, **kwargs):
            allowed["depth"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                allowed["depth"] -= 1
        return wrapper

    result_read = StepResult.read

    def read(self):
        if self._values is None:
            lateness[step_of[id(self)]] = run.step
        return permitted(result_read)(self)

    train_step = Trainer.train_step

    def recorded_step(self, step):
        result = train_step(self, step)
        step_of[id(result)] = step
        return result

    all_reduce = Collectives.all_reduce

    def counted_all_reduce(self, tensor, kind, op=None, group=None, async_op=False):
        if not async_op and not allowed["depth"]:
            blocking[run.step] += 1
        return all_reduce(self, tensor, kind, op=op, group=group, async_op=async_op)

    from models.loss import _LinearCrossEntropy

    synchronize_calls = []
    patches = [  # the loss's backward reads grad_loss only for CPU tensors (a CPU fast path, never on CUDA)
               (_LinearCrossEntropy, "backward", staticmethod(permitted(_LinearCrossEntropy.backward))),
               (StepResult, "read", read), (Trainer, "train_step", recorded_step),
               (Collectives, "all_reduce", counted_all_reduce),
               (torch.cuda, "synchronize", lambda *a, **k: synchronize_calls.append(a)),
               # log steps, the final validation and the checkpoint may read the host as they like
               (type(run.metrics), "step_metrics", permitted(type(run.metrics).step_metrics)),
               (type(run.validator), "maybe_validate", permitted(type(run.validator).maybe_validate)),
               (type(run.checkpointer), "save", permitted(type(run.checkpointer).save)),
               *[(torch.Tensor, name, counting(name)) for name in READS]]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        summary = run.train()
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    assert trainer_module is not None and summary["state"] == "completed"
    log_steps = {s for s in range(1, STEPS + 1) if run.metrics.due(s)}
    assert log_steps == {1, 4, 8, 9}, log_steps
    quiet = [s for s in range(1, STEPS + 1) if s not in log_steps]
    assert not synchronize_calls
    reads = {s: counts[s] for s in quiet if counts[s]}
    assert reads == {}, f"host reads between log steps: {reads}; the first:\n{where[min(reads)] if reads else ''}"
    assert {s: blocking[s] for s in quiet if blocking[s]} == {}, "blocking collectives between log steps"
    # a quiet step's result is read one step late, a log step's at once
    assert {s: lateness[s] for s in quiet} == {s: s + 1 for s in quiet}
    assert all(lateness[s] == s for s in log_steps)


def test_loop_makes_no_device_wide_sync_between_log_steps(tmp_path, prepared_cache):
    run_distributed(_body, 2, (str(prepared_cache), str(tmp_path)))
