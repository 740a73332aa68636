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


def cuda_unavailable_message() -> str:
    """Why train.device=cuda cannot run here, naming the torch build and the fix."""
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda else \
        f"torch {torch.__version__}, a CPU-only build"
    seen = "but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver, or a node without GPUs)" \
        if torch.version.cuda else "which cannot use a GPU"
    return (f"train.device=cuda but CUDA is not available: this is {build}, {seen}. Install a CUDA build of "
            f"torch before scripts/setup.sh (docs/CLUSTER.md, 'A CUDA torch'), run on a GPU node, or pass "
            f"train.device=cpu")


def cuda_device_for(local_rank: int, local_world: int, gpus: int) -> torch.device:
    """One GPU per local rank; refuse more local ranks than GPUs (they would share cuda:0 and NCCL
    refuses two ranks on one device)."""
    if gpus == 0:
        raise RuntimeError(cuda_unavailable_message())
    if local_world > gpus or local_rank >= gpus:
        raise RuntimeError(f"{local_world} local ranks but {gpus} GPU(s) on this node: one rank per GPU. Run "
                           f"torchrun --nproc_per_node={gpus}, or train.device=cpu for {local_world} CPU ranks "
                           f"(gloo)")
    return torch.device("cuda", local_rank)


def init_distributed(device_pref: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the process group torchrun describes in the environment, if any.

    The timeout bounds every collective: a peer that died makes the others fail after
    ``timeout_s`` with an error naming the operation instead of hanging for the job's lifetime.
    On CUDA, fp32 matmuls use TF32 tensor cores (the autocast bf16 path is unaffected; this is
    what fp32 runs and fp32 parts such as the loss get on Hopper).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError(cuda_unavailable_message())
    if use_cuda:
        device = cuda_device_for(local_rank, local_world, torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if use_cuda else None,
                                **_restart_store_kwargs(rank, world, timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 21803) in older ones
    if isinstance(version, int):
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(map(str, version))


def runtime_summary(env: DistEnv, device_pref: str = "auto") -> str:
    """One line for the start-up log: torch, CUDA, NCCL, the GPUs, the backend (and why CPU)."""
    parts = [f"torch {torch.__version__}"]
    if env.device.type == "cuda":
        nccl = _nccl_version() if dist.is_nccl_available() else "none"
        parts += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}",
                  f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(env.device)} visible on this node",
                  f"rank 0 on {env.device}", "TF32 matmuls on"]
    else:
        why = "train.device=cpu" if device_pref == "cpu" else (
            f"train.device=auto found no GPU ({'CPU-only build' if not torch.version.cuda else 'CUDA ' + torch.version.cuda + ' build, no device visible'})")
        parts.append(f"device cpu: {why}")
    backend = dist.get_backend() if dist.is_initialized() else "none (one process)"
    parts.append(f"backend {backend}, {env.world_size} rank(s)")
    return "runtime: " + ", ".join(parts)


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
