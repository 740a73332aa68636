"""A full disk loses nothing: a checkpoint write that fails (ENOSPC, any OSError) on any rank fails
on every rank, removes its partial files, keeps the previous checkpoint loadable and stops the run
with a clear message and the reason in status.json; after space is freed the run resumes from the
previous checkpoint with the losses of an uninterrupted run.

The end-to-end test fills a real tmpfs mount mid-write (2 torchrun ranks); it needs root and
``mount`` and is skipped, saying so, where either is missing."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core.checkpoint import CheckpointError
from core.distributed import DistEnv
from tests.dist_helpers import run_distributed
from tests.train_helpers import TINY, check, train_cli, train_losses


def _small_sync():
    from core.sync import DenseAllReduce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, DenseAllReduce(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _failing_writes(rank: int, world: int, run: str) -> None:
    import trainer.checkpoint as ckpt

    run_dir, env = Path(run), DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    model, sync = _small_sync()
    ckpt.save_checkpoint(run_dir, 1, sync, env, {"note": "complete"}, keep_last=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_save_hashed, real_seal = ckpt.save_hashed, ckpt.seal

    def half_then_full(obj, path):  # rank 1: a file cut off mid-write by the full disk
        Path(path).write_bytes(b"\0" * 1000)
        _enospc()

    def seal_full(folder, meta, checksums=None):  # rank 0: meta.json cannot be written
        (Path(folder) / "meta.json.tmp").write_text("{")
        _enospc()

    for who, name, patched in ((1, "save_hashed", half_then_full), (0, "seal", seal_full)):
        setattr(ckpt, name, patched if rank == who else getattr(ckpt, name))
        with pytest.raises(CheckpointError, match=f"rank {who}: OSError: .*No space left on device") as failed:
            ckpt.save_checkpoint(run_dir, 2, sync, env, {"note": "new"}, keep_last=1)
        assert "step-1" in str(failed.value) and "resume=auto" in str(failed.value)
        ckpt.save_hashed, ckpt.seal = real_save_hashed, real_seal
        dist.barrier()
        assert sorted(p.name for p in run_dir.iterdir()) == ["step-1"], "partial files removed, step-1 kept"
        dist.barrier()  # both ranks have looked before the next write makes its folder
    ckpt.load_checkpoint(run_dir / "step-1", sync, env)  # checksums verified: loadable
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert ckpt.read_meta(run_dir / "step-1")["note"] == "complete"


def test_a_failed_write_on_one_rank_fails_the_checkpoint_on_all_and_removes_it(tmp_path):
    run_distributed(_failing_writes, world_size=2, args=(str(tmp_path / "run"),))


# ------------------------------------------------------------------------ a real full disk

@pytest.fixture
def small_mount(tmp_path):
    """A tmpfs mount point and a function that (re)mounts it with a size in bytes."""
    point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small tmpfs needs root and mount(8); the in-process ENOSPC test covers the logic")
    mounted = []

    def mount(size: int) -> Path:
        opts = f"size={size}" if not mounted else f"remount,size={size}"
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
        mounted.append(size)
        return point

    yield mount
    if mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_full_disk_mid_checkpoint_keeps_the_previous_one_and_the_run_resumes(tmp_path, prepared_cache,
                                                                               small_mount):
    common = [*TINY, f"data.cache_dir={prepared_cache}", "optimizer=adams", "train.steps=8",
              "train.ckpt_every=2", "train.keep_last=1", "run_name=r"]
    check(train_cli([*common, f"out_dir={tmp_path / 'straight'}"], nproc=2))
    straight = train_losses(tmp_path / "straight" / "r")
    one = _folder_bytes(tmp_path / "straight" / "r" / "step-8")
    # room for the logs and one checkpoint and a half: the second (step 4) fills the disk mid-write
    disk = small_mount(int(1.5 * one) + 512 * 1024)
    run = disk / "r"
    proc = train_cli([*common, f"out_dir={disk}"], nproc=2)
    assert proc.returncode != 0, proc.stdout[-3000:]
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert "No space left on device" in error and "writing checkpoint" in error, error
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 4
    assert "No space left on device" in status["reason"] and "step-2" in status["reason"]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".step", "step"))) == ["step-2"]
    assert not (run / "run.lock").exists()
    from trainer.checkpoint import read_meta, verify_checkpoint

    meta = read_meta(run / "step-2")
    verify_checkpoint(run / "step-2", meta, sorted(meta["files"]))

    small_mount(4 * one + 1024 * 1024)  # space freed
    check(train_cli([*common, f"out_dir={disk}", "resume=auto"], nproc=2))
    resumed = train_losses(run)
    assert sorted(resumed) == list(range(1, 9)), "every step logged once"
    assert all(abs(resumed[s] - straight[s]) <= 1e-6 for s in straight), (resumed, straight)
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    ends = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines() if '"ended"' in line]
    assert [(e["start"], e["ended"]) for e in ends] == [(1, "failed"), (2, "completed")]
