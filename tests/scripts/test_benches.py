"""The benchmarks' own logic: bench_network's arms, time-to-loss bookkeeping and arguments;
bench_optimizer's top-k comparison at a small size; the report and port helpers they share."""
import json
import sys

import pytest

from tests.train_helpers import REPO, load_script


bench_network = load_script("bench_network")
bench_io = load_script("bench_io")


def test_emit_report_prints_the_json_and_writes_it_into_a_new_folder(tmp_path, capsys):
    out = tmp_path / "new" / "report.json"
    bench_io.emit_report({"a": 1, "b": [2.5]}, out)
    assert json.loads(capsys.readouterr().out) == {"a": 1, "b": [2.5]}
    assert json.loads(out.read_text()) == {"a": 1, "b": [2.5]} and out.read_text().endswith("\n")
    bench_io.emit_report({"c": 3})  # no --out: printed only
    assert json.loads(capsys.readouterr().out) == {"c": 3}


def test_free_port_is_a_port_a_server_can_bind():
    import socket

    port = bench_io.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def _records():
    steps = [{"step": s, "perf/step_time_s": 0.5, "comm/bytes_total": 100.0} for s in range(1, 11)]
    vals = [{"step": 5, "val/loss": 3.0}, {"step": 10, "val/loss": 2.0}]
    return steps + vals


def test_time_to_loss_finds_the_first_validation_at_the_target_and_sums_to_it():
    records = _records()
    assert bench_network.first_at_target(records, 2.5) == 10
    assert bench_network.first_at_target(records, 3.0) == 5
    assert bench_network.first_at_target(records, 1.0) is None
    assert bench_network.totals_to(records, 5) == {"steps": 5, "train_wall_s": 2.5, "bytes_per_rank": 500.0}


def test_a_reference_that_did_not_train_is_an_error_not_a_target():
    records = [{"step": 10, "val/loss": 8.0}, {"step": 20, "val/loss": 7.5}]
    assert bench_network.reference_target(records, 20, "adams") == (7.5, [(10, 8.0), (20, 7.5)])
    with pytest.raises(RuntimeError, match="no validation loss at step 30"):
        bench_network.reference_target(records, 30, "adams")
    untrained = [{"step": 60, "val/loss": 9.2463}]  # above ln 8192 = 9.011: the 2026-12-01 run
    with pytest.raises(RuntimeError, match="did not train.*lower --lr"):
        bench_network.reference_target(untrained, 60, "adams")


def test_lr_and_warmup_reach_every_arm():
    args = bench_network.parse_args(["--lr", "1e-3", "--lr-warmup", "10"])
    overrides = bench_network.model_overrides(args)
    assert "optimizer.lr=0.001" in overrides and "optimizer.warmup_steps=10" in overrides
    assert not any(o.startswith("optimizer.lr=") for o in bench_network.model_overrides(bench_network.parse_args([])))


def test_speedups_are_against_every_dense_arm_that_ran():
    entry = {"adams": {"step_time_s": 1.0}, "adams_after_backward": {"step_time_s": 1.5},
             "scape99": {"step_time_s": 0.25}}
    got = bench_network.speedups(entry, ["adams", "adams_after_backward", "scape99"])
    assert got == {"speedup_vs_adams": {"adams_after_backward": 0.67, "scape99": 4.0},
                   "speedup_vs_adams_after_backward": {"adams": 1.5, "scape99": 6.0}}


def test_dense_arms_name_their_grad_sync_and_scape_arms_compose():
    from core.optim import DenseOptimizerConfig
    has_key = "grad_sync" in DenseOptimizerConfig.__dataclass_fields__
    after = bench_network.arm_overrides("adams_after_backward")
    assert ("optimizer.grad_sync=after_backward" in after) == has_key
    if has_key:
        assert "optimizer.grad_sync=ddp" in bench_network.arm_overrides("adams")
    else:  # before the overlapped dense all-reduce exists the baseline arm refuses by name
        with pytest.raises(SystemExit, match="optimizer.grad_sync"):
            bench_network.arm_overrides("adams")
    from hydra import compose, initialize_config_dir
    from trainer.config import register_configs
    register_configs()
    args = bench_network.parse_args(["--arms", "scape99"])
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for arm in ("scape90_threshold", "scape99_no_overlap", "adams_after_backward", "sparse_avg"):
            cfg = compose(config_name="config", overrides=[*bench_network.model_overrides(args),
                                                           *bench_network.arm_overrides(arm)])
            assert cfg.optimizer.name in ("scape", "adams", "sparse_avg")
        assert cfg.train.global_batch_tokens == 2 * args.seq_len  # 64 tokens per rank, 2 ranks


