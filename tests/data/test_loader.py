"""TokenLoader: determinism, exact resume, rank disjointness, fixed eval batches, clean shutdown."""
from __future__ import annotations

import gc
import itertools
import threading
import time

import numpy as np
import pytest
import torch

from data import TokenLoader, prepare
from tests.dist_helpers import run_distributed

from .conftest import local_config, make_documents, small_bpe, write_jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    corpus = write_jsonl(tmp / "corpus.jsonl", make_documents(150, seed=1))
    return prepare(local_config(tmp, [corpus], shard_tokens=900), small_bpe())


def _take(loader: TokenLoader, start_step: int, accum: int, count: int):
    stream = loader.batches(start_step, accum)
    items = list(itertools.islice(stream, count))
    stream.close()
    return items


def _same(a, b) -> bool:
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def test_same_seed_same_stream_other_seed_other_stream(prepared):
    make = lambda seed, prefetch=4: TokenLoader(prepared, "train", 12, 3, 0, 1, seed, prefetch=prefetch)
    first, again = _take(make(7), 0, 2, 10), _take(make(7), 0, 2, 10)
    assert _same(first, again)
    assert _same(first, _take(make(7, prefetch=0), 0, 2, 10))  # the thread changes nothing
    assert not _same(first, _take(make(8), 0, 2, 10))


def test_resume_at_a_step_gives_what_the_uninterrupted_run_saw(prepared):
    loader = TokenLoader(prepared, "train", 12, 3, 1, 2, seed=3)
    accum = 2
    # Long enough to cross an epoch boundary (windows per epoch / samples per step).
    steps = loader.num_windows // (3 * 2 * accum) + 3
    uninterrupted = _take(loader, 0, accum, steps * accum)
    for resume_step in (1, steps - 2):
        resumed = _take(TokenLoader(prepared, "train", 12, 3, 1, 2, seed=3), resume_step, accum, 2 * accum)
        assert _same(resumed, uninterrupted[resume_step * accum:(resume_step + 2) * accum])


def test_epochs_are_reshuffled_and_cover_every_window(prepared):
    loader = TokenLoader(prepared, "train", 12, 1, 0, 1, seed=0)
    n = loader.num_windows
    epoch0 = [loader.sample_windows(s, 0, 1)[0] for s in range(n)]
    epoch1 = [loader.sample_windows(s, 0, 1)[0] for s in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1


def _ranks_draw_disjoint_samples(rank: int, world: int, folder: str) -> None:
    import torch.distributed as dist

    loader = TokenLoader(folder, "train", 12, 2, rank, world, seed=11)
    accum, steps = 2, 6
    stream = loader.batches(0, accum)
    mine = []
    for step in range(steps):
        for micro in range(accum):
            x, y = next(stream)
            windows = loader.sample_windows(step, micro, accum)
            expected = np.stack([loader.window(i) for i in windows])
            assert np.array_equal(x.numpy(), expected[:, :-1]) and np.array_equal(y.numpy(), expected[:, 1:])
            mine.append((step, windows))
    stream.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    for step in range(steps):
        drawn = [w for per_rank in everyone for s, ws in per_rank if s == step for w in ws]
        assert len(drawn) == len(set(drawn)) == world * accum * 2, f"ranks share a sample at step {step}"
    evals = [None] * world
    dist.all_gather_object(evals, [x.tolist() for x, _ in loader.eval_batches(2)])
    rows = [tuple(row) for per_rank in evals for batch in per_rank for row in batch]
    assert len(rows) == len(set(rows)), "eval batches overlap across ranks"


def test_two_ranks_draw_disjoint_samples(prepared):
    run_distributed(_ranks_draw_disjoint_samples, world_size=2, args=(str(prepared),))


def test_eval_batches_are_fixed_and_disjoint_across_ranks(prepared):
    loaders = [TokenLoader(prepared, "val", 8, 2, r, 2, seed=r) for r in range(2)]
    batches = [loader.eval_batches(2) for loader in loaders]
    assert all(len(b) == 2 for b in batches)
    again = TokenLoader(prepared, "val", 8, 2, 0, 2, seed=99).eval_batches(2)  # seed-independent
    assert _same(batches[0], again)
    rows = [tuple(row.tolist()) for per_rank in batches for x, _ in per_rank for row in x]
    assert len(rows) == len(set(rows))
    # Asking for more than the split holds returns fewer batches instead of repeating windows.
    most = loaders[0].num_windows // 4
    with pytest.warns(UserWarning, match="evaluation batches"):
        assert len(loaders[0].eval_batches(most + 5)) == most


def _loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("TokenLoader-")]


