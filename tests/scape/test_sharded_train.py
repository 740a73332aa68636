"""train.py on 2 gloo processes with optimizer.shard=true: the losses of the replicated run,
through a checkpoint and resume=auto (SCAPE) and for dense AdamS (ZeRO-1)."""
import pytest

from tests.train_helpers import TINY, check, read_metrics, train_cli, train_losses


def _args(tmp_path, cache, *extra):
    return [*TINY, f"out_dir={tmp_path}", f"data.cache_dir={cache}", "train.steps=8",
            "train.ckpt_every=0", *extra]


def _step_records(run):
    return {r["step"]: r for r in read_metrics(run) if "train/loss" in r}


def _assert_same_losses(a, b):
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:  # 1e-6 relative: a float32 loss near 8 has an ulp of 1e-6
        assert abs(a[step] - b[step]) <= 1e-6 * abs(a[step]), (step, a[step], b[step])


def test_sharded_scape_run_resumes_and_matches_replicated(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "optimizer=scape", "optimizer.sparsity=0.9")
    check(train_cli([*common, "run_name=replicated"], nproc=2))
    sharded = [*common, "run_name=sharded", "optimizer.shard=true"]
    check(train_cli([*sharded, "train.stop_after_steps=4"], nproc=2))
    check(train_cli([*sharded, "resume=auto"], nproc=2))
    _assert_same_losses(train_losses(tmp_path / "replicated"), train_losses(tmp_path / "sharded"))
    old, new = _step_records(tmp_path / "replicated"), _step_records(tmp_path / "sharded")
    sparse = [s for s in old if old[s]["scape/dense_step"] == 0.0]
    assert sparse
    for step in sparse:  # the reduce-scatter and the all-gather send what the all-reduce did
        assert new[step]["comm/bytes_scape_values"] + new[step]["comm/bytes_scape_params"] == \
            old[step]["comm/bytes_scape_values"]
    # resuming without the key is refused, naming it
    proc = train_cli([*common, "run_name=sharded", "resume=auto", "train.steps=9"], nproc=2)
    assert proc.returncode != 0 and "optimizer.shard=true" in proc.stderr


def test_zero1_adams_run_matches_replicated(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "optimizer=adams")
    check(train_cli([*common, "run_name=replicated"], nproc=2))
    check(train_cli([*common, "run_name=sharded", "optimizer.shard=true"], nproc=2))
    _assert_same_losses(train_losses(tmp_path / "replicated"), train_losses(tmp_path / "sharded"))
    assert "comm/bytes_grad_reducescatter" in _step_records(tmp_path / "sharded")[1]


@pytest.mark.parametrize("extra", [["optimizer=sparse_avg"], ["sdp=block", "optimizer=adams"]])
def test_shard_is_refused_where_it_has_no_meaning(tmp_path, prepared_cache, extra):
    proc = train_cli(_args(tmp_path, prepared_cache, *extra, "optimizer.shard=true"), nproc=1)
    assert proc.returncode != 0 and "optimizer.shard=false" in proc.stderr
