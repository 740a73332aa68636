"""Benchmark the data pipeline and print JSON: tokenization tokens/s (per process and in all)
for several process counts, and the loader's tokens/s with its background prefetch.

    python scripts/bench_data.py                       # the embedded corpus
    python scripts/bench_data.py --paths ../shared/corpora/tinyshakespeare.txt --num-proc 1 2 4

The tokenizer is trained once (bpe_local) and reused from its tokenizer.json for every process
count, so the figures time tokenization, not tokenizer training.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from data import prepare  # noqa: E402  (not TokenLoader here: spawned tokenizer workers
#                                         re-import this script, and it would pull in torch)
from data.config import DataConfig, TokenizerConfig  # noqa: E402
from data.shards import read_manifest  # noqa: E402


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def bench_tokenization(base: DataConfig, cache: pathlib.Path, num_procs, vocab_size: int) -> list:
    trained = prepare(base, TokenizerConfig(name="bench_bpe", vocab_size=vocab_size))
    results = []
    for num_proc in num_procs:
        cfg = DataConfig(**{**vars(base), "num_proc": num_proc, "cache_dir": str(cache / f"np{num_proc}")})
        tok = TokenizerConfig(name="bench_bpe", kind="hf", path=str(trained / "tokenizer.json"))
        started = time.perf_counter()
        folder = prepare(cfg, tok)
        wall = time.perf_counter() - started
        manifest = read_manifest(folder)
        tokens = sum(s["num_tokens"] for s in manifest["splits"].values())
        results.append({"num_proc": num_proc, "tokens": tokens,
                        "tokenize_seconds": manifest["tokenize_seconds"],
                        "tokens_per_s": manifest["tokens_per_second"],
                        "tokens_per_s_per_process": manifest["tokens_per_second_per_process"],
                        "prepare_wall_seconds": round(wall, 2)})
    return results, trained


def bench_loader(folder: pathlib.Path, seq_len: int, micro_batch_size: int, batches: int,
                 prefetch: int) -> dict:
    from data import TokenLoader

    loader = TokenLoader(folder, "train", seq_len, micro_batch_size, rank=0, world_size=1, seed=0,
                         prefetch=prefetch)
    stream = loader.batches(0, accum_steps=1)
    next(stream)  # thread start-up is not steady-state throughput
    waits = []
    started = time.perf_counter()
    for _ in range(batches):
        t = time.perf_counter()
        x, y = next(stream)
        waits.append(time.perf_counter() - t)
    seconds = time.perf_counter() - started
    stream.close()
    tokens = batches * micro_batch_size * seq_len
    return {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "batches": batches,
            "prefetch": prefetch, "tokens_per_s": round(tokens / seconds),
            "mean_batch_ms": round(1000 * seconds / batches, 3),
            "max_wait_ms": round(1000 * max(waits), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="*", default=[], help="local files (default: the embedded corpus)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--num-proc", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--documents-per-piece", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--cache-dir", default=None, help="default: a temporary folder, removed after")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        cache = pathlib.Path(args.cache_dir or tmp)
        if args.paths:
            base = DataConfig(name="bench_local", source="local", paths=args.paths, text_field=args.text_field)
        else:
            base = DataConfig(name="bench_embedded", source="embedded", embedded_docstrings=True)
        base.cache_dir, base.documents_per_piece, base.num_proc = str(cache / "trained"), args.documents_per_piece, 1
        tokenization, folder = bench_tokenization(base, cache, args.num_proc, args.vocab_size)
        loader = bench_loader(folder, args.seq_len, args.micro_batch_size, args.batches, args.prefetch)
        corpus = "local: " + " ".join(args.paths) if args.paths else "embedded (pydoc_data topics + stdlib docstrings)"
        print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": _machine(),
                          "corpus": corpus, "tokenization": tokenization, "loader": loader}, indent=2))


if __name__ == "__main__":
    main()