def _wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_prefetch_thread_ends_when_the_generator_is_dropped_or_closed(prepared):
    loader = TokenLoader(prepared, "train", 12, 2, 0, 1, seed=0, prefetch=2)
    before = len(_loader_threads())
    stream = loader.batches(0, 1)
    next(stream)
    assert len(_loader_threads()) == before + 1
    del stream
    gc.collect()
    assert _wait_until(lambda: len(_loader_threads()) == before)
    stream = loader.batches(0, 1)
    next(stream)
    loader.close()
    assert _wait_until(lambda: len(_loader_threads()) == before)
    assert len(list(stream)) <= 2  # the stream ends (after what was prefetched) instead of hanging
    assert len(_loader_threads()) == before


def test_a_split_shorter_than_one_window_is_refused(prepared):
    with pytest.raises(Exception, match="fewer than one window"):
        TokenLoader(prepared, "val", 10**7, 1, 0, 1, seed=0)


def _step_samples(loader_for, world: int, micro_batch: int, accum: int, step: int, origin_step: int,
                  first_sample: int):
    """The windows every rank of a ``world``-rank run draws at ``step``, resumed at ``origin_step``
    after ``first_sample`` samples (through ``batches``, as the trainer reads them)."""
    drawn = []
    for rank in range(world):
        loader = loader_for(rank, world, micro_batch)
        stream = loader.batches(origin_step, accum, first_sample=first_sample)
        for _ in range((step - origin_step) * accum):
            next(stream)
        for _ in range(accum):
            x, _ = next(stream)
            drawn.extend(tuple(row) for row in x.tolist())
        stream.close()
    return sorted(drawn)


def test_a_run_continued_on_another_world_size_neither_repeats_nor_skips(prepared):
    """The position is the samples consumed: 2 ranks stopped at step 3 and continued on 1 or 4
    ranks (the same global batch of 8 windows, split differently) read what the 2-rank run would
    have read at every later step, and the samples consumed so far never again in this epoch."""
    make = lambda rank, world, mb: TokenLoader(prepared, "train", 12, mb, rank, world, seed=5, prefetch=0)  # noqa: E731
    stop = 3
    consumed = stop * 8
    for world, micro_batch, accum in ((1, 4, 2), (4, 2, 1)):
        for step in (stop, stop + 1):
            continued = _step_samples(make, world, micro_batch, accum, step, stop, consumed)
            straight = _step_samples(make, 2, 2, 2, step, 0, 0)
            assert continued == straight, (world, step)
    before = {tuple(w) for s in range(stop) for w in _step_samples(make, 2, 2, 2, s, 0, 0)}
    after = set(_step_samples(make, 4, 2, 1, stop, stop, consumed))
    assert not before & after
    # Counted in samples, not steps: a continuation with half the global batch reads the 2-rank
    # run's step 3 over its steps 3 and 4.
    halves = _step_samples(make, 1, 4, 1, stop, stop, consumed) + _step_samples(make, 1, 4, 1, stop + 1, stop, consumed)
    assert sorted(halves) == _step_samples(make, 2, 2, 2, stop, 0, 0)
    with pytest.raises(ValueError, match="first_sample"):
        next(make(0, 1, 4).batches(0, 1, first_sample=-1))
