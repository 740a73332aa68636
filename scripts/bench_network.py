"""Per-step wall time of dense AdamS against SCAPE over a rate-limited link (needs root).

    sudo python scripts/bench_network.py                            # 1 Gbit/s and 100 Mbit/s
    sudo python scripts/bench_network.py --rates 1gbit --steps 8 --out runs/net.json
    sudo python scripts/bench_network.py --rates 1gbit --time-to-loss 40 --step-cap 160
    sudo python scripts/bench_network.py --rates 1gbit --ranks-per-host 2 --arms adams,sma99,sma99_copy_per_host
    sudo python scripts/bench_network.py --rates 1gbit,100mbit --arms adams,scape99,sparse_avg --steps 24 --warmup 12
    sudo python scripts/bench_network.py --rates 1gbit --arms adams,scape99,sparse_avg --steps 12 --wire-check 4

Wire mode (``--wire-check S``): every arm runs ``--steps`` and S steps; the bytes both ends of the
veth transmitted (the kernel's ``tx_bytes``) in the longer run minus the shorter are the extra
steps' bytes on the wire, and must lie between the trainer's counted bytes for those steps and
``--overhead-bound`` (10%) above them; the exit status is 1 otherwise.

The dense baseline is the one users run: AdamS with its gradient all-reduce overlapped with
backward (``optimizer.grad_sync=ddp``, arm ``adams``); ``adams_after_backward`` is the
all-reduce after the last backward (``optimizer.grad_sync=after_backward``), kept to compare
like for like. SCAPE runs with its value all-reduce overlapped with backward
(``optimizer.overlap_backward``, the default; ``scape99_no_overlap`` turns it off). Speed-ups
are reported against both dense arms.

Time-to-loss mode (``--time-to-loss S --step-cap C``): every arm trains the same model with the
same learning-rate schedule (over C steps) on the shaped link; the reference arm (``adams``)
stops after S steps and its validation loss there is the target; every other arm trains until
its validation loss (every ``--eval-every`` steps) reaches the target or C steps have run. It
reports, per arm, the steps, training wall-clock (the sum of the steps' times, validation not
included) and bytes sent per rank to reach the target.

Two ranks of train.py (2G with ``--ranks-per-host G``) live in two network namespaces joined by
a veth pair whose both ends are shaped with a ``tc`` token bucket (egress of each end, so each
direction gets the rate), and gloo talks between the namespaces over that link only
(MASTER_ADDR / GLOO_SOCKET_IFNAME inside the namespaces; the ranks of one namespace reach each
other over its loopback route, unshaped, as the GPUs of a node would over NVLink). So the
numbers include everything the real trainer does per step — forward, backward, SCAPE's top-k and
packing, the collectives over a real TCP stack at the given rate — and the speed-up is the one a
user would see on that network with these CPUs.

The model is a Llama of about 22M parameters fed 64 tokens per rank and step, so that a dense
fp32 all-reduce (88 MB) dominates at 1 Gbit/s; the per-step figure is the median of
perf/step_time_s after the warm-up steps (SCAPE's first step is dense by design).

Every namespace this script makes is deleted on exit, also on errors and on SIGINT/SIGTERM; the
names carry this process's id so concurrent runs do not collide.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
VOCAB = 8192
ADDRESS = {"a": "10.203.0.1", "b": "10.203.0.2"}

ARMS: Dict[str, List[str]] = {
    "adams": ["optimizer=adams", "optimizer.grad_sync=ddp"],
    "adams_after_backward": ["optimizer=adams", "optimizer.grad_sync=after_backward"],
    "scape90": ["optimizer=scape", "optimizer.sparsity=0.9"],
    "scape99": ["optimizer=scape", "optimizer.sparsity=0.99"],
    "scape90_threshold": ["optimizer=scape", "optimizer.sparsity=0.9", "optimizer.topk_method=threshold"],
    "scape99_no_overlap": ["optimizer=scape", "optimizer.sparsity=0.99", "optimizer.overlap_backward=false"],
    # sparse averaging as it ships: 2-bit drifts through the compressed all-reduce at SCAPE-99's
    # bytes per step (run with --warmup past its sparsity warm-up, a third of --steps)
    "sparse_avg": ["optimizer=sparse_avg"],
    # bf16 drifts (value_bits 0) at the bytes of 1% of them a step (0.5% of the dense bytes), the
    # rule these arms were first measured with
    "sma99": ["optimizer=sparse_avg", "optimizer.byte_budget=0.005", "optimizer.value_bits=0"],
    # the ranks of a host train one copy (dense over the host's loopback), sparse between hosts
    "sma99_copy_per_host": ["optimizer=sparse_avg", "optimizer.byte_budget=0.005", "optimizer.value_bits=0",
                            "optimizer.ranks_per_copy={ranks_per_host}"],
}
DENSE_ARMS = ("adams", "adams_after_backward")
WIRE_NAMES = {"adams": "adams_ddp"}  # the names of docs/results/network_wire.json


def arm_overrides(arm: str) -> List[str]:
    """The arm's Hydra overrides; before ``optimizer.grad_sync`` exists the dense all-reduce runs
    after backward, so only the after-backward arm can run (without the key)."""
    sys.path.insert(0, str(REPO))
    from core.optim import DenseOptimizerConfig

    overrides = ARMS[arm]
    if "grad_sync" not in DenseOptimizerConfig.__dataclass_fields__:
        if arm == "adams":
            raise SystemExit("arm 'adams' (dense all-reduce overlapped with backward) needs the "
                             "optimizer.grad_sync key, which this checkout lacks; run "
                             "--arms adams_after_backward,... or update the checkout")
        overrides = [o for o in overrides if not o.startswith("optimizer.grad_sync=")]
    return overrides


def model_overrides(args: argparse.Namespace) -> List[str]:
    """A wide, shallow Llama: many parameters (bytes to send) for few FLOPs per token."""
    return [
        "model=tiny_llama", f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}",
        f"model.n_head={args.n_head}", f"model.n_kv_head={args.n_head}", f"model.ffn_hidden={3 * args.d_model}",
        f"model.seq_len={args.seq_len}", f"model.vocab_size={VOCAB}",
        "data=embedded", "data.embedded_docstrings=false", "data.name=bench_network",
        f"data.cache_dir={args.cache_dir}", f"tokenizer.vocab_size={VOCAB}",
        f"train.steps={args.steps}", f"train.global_batch_tokens={2 * args.ranks_per_host * args.seq_len}",
        "train.micro_batch_size=1",
        "train.log_every=1", f"train.eval_every={args.eval_every}", f"train.eval_batches={args.eval_batches}",
        "train.ckpt_every=0",
        "train.keep_last=1", f"optimizer.warmup_steps={args.lr_warmup}", "logger=console",
        *([f"optimizer.lr={args.lr}"] if args.lr is not None else []),
    ]


def rate_bits(rate: str) -> float:
    """tc's rate spelling (1gbit, 100mbit, 500kbit) in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 100mbit or 500kbit")


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class LinkedNamespaces:
    """Two network namespaces joined by a shaped veth pair; a context manager that always cleans up."""

    def __init__(self, tag: str) -> None:
        self.ns = {"a": f"scb{tag}a", "b": f"scb{tag}b"}
        self.dev = {"a": f"scb{tag}a0", "b": f"scb{tag}b0"}
        self.created: List[str] = []

    def __enter__(self) -> "LinkedNamespaces":
        try:
            for side in "ab":
                sh("ip", "netns", "add", self.ns[side])
                self.created.append(self.ns[side])
            sh("ip", "link", "add", self.dev["a"], "netns", self.ns["a"], "type", "veth",
               "peer", "name", self.dev["b"], "netns", self.ns["b"])
            for side in "ab":
                self.run_in(side, "ip", "addr", "add", f"{ADDRESS[side]}/24", "dev", self.dev[side])
                self.run_in(side, "ip", "link", "set", self.dev[side], "up")
                self.run_in(side, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self.created):  # deleting a namespace deletes its end of the veth pair
            sh("ip", "netns", "del", name, check=False)
        self.created.clear()

    def tx_bytes(self) -> Dict[str, int]:
        """Bytes each end of the veth pair has transmitted (the kernel's counter, headers included)."""
        return {side: int(self.run_in(side, "cat", f"/sys/class/net/{self.dev[side]}/statistics/tx_bytes")
                          .stdout.strip()) for side in "ab"}

    def run_in(self, side: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns[side], *cmd, check=check)

    def shape(self, rate: Optional[str], delay_ms: float) -> None:
        """Egress shaping on both ends: tbf for the rate (netem where a delay is asked for).

        veth hands the qdisc GSO super-packets of up to 64 KiB, and tbf drops any packet larger
        than its bucket, so the bucket holds at least 128 KiB (about 1 ms at 1 Gbit/s, 10 ms at
        100 Mbit/s): a burst that short changes nothing for multi-megabyte collectives.
        """
        for side in "ab":
            self.run_in(side, "tc", "qdisc", "del", "dev", self.dev[side], "root", check=False)
            if delay_ms > 0:
                netem = ["tc", "qdisc", "add", "dev", self.dev[side], "root", "netem", "limit", "100000",
                         "delay", f"{delay_ms}ms"] + (["rate", rate] if rate else [])
                self.run_in(side, *netem)
            elif rate is not None:
                burst = max(131072, int(rate_bits(rate) / 8 / 1000))
                self.run_in(side, "tc", "qdisc", "add", "dev", self.dev[side], "root", "tbf", "rate", rate,
                            "burst", str(burst), "latency", "200ms")

    def measure_throughput(self, megabytes: int = 40) -> float:
        """Bits per second of one TCP stream b -> a over the link, as a check that shaping works."""
        port = 29611
        receiver = ("import socket,sys\n"
                    "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                    f"s.bind(('{ADDRESS['a']}',{port}));s.listen(1);c,_=s.accept();n=0\n"
                    "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
                    "print(n)")
        sender = ("import socket,time\n"
                  f"s=socket.create_connection(('{ADDRESS['a']}',{port}),timeout=60);b=bytes(1<<20)\n"
                  f"t=time.perf_counter()\nfor _ in range({megabytes}): s.sendall(b)\n"
                  "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)")
        rx = subprocess.Popen(["ip", "netns", "exec", self.ns["a"], sys.executable, "-c", receiver],
                              stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)
            tx = self.run_in("b", sys.executable, "-c", sender)
            rx.wait(timeout=120)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        return megabytes * (1 << 20) * 8 / float(tx.stdout.strip())


