"""Per-rank checkpoint shards: every rank writes and hashes its own files, rank 0 never opens
another rank's, a failed shard leaves no checkpoint, and a SCAPE checkpoint of 2 ranks loads on
1 with the mean residual (what the next all-reduce would have delivered)."""
from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core.checkpoint import CheckpointError, sha256
from core.distributed import DistEnv
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train
from trainer.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def _env(rank: int, world: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def _write_shards(rank: int, world: int, run: str) -> None:
    run_dir = Path(run)
    sync = ScapeSynchronizer(make_model(), scape_config(sparsity=0.9))
    train(sync.model, sync, 3, rank)
    opened = []
    real_open = builtins.open

    def watching_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    builtins.open = watching_open
    try:
        final = save_checkpoint(run_dir, 3, sync, _env(rank, world), {"data": {"seed": 0}}, keep_last=3)
    finally:
        builtins.open = real_open
    others = [f"rank-{r}.pt" for r in range(world) if r != rank]
    assert not [p for p in opened if any(p.endswith(o) for o in others)], (rank, opened)
    torch.save({"residual": sync.residual.cpu_copy(), "momentum": sync.optimizer.momentum.clone(),
                "params": sync.flat.data.clone()}, run_dir / f"expected-{rank}.pt")
    dist.barrier()
    meta = json.loads((final / "meta.json").read_text())
    assert set(meta["files"]) == {"model.safetensors", "optimizer.pt", "rank-0.pt", "rank-1.pt"}
    assert meta["files"][f"rank-{rank}.pt"] == sha256(final / f"rank-{rank}.pt")

    # A shard that fails to write: every rank raises, and the complete checkpoint stays the latest.
    if rank == 1:
        def disk_full():
            raise OSError("No space left on device")
        sync.local_state_dict = disk_full
    with pytest.raises(CheckpointError, match="rank 1: OSError: No space left"):
        save_checkpoint(run_dir, 4, sync, _env(rank, world), {}, keep_last=3)
    dist.barrier()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-3"]


def test_shards_are_written_and_hashed_by_their_ranks_and_resume_on_one_rank(tmp_path):
    run_distributed(_write_shards, world_size=2, args=(str(tmp_path),))
    ckpt = latest_checkpoint(tmp_path)
    expected = [torch.load(tmp_path / f"expected-{r}.pt", weights_only=True) for r in range(2)]
    sync = ScapeSynchronizer(make_model(seed=5), scape_config(sparsity=0.9))
    meta = load_checkpoint(ckpt, sync, _env(0, 1))
    assert meta["world_size"] == 2 and sync.step_count == 3
    numel = sync.layout.numel
    mean = (expected[0]["residual"][:numel] + expected[1]["residual"][:numel]) / 2
    assert not torch.equal(expected[0]["residual"], expected[1]["residual"]), "residuals are per rank"
    torch.testing.assert_close(sync.residual.cpu_copy()[:numel], mean, rtol=0, atol=1e-7)
    assert torch.equal(sync.optimizer.momentum[:numel], expected[0]["momentum"][:numel])
    assert torch.equal(sync.flat.data[:numel], expected[0]["params"][:numel])
    assert sync.mask_step == 4 and sync.mask.numel() == sync.k_at(4)  # re-selected: one partition now
    losses = train(sync.model, sync, 2, 0, start=3)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_different_model_is_refused_clearly(tmp_path):
    sync = ScapeSynchronizer(make_model(), scape_config(sparsity=0.9))
    train(sync.model, sync, 2, 0)
    ckpt = save_checkpoint(tmp_path, 2, sync, _env(0, 1), {}, keep_last=1)
    other = ScapeSynchronizer(torch.nn.Linear(16, 4), scape_config(sparsity=0.9))
    with pytest.raises(CheckpointError, match="does not fit this run's model"):
        load_checkpoint(ckpt, other, _env(0, 1))
