"""prepare -> shards -> loader gives back exactly the token stream of the documents."""
from __future__ import annotations

import numpy as np

from data import TokenLoader, load_tokenizer, prepare
from data.config import DataConfig, TokenizerConfig
from data.shards import read_manifest
from data.sources import is_held_out

from .conftest import local_config, small_bpe


def _expected_stream(tokenizer, documents, split, val_fraction):
    stream = []
    for index, doc in enumerate(documents):
        if ("val" if is_held_out(index, val_fraction) else "train") == split:
            stream.extend(tokenizer.encode(doc, add_special_tokens=False))
            stream.append(tokenizer.eos_token_id)
    return np.array(stream, dtype=np.int64)


def test_roundtrip_gives_back_the_exact_token_stream(tmp_path, documents, jsonl_corpus):
    cfg = local_config(tmp_path, [jsonl_corpus], shard_tokens=700)  # several shards per split
    folder = prepare(cfg, small_bpe())
    manifest = read_manifest(folder)
    tokenizer = load_tokenizer(folder)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == len(tokenizer) <= 300
    assert len(manifest["splits"]["train"]["shards"]) > 1
    for split in ("train", "val"):
        expected = _expected_stream(tokenizer, documents, split, cfg.val_fraction)
        assert manifest["splits"][split]["num_tokens"] == expected.size > 0
        loader = TokenLoader(folder, split, seq_len=16, micro_batch_size=2, rank=0, world_size=1, seed=0)
        assert loader.num_tokens == expected.size
        assert loader.eos_id == tokenizer.eos_token_id and loader.vocab_size == len(tokenizer)
        # Windows tile the stream: window i covers [16 i, 16 i + 17), across shard boundaries.
        rebuilt = np.concatenate([loader.window(i)[:16] for i in range(loader.num_windows)])
        np.testing.assert_array_equal(rebuilt, expected[: rebuilt.size])
        np.testing.assert_array_equal(loader.window(loader.num_windows - 1)[-1], expected[16 * loader.num_windows])
    # EOS separates documents: one per document.
    assert int((_expected_stream(tokenizer, documents, "train", cfg.val_fraction) == tokenizer.eos_token_id).sum()) \
        == manifest["splits"]["train"]["num_documents"]


def test_one_epoch_of_batches_visits_every_window_once(tmp_path, jsonl_corpus):
    folder = prepare(local_config(tmp_path, [jsonl_corpus]), small_bpe())
    loader = TokenLoader(folder, "train", seq_len=8, micro_batch_size=3, rank=0, world_size=1, seed=5)
    batches = loader.batches(start_step=0, accum_steps=1)
    steps = loader.num_windows // 3
    indices = []
    for step in range(steps):
        x, y = next(batches)
        assert x.shape == y.shape == (3, 8)
        assert bool((x[:, 1:] == y[:, :-1]).all())
        windows = loader.sample_windows(step, 0, 1)
        expected = np.stack([loader.window(i) for i in windows])
        np.testing.assert_array_equal(x.numpy(), expected[:, :-1])
        np.testing.assert_array_equal(y.numpy(), expected[:, 1:])
        indices.extend(windows)
    batches.close()
    assert len(indices) == len(set(indices)) == 3 * steps  # no window twice within the epoch
    assert set(indices) <= set(range(loader.num_windows))


def test_embedded_default_prepares_offline_and_is_reused(tmp_path):
    data_cfg = DataConfig(cache_dir=str(tmp_path), val_fraction=0.1)
    folder = prepare(data_cfg, TokenizerConfig())
    manifest = read_manifest(folder)
    assert folder.name == "embedded-bpe_local"
    assert (folder / "tokenizer.json").is_file()
    assert 4096 < manifest["vocab_size"] <= 8192 and manifest["dtype"] == "uint16"
    assert manifest["splits"]["train"]["num_tokens"] > 80_000
    assert manifest["splits"]["val"]["num_tokens"] > 5_000
    before = (folder / "train-00000.bin").stat().st_mtime_ns
    assert prepare(data_cfg, TokenizerConfig()) == folder
    assert (folder / "train-00000.bin").stat().st_mtime_ns == before  # reused, not rewritten
    tokenizer = load_tokenizer(folder)
    text = "for item in items:\n    print(item)"
    assert tokenizer.decode(tokenizer.encode(text)) == text