def _stream(pipe, sink: List[str]) -> None:
    for line in pipe:
        sink.append(line)


def _records(path: Path) -> List[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return records


def first_at_target(records: List[dict], target: float) -> Optional[int]:
    """The first step whose validation loss is at or below ``target``."""
    for r in records:
        if "val/loss" in r and float(r["val/loss"]) <= target:
            return int(r["step"])
    return None


def totals_to(records: List[dict], step: int) -> Dict[str, float]:
    """Training wall-clock (sum of step times) and bytes per rank over steps 1..step."""
    timed = {int(r["step"]): r for r in records if "perf/step_time_s" in r and int(r["step"]) <= step}
    return {"steps": step, "train_wall_s": round(sum(float(r["perf/step_time_s"]) for r in timed.values()), 3),
            "bytes_per_rank": sum(float(r.get("comm/bytes_total", 0.0)) for r in timed.values())}


def _launch(link: LinkedNamespaces, arm: str, args: argparse.Namespace, run_root: Path, run_name: str,
            extra: Sequence[str] = (), stop_at: Optional[float] = None) -> dict:
    """One training run of ``--ranks-per-host`` ranks on each side of the link; returns its
    metrics records, its summary and the bytes each end of the veth pair transmitted meanwhile.
    Ranks on the same side talk over that namespace's loopback route (the veth address is local
    there), so only traffic between the sides is shaped and counted on the veth.

    ``stop_at``: a validation loss; once rank 0 logs one at or below it the ranks are asked to
    stop (SIGTERM: a clean stop at the next step boundary).
    """
    overrides = [*model_overrides(args), *(o.format(ranks_per_host=args.ranks_per_host) for o in arm_overrides(arm)),
                 *extra, f"out_dir={run_root}", f"run_name={run_name}"]
    port = str(29500 + (os.getpid() % 400))
    procs, logs = [], []
    per_host = args.ranks_per_host
    tx_before = link.tx_bytes()
    for rank in range(2 * per_host):
        side = "ab"[rank // per_host]
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % per_host), WORLD_SIZE=str(2 * per_host),
                   LOCAL_WORLD_SIZE=str(per_host), MASTER_ADDR=ADDRESS["a"],
                   MASTER_PORT=port, GLOO_SOCKET_IFNAME=link.dev[side], OMP_NUM_THREADS="1",
                   WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(["ip", "netns", "exec", link.ns[side], sys.executable, str(REPO / "train.py"),
                                 *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sink: List[str] = []
        threading.Thread(target=_stream, args=(proc.stdout, sink), daemon=True).start()
        procs.append(proc)
        logs.append(sink)
    metrics_path = run_root / run_name / "metrics.jsonl"
    _wait(procs, metrics_path, args.timeout, stop_at)
    tx_after = link.tx_bytes()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{run_name}: exit codes {[p.returncode for p in procs]}; rank 0 said:\n"
                           + "".join(logs[0][-30:]) + "\nthe last rank said:\n" + "".join(logs[-1][-15:]))
    return {"records": _records(metrics_path),
            "summary": json.loads((run_root / run_name / "summary.json").read_text()),
            "tx_bytes": {side: tx_after[side] - tx_before[side] for side in "ab"}}


def _wait(procs: List[subprocess.Popen], metrics_path: Path, timeout: float, stop_at: Optional[float]) -> None:
    """Wait for the ranks (SIGTERM once the target loss is logged); kill whatever outlives ``timeout``."""
    try:
        deadline = time.time() + timeout
        stopping = False
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.5)
            if stop_at is not None and not stopping and \
                    first_at_target(_records(metrics_path), stop_at) is not None:
                for proc in procs:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGTERM)
                stopping = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_arm(link: LinkedNamespaces, arm: str, args: argparse.Namespace, run_root: Path, label: str,
            extra: Sequence[str] = (), stop_at: Optional[float] = None) -> dict:
    """One run of ``arm`` (``_launch``); returns the per-step timing medians after the warm-up,
    the bytes its counters summed and the bytes the veth transmitted (per rank, whole run)."""
    run_name = f"{label}-{arm}"
    launched = _launch(link, arm, args, run_root, run_name, extra, stop_at)
    records, summary = launched["records"], launched["summary"]
    timed = [r for r in records if "perf/step_time_s" in r and r["step"] > args.warmup]
    if not timed:
        raise RuntimeError(f"{run_name}: no step after the {args.warmup} warm-up steps was logged")

    def median(key: str) -> float:
        return round(statistics.median(float(r.get(key, 0.0)) for r in timed), 4)

    return {"parameters": summary.get("parameters"), "step_time_s": median("perf/step_time_s"), "fwd_bwd_s": median("perf/time_fwd_bwd_s"),
            "comm_s": median("perf/time_comm_s"), "opt_s": median("perf/time_opt_s"),
            "bytes_per_step": median("comm/bytes_total"),
            # copy_gradients stays inside a host (sma99_copy_per_host); every other kind crosses the link
            "bytes_per_step_by_kind": {key[len("comm/bytes_"):]: median(key) for key in sorted(timed[-1])
                                       if key.startswith("comm/bytes_") and key[len("comm/bytes_"):] not in
                                       ("total", "cumulative")},
            "counted_bytes_per_rank": summary.get("bytes_sent_per_rank"),
            "veth_tx_bytes_per_rank": per_rank(launched["tx_bytes"], args.ranks_per_host),
            "steps_timed": len(timed),
            "step_times_s": [round(float(r["perf/step_time_s"]), 4) for r in timed], "records": records}