def test_time_to_loss_arguments_are_checked():
    args = bench_network.parse_args(["--time-to-loss", "20", "--step-cap", "60"])
    assert (args.steps, args.eval_every) == (60, 5)
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--time-to-loss", "20", "--step-cap", "10"])
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--time-to-loss", "22", "--step-cap", "60", "--eval-every", "5"])
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--arms", "sgd"])


def test_ranks_per_host_sizes_the_batch_and_the_copy_per_host_arm_needs_two():
    args = bench_network.parse_args(["--ranks-per-host", "2", "--arms", "adams,sma99_copy_per_host"])
    assert "train.global_batch_tokens=256" in bench_network.model_overrides(args)  # 4 ranks x 64 tokens
    assert "optimizer.ranks_per_copy={ranks_per_host}" in bench_network.arm_overrides("sma99_copy_per_host")
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--arms", "sma99_copy_per_host"])
    with pytest.raises(SystemExit):
        bench_network.parse_args(["--ranks-per-host", "0"])


def test_bench_optimizer_compares_both_topk_methods(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_optimizer.py", "--numel", "300000", "--repeats", "1",
                                      "--threads", "1", "--out", str(out)])
    load_script("bench_optimizer").main()
    report = json.loads(out.read_text())["seconds"]
    for name, k in (("topk90", 30000), ("topk99", 3000)):
        row = report[name]["min"]
        # k = ceil(density * padded partition): a little above density * numel
        assert k <= report[name]["k"] <= k + 8 and row["k_exact"] == row["k_threshold"] == report[name]["k"]
        assert row["same_set_above_kth"] == 1.0 and row["ties_at_kth"] >= 1
    assert {"scape90_threshold", "scape99_threshold"} <= set(report)


def _wire_run(step: int, counted: float, tx_a: int, tx_b: int) -> dict:
    return {"summary": {"step": step, "bytes_sent_per_rank": counted}, "tx_bytes": {"a": tx_a, "b": tx_b}}


def test_the_wire_check_compares_the_steps_between_two_runs_within_the_bound():
    # start-up (DDP's broadcast, rendezvous) costs both runs the same 5,000 bytes per end
    long, short = _wire_run(10, 10_000.0, 15_600, 15_400), _wire_run(4, 4_000.0, 9_100, 9_100)
    entry = bench_network.wire_entry("adams", long, short, 1, 0.10)
    assert entry["arm"] == "adams_ddp" and entry["steps"] == [4, 10]
    assert (entry["counted_bytes"], entry["measured_bytes"]) == (6_000, 6_400)
    assert entry["ratio"] == pytest.approx(6_400 / 6_000, abs=1e-4) and entry["within_bound"]
    assert not bench_network.wire_entry("scape99", long, short, 1, 0.05)["within_bound"]  # 6.7% > 5%
    fewer = _wire_run(10, 10_000.0, 14_000, 14_000)  # the wire carried less than counted: a counter error
    assert not bench_network.wire_entry("adams", fewer, short, 1, 0.10)["within_bound"]
    two_per_host = bench_network.wire_entry("adams", _wire_run(10, 10_000.0, 2 * 15_600, 2 * 15_400),
                                            _wire_run(4, 4_000.0, 2 * 9_100, 2 * 9_100), 2, 0.10)
    assert two_per_host["measured_bytes"] == 6_400, "each end carries its host's ranks"


def test_wire_check_arguments_are_checked():
    args = bench_network.parse_args(["--rates", "1gbit", "--steps", "10", "--wire-check", "4"])
    assert (args.wire_check, args.overhead_bound) == (4, 0.10)
    for bad in (["--rates", "1gbit", "--steps", "10", "--wire-check", "10"],
                ["--rates", "1gbit,100mbit", "--steps", "10", "--wire-check", "4"],
                ["--rates", "1gbit", "--wire-check", "4", "--time-to-loss", "5", "--step-cap", "10"]):
        with pytest.raises(SystemExit):
            bench_network.parse_args(bad)


def test_the_veth_counter_sees_the_bytes_a_tcp_stream_sends():
    """LinkedNamespaces.tx_bytes reads what crossed the link: 4 MiB sent b -> a appear on b's end
    (plus TCP/IP headers), and a's end carries only the acknowledgements."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"t{os.getpid() % 100000}"
    try:
        link = bench_network.LinkedNamespaces(tag).__enter__()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        before = link.tx_bytes()
        link.measure_throughput(megabytes=4)
        after = link.tx_bytes()
    finally:
        link.__exit__(None, None, None)
    sent_b, sent_a = after["b"] - before["b"], after["a"] - before["a"]
    assert 4 * 2**20 <= sent_b <= 1.10 * 4 * 2**20, sent_b
    assert sent_a < 0.05 * 4 * 2**20, sent_a
