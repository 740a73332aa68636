"""A changed tokenizer or corpus is refused with a message, and nothing is overwritten."""
from __future__ import annotations

import json

import pytest

from data import prepare
from data.errors import ConfigMismatchError, TokenizerMismatchError

from .conftest import folder_snapshot, local_config, prepare_killed_at, small_bpe


def test_changed_tokenizer_is_refused_and_nothing_is_overwritten(tmp_path, jsonl_corpus):
    cfg = local_config(tmp_path, [jsonl_corpus])
    folder = prepare(cfg, small_bpe())
    before = folder_snapshot(folder)
    with pytest.raises(TokenizerMismatchError, match="different tokenizer.*vocab_size: 300 then, 280 now"):
        prepare(cfg, small_bpe(vocab_size=280))
    with pytest.raises(ConfigMismatchError, match="val_fraction"):
        prepare(local_config(tmp_path, [jsonl_corpus], val_fraction=0.3), small_bpe())
    with jsonl_corpus.open("a") as f:
        f.write('{"text": "one more document"}\n')
    with pytest.raises(ConfigMismatchError, match="files"):
        prepare(cfg, small_bpe())
    assert folder_snapshot(folder) == before
    jsonl_corpus.write_text("".join(jsonl_corpus.read_text().splitlines(keepends=True)[:-1]))
    # Content-neutral settings (processes, piece size) reuse the folder as it is.
    assert prepare(local_config(tmp_path, [jsonl_corpus], num_proc=2, documents_per_piece=7), small_bpe()) == folder
    assert folder_snapshot(folder) == before


def test_changed_tokenizer_file_at_the_same_path_is_refused(tmp_path, jsonl_corpus):
    from data.tokenizer import save_tokenizer, train_bpe_tokenizer
    from .conftest import make_documents

    tokenizer_dir = tmp_path / "my_tokenizer"
    save_tokenizer(train_bpe_tokenizer(small_bpe(), iter(make_documents(50))), tokenizer_dir)
    tok_cfg = small_bpe(name="mine", kind="hf", path=str(tokenizer_dir))
    cfg = local_config(tmp_path, [jsonl_corpus])
    folder = prepare(cfg, tok_cfg)
    before = folder_snapshot(folder)
    save_tokenizer(train_bpe_tokenizer(small_bpe(vocab_size=290), iter(make_documents(50))), tokenizer_dir)
    with pytest.raises(TokenizerMismatchError, match="changed since"):
        prepare(cfg, tok_cfg)
    assert folder_snapshot(folder) == before


def test_resume_with_a_changed_tokenizer_is_refused(tmp_path, jsonl_corpus):
    cache = tmp_path / "cache"
    assert prepare_killed_at(local_config(tmp_path, [jsonl_corpus]), small_bpe(), "piece:2") == -9
    folder = cache / "testcorpus-bpe_small"
    before = folder_snapshot(folder)
    state = json.loads((folder / ".work" / "state.json").read_text())
    assert state["tokenizer"]["vocab_size"] == 300
    with pytest.raises(TokenizerMismatchError, match="Nothing was overwritten"):
        prepare(local_config(tmp_path, [jsonl_corpus], cache_dir=str(cache)), small_bpe(vocab_size=280))
    assert folder_snapshot(folder) == before