def per_rank(tx_bytes: Dict[str, int], ranks_per_host: int) -> float:
    """The veth's transmitted bytes of both ends, per rank (each end carries its host's ranks)."""
    return (tx_bytes["a"] + tx_bytes["b"]) / (2 * ranks_per_host)


def wire_entry(arm: str, long: dict, short: dict, ranks_per_host: int, bound: float) -> dict:
    """Counted against transmitted bytes of the steps one run has beyond the other.

    Both runs pay the same start-up and end (rendezvous, DDP's initial broadcast, the final
    validation and checkpoint), none of which is a training step's traffic: their difference
    leaves the extra steps' bytes, which the trainer's counter (``comm/bytes_total``) must
    account for up to the protocol's headers and acknowledgements (``bound``)."""
    counted = long["summary"]["bytes_sent_per_rank"] - short["summary"]["bytes_sent_per_rank"]
    measured = per_rank(long["tx_bytes"], ranks_per_host) - per_rank(short["tx_bytes"], ranks_per_host)
    ratio = measured / counted if counted else float("inf")
    return {"arm": WIRE_NAMES.get(arm, arm), "counted_bytes": int(round(counted)), "measured_bytes": int(round(measured)),
            "ratio": round(ratio, 4), "within_bound": 1.0 <= ratio <= 1.0 + bound,
            "steps": [short["summary"]["step"], long["summary"]["step"]],
            "whole_run": {"counted_bytes": int(round(long["summary"]["bytes_sent_per_rank"])),
                          "measured_bytes": int(round(per_rank(long["tx_bytes"], ranks_per_host)))}}


