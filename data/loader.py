"""The training/validation loader over memory-mapped token shards.

A sample is a window of seq_len+1 consecutive tokens starting at a multiple of seq_len in the
split's token stream (x = window[:-1], y = window[1:]). The global sample number of
(step, micro, rank, row) is ((step * accum + micro) * world + rank) * micro_batch + row; epoch
``e`` visits the windows in a permutation seeded by (seed, e). So what a rank sees is a pure
function of (seed, step, micro, rank, world_size): resuming at step s is just starting the
count at s, ranks never share a sample within an epoch, and no loader state needs saving.

The position a run has reached is the number of samples (windows; tokens / seq_len) consumed, not
a per-rank index: ``batches(start_step, accum, first_sample=...)`` counts from that sample on, so
a run continued on another number of ranks (or another micro-batch split of the same global
batch) reads every later sample exactly once, none repeated and none skipped.
"""
from __future__ import annotations

import bisect
import os
import pathlib
import queue
import threading
import warnings
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch

from .errors import DataPipelineError, MissingPathError
from .shards import MANIFEST_NAME, open_shards, read_manifest

Batch = Tuple[torch.Tensor, torch.Tensor]


class _ProducerFailure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class TokenLoader:
    def __init__(self, prepared_dir: "str | os.PathLike", split: str, seq_len: int,
                 micro_batch_size: int, rank: int, world_size: int, seed: int,
                 prefetch: int = 4) -> None:
        folder = pathlib.Path(prepared_dir)
        if not (folder / MANIFEST_NAME).is_file():
            raise MissingPathError(f"{folder} has no {MANIFEST_NAME}; run data.prepare first")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError("seq_len and micro_batch_size must be positive")
        manifest = read_manifest(folder)
        if split not in manifest["splits"]:
            raise DataPipelineError(f"{folder} has no split {split!r}; it has {sorted(manifest['splits'])}")
        self.prepared_dir = folder
        self.split, self.seq_len, self.micro_batch_size = split, seq_len, micro_batch_size
        self.rank, self.world_size, self.seed, self.prefetch = rank, world_size, seed, prefetch
        self.vocab_size: int = manifest["vocab_size"]
        self.eos_id: int = manifest["eos_id"]
        self._shards = open_shards(folder, manifest, split)
        self._shard_starts = np.cumsum([0] + [s.size for s in self._shards]).tolist()
        self.num_tokens: int = int(self._shard_starts[-1])
        self.num_windows: int = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_windows < 1:
            raise DataPipelineError(
                f"the {split} split of {folder} has {self.num_tokens} tokens, fewer than one window "
                f"of seq_len+1={seq_len + 1}; use a shorter seq_len or more data")
        self._orders: Dict[int, np.ndarray] = {}
        self._order_lock = threading.Lock()
        self._eval_cache: Dict[int, List[Batch]] = {}
        self._stops: "set[threading.Event]" = set()

    # --- the pure functions -------------------------------------------------------------------
    def window(self, index: int) -> np.ndarray:
        """Tokens [index*seq_len, index*seq_len + seq_len + 1), across a shard boundary if need be."""
        start, end = index * self.seq_len, index * self.seq_len + self.seq_len + 1
        shard = bisect.bisect_right(self._shard_starts, start) - 1
        parts = []
        while start < end:
            offset = start - self._shard_starts[shard]
            take = min(end - start, self._shards[shard].size - offset)
            parts.append(self._shards[shard][offset:offset + take])
            start += take
            shard += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        with self._order_lock:
            if epoch not in self._orders:
                if len(self._orders) >= 2:
                    self._orders.pop(min(self._orders))
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
                # int32 halves the resident order (9B tokens at seq 1024: 35 MB instead of 70 MB).
                self._orders[epoch] = order.astype(np.int32) if self.num_windows < 2**31 else order
            return self._orders[epoch]

    def samples_per_step(self, accum_steps: int) -> int:
        """Samples (windows) one optimizer step consumes over all ranks."""
        return accum_steps * self.world_size * self.micro_batch_size

    def sample_windows(self, step: int, micro: int, accum_steps: int,
                       origin: Tuple[int, int] = (0, 0)) -> List[int]:
        """The window indices of this rank's micro-batch ``micro`` of optimizer step ``step``.

        ``origin`` = (a step, the global samples consumed before it): the count starts there (a
        resumed run's position); (0, 0) is a run from the start."""
        origin_step, origin_sample = origin
        first = origin_sample + (((step - origin_step) * accum_steps + micro) * self.world_size
                                 + self.rank) * self.micro_batch_size
        windows = []
        for sample in range(first, first + self.micro_batch_size):
            epoch, position = divmod(sample, self.num_windows)
            windows.append(int(self._epoch_order(epoch)[position]))
        return windows

    def _batch_of(self, windows: List[int]) -> Batch:
        rows = torch.from_numpy(np.stack([self.window(i) for i in windows]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def micro_batch(self, step: int, micro: int, accum_steps: int,
                    origin: Tuple[int, int] = (0, 0)) -> Batch:
        return self._batch_of(self.sample_windows(step, micro, accum_steps, origin))

    # --- training stream ----------------------------------------------------------------------
    def batches(self, start_step: int, accum_steps: int, first_sample: "int | None" = None) -> Iterator[Batch]:
        """accum_steps micro-batches per step from ``start_step`` on, endlessly, prefetched.

        ``first_sample``: the global samples consumed before ``start_step`` (a resumed run's
        position, from its tokens consumed); default ``start_step`` steps of this loader's size."""
        if accum_steps < 1 or start_step < 0:
            raise ValueError("accum_steps must be positive and start_step non-negative")
        if first_sample is None:
            first_sample = start_step * self.samples_per_step(accum_steps)
        if first_sample < 0:
            raise ValueError(f"first_sample must be non-negative, got {first_sample}")
        origin = (start_step, int(first_sample))
        if self.prefetch <= 0:
            step = start_step
            while True:
                for micro in range(accum_steps):
                    yield self.micro_batch(step, micro, accum_steps, origin)
                step += 1
        stop = threading.Event()
        ready: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        # The thread holds the loader, the queue and the event, never this generator, so a
        # dropped generator is collected, its finally sets the event and the thread ends.
        thread = threading.Thread(target=self._produce, args=(start_step, accum_steps, origin, ready, stop),
                                  name=f"TokenLoader-{self.split}-rank{self.rank}", daemon=True)
        self._stops.add(stop)
        thread.start()
        try:
            while True:
                try:
                    item = ready.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():  # close() was called: end the stream instead of hanging
                        return
                    continue
                if isinstance(item, _ProducerFailure):
                    raise item.error
                yield item
        finally:
            stop.set()
            self._stops.discard(stop)
            thread.join(timeout=5.0)

    def _produce(self, step: int, accum_steps: int, origin: Tuple[int, int], ready: "queue.Queue",
                 stop: threading.Event) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            while True:
                for micro in range(accum_steps):
                    if not put(self.micro_batch(step, micro, accum_steps, origin)):
                        return
                step += 1
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            put(_ProducerFailure(error))

    def close(self) -> None:
        """Stop every prefetch thread this loader started (also happens when a generator is dropped)."""
        for stop in list(self._stops):
            stop.set()
        self._stops.clear()

    # --- validation ---------------------------------------------------------------------------
    def eval_batches(self, num_batches: int) -> List[Batch]:
        """Windows spread evenly over the split, disjoint across ranks, the same on every call.

        If the split is too small for num_batches on every rank, fewer batches are returned
        (the same number on every rank) rather than repeating windows.
        """
        if num_batches in self._eval_cache:
            return self._eval_cache[num_batches]
        per_batch = self.world_size * self.micro_batch_size
        available = self.num_windows // per_batch
        if available < 1:
            raise DataPipelineError(
                f"the {self.split} split has {self.num_windows} windows of {self.seq_len + 1} tokens, "
                f"fewer than one batch for each of {self.world_size} ranks ({per_batch} windows); "
                f"use a shorter seq_len, a smaller micro batch or a larger val_fraction")
        count = min(num_batches, available)
        if count < num_batches:
            warnings.warn(f"the {self.split} split has room for {count} evaluation batches per rank, "
                          f"not {num_batches}; using {count}", stacklevel=2)
        needed = count * per_batch
        spread = [k * self.num_windows // needed for k in range(needed)]
        batches = []
        for j in range(count):
            first = (j * self.world_size + self.rank) * self.micro_batch_size
            batches.append(self._batch_of(spread[first:first + self.micro_batch_size]))
        self._eval_cache[num_batches] = batches
        return batches
