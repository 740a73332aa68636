"""A killed prepare resumes to identical shards; concurrent prepares of one folder agree."""
from __future__ import annotations

import pytest

from data import prepare
from data.shards import read_manifest

from .conftest import local_config, prepare_killed_at, small_bpe


def _shard_files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


@pytest.mark.parametrize("kill_at, num_proc", [("piece:3", 2), ("shard:2", 1)])
def test_killed_prepare_resumes_to_identical_shards(tmp_path, jsonl_corpus, kill_at, num_proc):
    reference = prepare(local_config(tmp_path / "ref", [jsonl_corpus], shard_tokens=800), small_bpe())

    cache = tmp_path / "killed"
    exit_code = prepare_killed_at(local_config(tmp_path, [jsonl_corpus], cache_dir=str(cache), shard_tokens=800,
                                               num_proc=num_proc), small_bpe(), kill_at)
    assert exit_code == -9
    folder = cache / "testcorpus-bpe_small"
    assert not (folder / "manifest.json").exists()
    done_pieces = list((folder / ".work").glob("*.json"))
    assert len(done_pieces) >= 3  # state.json + finished pieces survive the kill
    (folder / ".train-00000.bin.tmp-999999").write_bytes(b"\x01" * 5)  # as if killed mid-write

    resumed = prepare(local_config(tmp_path, [jsonl_corpus], cache_dir=str(cache), shard_tokens=800,
                                   num_proc=1), small_bpe())
    assert resumed == folder
    assert not (folder / ".work").exists() and not list(folder.glob(".*.tmp-*"))
    assert _shard_files(resumed) == _shard_files(reference) and len(_shard_files(reference)) > 2
    mine, theirs = read_manifest(resumed), read_manifest(reference)
    assert mine["splits"] == theirs["splits"] and mine["tokenizer_sha256"] == theirs["tokenizer_sha256"]


def _prepare_in_child(data_cfg, tok_cfg, results) -> None:
    from data import prepare
    from data.shards import read_manifest

    folder = prepare(data_cfg, tok_cfg)
    results.put(read_manifest(folder)["splits"])


def test_two_prepares_of_one_folder_at_once_agree(tmp_path, jsonl_corpus):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    cfg = local_config(tmp_path, [jsonl_corpus], shard_tokens=900)
    children = [ctx.Process(target=_prepare_in_child, args=(cfg, small_bpe(), results)) for _ in range(2)]
    for child in children:
        child.start()
    splits = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0, 0]
    assert splits[0] == splits[1] == read_manifest(prepare(cfg, small_bpe()))["splits"]


def test_a_corpus_without_validation_documents_is_refused_and_leaves_nothing(tmp_path):
    from data.errors import EmptyCorpusError
    from .conftest import make_documents, write_jsonl

    corpus = write_jsonl(tmp_path / "three.jsonl", make_documents(3))
    cfg = local_config(tmp_path, [corpus], val_fraction=0.001)
    with pytest.raises(EmptyCorpusError, match="no validation document.*raise data.val_fraction"):
        prepare(cfg, small_bpe())
    assert not (tmp_path / "cache" / "testcorpus-bpe_small").exists()