def wire_check(link: LinkedNamespaces, args: argparse.Namespace, arms: Sequence[str], run_root: Path,
               label: str) -> List[dict]:
    """Every arm twice, for ``--steps`` and ``--wire-check`` steps: counted and transmitted bytes
    of the steps between (``wire_entry``), printed side by side."""
    short_args = argparse.Namespace(**{**vars(args), "steps": args.wire_check})
    out = []
    for arm in arms:
        long = _launch(link, arm, args, run_root, f"{label}-wire-{arm}")
        short = _launch(link, arm, short_args, run_root, f"{label}-wire-short-{arm}")
        entry = wire_entry(arm, long, short, args.ranks_per_host, args.overhead_bound)
        print(f"[bench] wire {entry['arm']}: steps {entry['steps'][0] + 1}..{entry['steps'][1]} counted "
              f"{entry['counted_bytes']:,} B per rank, veth transmitted {entry['measured_bytes']:,} B "
              f"(x{entry['ratio']:.4f}; the bound is x1 to x{1 + args.overhead_bound:g})", flush=True)
        out.append(entry)
    return out


def prepare_corpus(args: argparse.Namespace) -> None:
    """Tokenize the corpus once, outside the namespaces, so no timed run pays for it."""
    sys.path.insert(0, str(REPO))
    from hydra import compose, initialize_config_dir

    from data import prepare
    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[o for o in model_overrides(args)])
    prepare(cfg.data, cfg.tokenizer)


