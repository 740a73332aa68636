"""Run a test function on N gloo processes on this CPU (OLMo's habit).

Usage, in a test::

    def _body(rank: int, world: int, tmp: str) -> None:
        ...assertions...

    def test_something(tmp_path):
        run_distributed(_body, world_size=2, args=(str(tmp_path),))

The body must be a module-level function (it is pickled). An exception or assertion failure on
any rank fails the test with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any, Callable, Tuple

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: Tuple[Any, ...], errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        import torch
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        # every rank is past its last collective before any tears its sockets down: a rank that
        # exits while another still receives the tail of a gloo collective aborts that one
        # ("terminate called without an active exception", a SIGABRT seen under load)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # a rank that passed leaves without the interpreter's finalization: gloo's worker threads can
    # still hold work objects whose tensors need the GIL there, and abort the process (a SIGABRT
    # with no traceback, seen in CI; pytorch/pytorch#179291)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int = 2, args: Tuple[Any, ...] = ()) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(_worker, args=(world_size, port, fn, args, errors), nprocs=world_size,
                           join=True, start_method="spawn")
    except Exception as exc:  # the rank's own traceback is more useful than the spawn wrapper's
        messages = []
        while not errors.empty():
            rank, tb = errors.get()
            messages.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(messages) or str(exc)) from None
