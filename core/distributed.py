"""Process-group setup: one process (no group) or torchrun (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

import datetime
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the process group torchrun describes in the environment, if any.

    The timeout bounds every collective: a peer that died makes the others fail after
    ``timeout_s`` with an error naming the operation instead of hanging for the job's lifetime.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if use_cuda else None,
                                **_restart_store_kwargs(rank, world, timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _restart_store_kwargs(rank: int, world: int, timeout_s: int) -> dict:
    """A fresh key space for workers restarted by ``torchrun --max-restarts``.

    torchrun's agent keeps its TCPStore across restarts, so restarted workers would read the dead
    workers' connection addresses ("Gloo connectFullMesh failed ... Connection refused",
    pytorch/pytorch#167288). Prefixing the keys with the restart count avoids the stale ones.
    Returns no arguments (the default env:// store) for a first start.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        return {}
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return {"store": dist.PrefixStore(f"restart-{restart}", store), "rank": rank, "world_size": world}


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s value on every rank (e.g. a decision only rank 0 can make)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class RankZeroError(RuntimeError):
    """An error rank 0 met in work done for all ranks (e.g. data preparation), re-raised everywhere."""


def on_main(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only; every rank gets its result or raises its error (no hang)."""
    result, error = None, None
    if env.is_main:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            if env.world_size == 1:
                raise
            if not isinstance(exc, (ValueError, OSError)):
                traceback.print_exc()  # a bug, not bad input: keep its traceback
            error = f"{type(exc).__name__}: {exc}"
    result, error = broadcast_object((result, error))
    if error is not None:
        raise RankZeroError(error)
    return result