def _raise_on_signal(signum, frame) -> None:  # noqa: ARG001 - turns SIGTERM into cleanup
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, comma-separated; 'none' = unshaped")
    parser.add_argument("--arms", default="adams,adams_after_backward,scape90,scape99",
                        help=f"from {', '.join(ARMS)}")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added by netem")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per rank and step")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks in each of the two namespaces (a host of that many GPUs)")
    parser.add_argument("--cache-dir", default=str(REPO / "cache" / "data"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--time-to-loss", type=int, default=0, metavar="S",
                        help="time-to-loss mode: the target is the reference arm's validation loss after S steps")
    parser.add_argument("--step-cap", type=int, default=0, metavar="C",
                        help="time-to-loss mode: at most C steps per arm (also the schedule's length)")
    parser.add_argument("--reference", default="adams", help="time-to-loss mode: the arm that sets the target")
    parser.add_argument("--eval-every", type=int, default=0, help="validation every N steps (time-to-loss: default 5)")
    parser.add_argument("--eval-batches", type=int, default=1, help="micro-batches per rank per validation")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate of every arm (default: each optimizer config's own)")
    parser.add_argument("--lr-warmup", type=int, default=2, help="learning-rate warm-up steps")
    parser.add_argument("--wire-check", type=int, default=0, metavar="S",
                        help="wire mode: every arm runs --steps and S steps; the veth's transmitted bytes of "
                             "the steps between are checked against the trainer's counted bytes")
    parser.add_argument("--overhead-bound", type=float, default=0.10,
                        help="wire mode: transmitted bytes may exceed the counted ones by this fraction "
                             "(TCP/IP headers and acknowledgements), never fall below them")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--keep-runs", action="store_true", help="keep the run folders (in a temp dir)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if args.time_to_loss:
        args.eval_every = args.eval_every or 5
        if args.step_cap < args.time_to_loss:
            parser.error("--step-cap must be at least --time-to-loss")
        if args.time_to_loss % args.eval_every:
            parser.error(f"--time-to-loss {args.time_to_loss} must be a multiple of --eval-every "
                         f"{args.eval_every} (the target is a validation at that step)")
        if args.reference not in ARMS:
            parser.error(f"unknown --reference {args.reference!r}; choose from {', '.join(ARMS)}")
        args.steps = args.step_cap
    if args.wire_check and not 0 < args.wire_check < args.steps:
        parser.error("--wire-check S needs 0 < S < --steps (the check counts the steps between)")
    if args.wire_check and (args.time_to_loss or len(args.rates.split(",")) != 1):
        parser.error("--wire-check runs on one link: give one --rates value and no --time-to-loss")
    if args.ranks_per_host < 1:
        parser.error("--ranks-per-host must be at least 1")
    if "sma99_copy_per_host" in args.arms.split(",") and args.ranks_per_host < 2:
        parser.error("arm sma99_copy_per_host needs --ranks-per-host 2 or more (one rank per host is arm sma99)")
    if args.steps <= args.warmup and not args.wire_check:
        parser.error("--steps must exceed --warmup")
    return args


def speedups(entry: Dict[str, dict], arms: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """Per-step speed-up of every arm against each dense arm that ran."""
    return {f"speedup_vs_{dense}": {arm: round(entry[dense]["step_time_s"] / entry[arm]["step_time_s"], 2)
                                    for arm in arms if arm != dense}
            for dense in DENSE_ARMS if dense in entry}


def reference_target(records: List[dict], step: int, ref: str) -> tuple:
    """The reference's validation loss at ``step`` (the target) and its validation curve.

    A reference that has not trained (its loss at ``step`` not below the uniform predictor's
    ln V) would make every arm "reach" the target at once, so it is an error, not a result.
    """
    curve = [(int(r["step"]), round(float(r["val/loss"]), 4)) for r in records if "val/loss" in r]
    at_step = dict(curve)
    if step not in at_step:
        raise RuntimeError(f"the reference {ref} logged no validation loss at step {step}")
    uniform = math.log(VOCAB)
    if at_step[step] >= uniform:
        raise RuntimeError(
            f"the reference {ref} did not train: validation loss {at_step[step]:.4f} at step {step} "
            f"is not below the uniform predictor's ln({VOCAB}) = {uniform:.3f} (curve {curve}); "
            "lower --lr, lengthen --lr-warmup or raise --time-to-loss")
    return at_step[step], curve


def time_to_loss(link: LinkedNamespaces, args: argparse.Namespace, arms: Sequence[str], run_root: Path,
                 label: str) -> Dict[str, object]:
    """The reference's validation loss after S steps, and what every arm takes to reach it."""
    ref = args.reference
    reference = run_arm(link, ref, args, run_root, f"{label}-ttl",
                        extra=[f"train.stop_after_steps={args.time_to_loss}"])
    ref_records = reference.pop("records")
    target, ref_curve = reference_target(ref_records, args.time_to_loss, ref)
    reference_totals = totals_to(ref_records, args.time_to_loss)
    out: Dict[str, object] = {"target_val_loss": round(target, 4), "reference": ref,
                              "S": args.time_to_loss, "step_cap": args.step_cap,
                              ref: {"reached": True, **reference_totals,
                                    "val_loss": round(target, 4), "val_curve": ref_curve}}
    print(f"[bench] time-to-loss target: {ref} val loss {target:.4f} at step {args.time_to_loss}", flush=True)
    for arm in arms:
        if arm == ref:
            continue
        result = run_arm(link, arm, args, run_root, f"{label}-ttl", stop_at=target)
        records = result.pop("records")
        step = first_at_target(records, target)
        vals = [(int(r["step"]), float(r["val/loss"])) for r in records if "val/loss" in r]
        last = max(int(r["step"]) for r in records if "perf/step_time_s" in r)
        entry = {"reached": step is not None, **totals_to(records, step if step is not None else last),
                 "val_loss": round(dict(vals).get(step, vals[-1][1] if vals else float("nan")), 4),
                 "val_curve": vals}
        entry["wall_vs_reference"] = round(entry["train_wall_s"] / out[ref]["train_wall_s"], 3)  # type: ignore[index]
        entry["bytes_vs_reference"] = round(entry["bytes_per_rank"] / out[ref]["bytes_per_rank"], 4)  # type: ignore[index]
        out[arm] = entry
        print(f"[bench] time-to-loss {arm}: {json.dumps(entry)}", flush=True)
    return out


def wire_report(args: argparse.Namespace, argv: Optional[Sequence[str]], arms: List[dict]) -> dict:
    """docs/results/network_wire.json: counted and transmitted bytes per arm, and the bound."""
    return {"benchmark": "bench_network_wire",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python scripts/bench_network.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "link": f"veth pair between two network namespaces, {args.rates} (tc tbf on both ends; 'none' = "
                    f"unshaped), gloo over TCP, {args.ranks_per_host} rank(s) per namespace",
            "overhead_bound": args.overhead_bound,
            "method": f"bytes of steps {args.wire_check + 1}..{args.steps}: a run of {args.steps} steps minus one "
                      f"of {args.wire_check}; counted = the trainer's bytes_sent_per_rank, measured = "
                      "/sys/class/net/<veth>/statistics/tx_bytes of both ends / ranks",
            "model": {"d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len},
            "arms": arms, "all_within_bound": all(a["within_bound"] for a in arms)}


def run_rate(link: LinkedNamespaces, rate: str, args: argparse.Namespace, arms: List[str], run_root: Path) -> dict:
    """Every arm on the link shaped to ``rate``: timed, time-to-loss or wire-checked."""
    shaped = None if rate == "none" else rate
    link.shape(shaped, args.delay_ms)
    measured = link.measure_throughput(40 if shaped != "100mbit" else 12)
    entry: Dict[str, object] = {"measured_tcp_bits_per_s": round(measured)}
    print(f"[bench] link {rate}: one TCP stream measures {measured / 1e6:,.0f} Mbit/s", flush=True)
    if args.wire_check:
        entry["wire"] = wire_check(link, args, arms, run_root, rate)
        return entry
    if args.time_to_loss:
        entry["time_to_loss"] = time_to_loss(link, args, arms, run_root, rate)
        return entry
    for arm in arms:
        entry[arm] = run_arm(link, arm, args, run_root, rate)
        entry[arm].pop("records")
        print(f"[bench] {rate} {arm}: {json.dumps(entry[arm])}", flush=True)
    entry.update(speedups(entry, arms))  # type: ignore[arg-type]
    return entry


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench_network.py makes network namespaces and tc qdiscs: run it as root")
    signal.signal(signal.SIGTERM, _raise_on_signal)
    for arm in {*args.arms.split(","), *([args.reference] if args.time_to_loss else [])}:
        arm_overrides(arm)  # an arm this checkout cannot run fails before any namespace is made
    prepare_corpus(args)
    arms = args.arms.split(",")
    load_start = os.getloadavg()
    results: Dict[str, dict] = {}
    run_root = Path(tempfile.mkdtemp(prefix="bench_network_"))
    try:
        with LinkedNamespaces(str(os.getpid())) as link:
            for rate in args.rates.split(","):
                results[rate] = run_rate(link, rate, args, arms, run_root)
    finally:
        if not args.keep_runs:
            subprocess.run(["rm", "-rf", str(run_root)])
    sys.path.insert(0, str(REPO))
    from scripts.bench_io import emit_report

    if args.wire_check:
        report = wire_report(args, argv, results[args.rates]["wire"])
        emit_report(report, args.out)
        return 0 if report["all_within_bound"] else 1
    report = {
        "benchmark": "bench_network", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_network.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "backend": "gloo over a veth pair shaped by tc (tbf)",
                    "load_avg_1min_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)]},
        "model": {"d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len,
                  "tokens_per_rank_per_step": args.seq_len, "ranks": 2 * args.ranks_per_host,
                  "ranks_per_host": args.ranks_per_host, "delay_ms": args.delay_ms},
        "rates": results,
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
