"""Per-step wall time of dense AdamS against SCAPE over a rate-limited link (needs root).

    sudo python scripts/bench_network.py                            # 1 Gbit/s and 100 Mbit/s
    sudo python scripts/bench_network.py --rates 1gbit --steps 8 --out runs/net.json

Two ranks of train.py live in two network namespaces joined by a veth pair whose both ends are
shaped with a ``tc`` token bucket (egress of each end, so each direction gets the rate), and gloo
talks over that link only (MASTER_ADDR / GLOO_SOCKET_IFNAME inside the namespaces). So the
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
ADDRESS = {"a": "10.203.0.1", "b": "10.203.0.2"}

ARMS: Dict[str, List[str]] = {
    "adams": ["optimizer=adams"],
    "scape90": ["optimizer=scape", "optimizer.sparsity=0.9"],
    "scape99": ["optimizer=scape", "optimizer.sparsity=0.99"],
}


def model_overrides(args: argparse.Namespace) -> List[str]:
    """A wide, shallow Llama: many parameters (bytes to send) for few FLOPs per token."""
    return [
        "model=tiny_llama", f"model.n_layer={args.n_layer}", f"model.d_model={args.d_model}",
        f"model.n_head={args.n_head}", f"model.n_kv_head={args.n_head}", f"model.ffn_hidden={3 * args.d_model}",
        f"model.seq_len={args.seq_len}", "model.vocab_size=8192",
        "data=embedded", "data.embedded_docstrings=false", "data.name=bench_network",
        f"data.cache_dir={args.cache_dir}", "tokenizer.vocab_size=8192",
        f"train.steps={args.steps}", f"train.global_batch_tokens={2 * args.seq_len}", "train.micro_batch_size=1",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.ckpt_every=0",
        "train.keep_last=1", "optimizer.warmup_steps=2", "logger=console",
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


def run_arm(link: LinkedNamespaces, arm: str, args: argparse.Namespace, run_root: Path, label: str) -> dict:
    """One two-rank training run across the link; returns the per-step timing medians."""
    run_name = f"{label}-{arm}"
    overrides = [*model_overrides(args), *ARMS[arm], f"out_dir={run_root}", f"run_name={run_name}"]
    port = str(29500 + (os.getpid() % 400))
    procs, logs = [], []
    for rank, side in enumerate("ab"):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR=ADDRESS["a"],
                   MASTER_PORT=port, GLOO_SOCKET_IFNAME=link.dev[side], OMP_NUM_THREADS="1",
                   WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(["ip", "netns", "exec", link.ns[side], sys.executable, str(REPO / "train.py"),
                                 *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        sink: List[str] = []
        threading.Thread(target=_stream, args=(proc.stdout, sink), daemon=True).start()
        procs.append(proc)
        logs.append(sink)
    try:
        deadline = time.time() + args.timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{run_name}: exit codes {[p.returncode for p in procs]}; rank 0 said:\n"
                           + "".join(logs[0][-30:]) + "\nrank 1 said:\n" + "".join(logs[1][-15:]))
    records = [json.loads(line) for line in (run_root / run_name / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    timed = [r for r in records if "perf/step_time_s" in r and r["step"] > args.warmup]
    if not timed:
        raise RuntimeError(f"{run_name}: no step after the {args.warmup} warm-up steps was logged")

    def median(key: str) -> float:
        return round(statistics.median(float(r.get(key, 0.0)) for r in timed), 4)

    summary = json.loads((run_root / run_name / "summary.json").read_text())
    return {"parameters": summary.get("parameters"), "step_time_s": median("perf/step_time_s"), "fwd_bwd_s": median("perf/time_fwd_bwd_s"),
            "comm_s": median("perf/time_comm_s"), "opt_s": median("perf/time_opt_s"),
            "bytes_per_step": median("comm/bytes_total"), "steps_timed": len(timed),
            "step_times_s": [round(float(r["perf/step_time_s"]), 4) for r in timed]}


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
    parser.add_argument("--arms", default="adams,scape90,scape99", help=f"from {', '.join(ARMS)}")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added by netem")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per rank and step")
    parser.add_argument("--cache-dir", default=str(REPO / "cache" / "data"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--keep-runs", action="store_true", help="keep the run folders (in a temp dir)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench_network.py makes network namespaces and tc qdiscs: run it as root")
    signal.signal(signal.SIGTERM, _raise_on_signal)
    prepare_corpus(args)
    arms = args.arms.split(",")
    load_start = os.getloadavg()
    results: Dict[str, dict] = {}
    run_root = Path(tempfile.mkdtemp(prefix="bench_network_"))
    try:
        with LinkedNamespaces(str(os.getpid())) as link:
            for rate in args.rates.split(","):
                shaped = None if rate == "none" else rate
                link.shape(shaped, args.delay_ms)
                measured = link.measure_throughput(40 if shaped != "100mbit" else 12)
                entry: Dict[str, object] = {"measured_tcp_bits_per_s": round(measured)}
                print(f"[bench] link {rate}: one TCP stream measures {measured / 1e6:,.0f} Mbit/s", flush=True)
                for arm in arms:
                    entry[arm] = run_arm(link, arm, args, run_root, rate)
                    print(f"[bench] {rate} {arm}: {json.dumps(entry[arm])}", flush=True)
                if "adams" in entry:
                    dense = entry["adams"]["step_time_s"]  # type: ignore[index]
                    entry["speedup_vs_adams"] = {arm: round(dense / entry[arm]["step_time_s"], 2)  # type: ignore[index]
                                                 for arm in arms if arm != "adams"}
                results[rate] = entry
    finally:
        if not args.keep_runs:
            subprocess.run(["rm", "-rf", str(run_root)])
    report = {
        "benchmark": "bench_network", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_network.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "backend": "gloo over a veth pair shaped by tc (tbf)",
                    "load_avg_1min_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)]},
        "model": {"d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len,
                  "tokens_per_rank_per_step": args.seq_len, "ranks": 2, "delay_ms": args.delay_ms},
        "rates": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
