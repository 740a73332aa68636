"""Bad input: a clear message, a non-zero exit, and nothing overwritten."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data import TokenLoader, prepare
from data.errors import ShardChecksumError
from data.preparation import main
from data.shards import read_manifest

from .conftest import folder_snapshot, local_config, make_documents, run_prepare_cli, small_bpe, write_jsonl


def _cli(tmp_path, *extra):
    return ["data=local", "data.name=bad", f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1",
            "tokenizer.name=bpe_small", "tokenizer.vocab_size=300", *extra]


def _fails(capsys, argv, *phrases):
    assert main(argv) == 2
    message = capsys.readouterr().err
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_missing_path_is_a_clear_error_from_the_command(tmp_path):
    result = run_prepare_cli(_cli(tmp_path, f"data.paths=[{tmp_path / 'nope.jsonl'}]"))
    assert result.returncode == 2
    assert "matches no file" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()


def test_glob_matching_nothing_and_no_paths(tmp_path, capsys):
    _fails(capsys, _cli(tmp_path, f"data.paths=[{tmp_path}/*.parquet]"), "matches no file", "*.parquet")
    _fails(capsys, _cli(tmp_path), "needs data.paths")
    assert not (tmp_path / "cache").exists()


def test_empty_corpus(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "empty.jsonl", ["", "   ", "\n"])
    _fails(capsys, _cli(tmp_path, f"data.paths=[{corpus}]"), "no non-empty document")
    assert not (tmp_path / "cache").exists()


def test_wrong_text_field_names_the_fields_there_are(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(10), field="content")
    _fails(capsys, _cli(tmp_path, f"data.paths=[{corpus}]"), "no field 'text'", "['content', 'id']",
           "data.text_field")
    _fails(capsys, _cli(tmp_path, f"data.paths=[{corpus}]", "data.text_field=id"), "holds int")
    assert not (tmp_path / "cache").exists()


def test_unknown_key_and_unknown_group_option(tmp_path, capsys):
    _fails(capsys, _cli(tmp_path, "data.no_such_key=1"), "no_such_key")
    _fails(capsys, ["data=no_such_corpus", f"data.cache_dir={tmp_path}"], "no_such_corpus")
    # A tokenizer path with the default kind would be silently ignored by bpe_local training.
    _fails(capsys, _cli(tmp_path, "tokenizer.path=/some/tokenizer.json"), "tokenizer=local tokenizer.path=")
    assert not (tmp_path / "cache").exists()


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    paragraphs = make_documents(40, seed=3)
    raw = "\n\n".join(paragraphs).encode("utf-8")
    raw = raw.replace(b"doc5.", b"doc5 \xff\xfe.").replace(b"doc9.", b"doc9 \xc3.")  # 3 bad bytes
    (tmp_path / "bad.txt").write_bytes(raw)
    jsonl = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in make_documents(20, seed=4))
    (tmp_path / "bad.jsonl").write_bytes(jsonl.replace(b"doc2.", b"caf\xe9 doc2."))  # 1 bad byte
    folder = prepare(local_config(tmp_path, [tmp_path / "bad.txt", tmp_path / "bad.jsonl"]), small_bpe())
    manifest = read_manifest(folder)
    assert manifest["replacement_characters"] == 4
    assert manifest["splits"]["train"]["num_documents"] + manifest["splits"]["val"]["num_documents"] == 60


def test_shard_checksum_mismatch_is_refused_and_the_shard_kept(tmp_path, jsonl_corpus, capsys):
    argv = _cli(tmp_path, f"data.paths=[{jsonl_corpus}]", "data.val_fraction=0.2")
    assert main(argv) == 0
    folder = tmp_path / "cache" / "bad-bpe_small"
    shard = folder / "train-00000.bin"
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[10] ^= 1
    tokens.tofile(shard)
    before = folder_snapshot(folder)
    capsys.readouterr()
    _fails(capsys, argv, "train-00000.bin", "sha256", "Nothing was overwritten")
    assert folder_snapshot(folder) == before
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated
    _fails(capsys, argv, "truncated")
    with pytest.raises(ShardChecksumError, match="rerun prepare"):
        TokenLoader(folder, "train", 8, 1, 0, 1, seed=0)


def _big_vocab_tokenizer(folder, size: int = 70_000):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(size - 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(folder))
    return folder


def test_vocab_over_uint16_refused_when_uint16_asked_and_uint32_by_default(tmp_path, capsys):
    tokenizer_dir = _big_vocab_tokenizer(tmp_path / "big_tok")
    docs = [" ".join(f"w{(i * 7919 + j * 104729) % 69_998}" for j in range(30)) for i in range(40)]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    base = _cli(tmp_path, f"data.paths=[{corpus}]", "data.val_fraction=0.25", "tokenizer.name=big",
                "tokenizer.kind=hf", f"tokenizer.path={tokenizer_dir}")
    _fails(capsys, base + ["data.token_dtype=uint16"], "70000 tokens", "uint32")
    assert not (tmp_path / "cache").exists()

    assert main(base) == 0
    folder = tmp_path / "cache" / "bad-big"
    manifest = read_manifest(folder)
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_000 and manifest["eos_id"] == 1
    loader = TokenLoader(folder, "train", 8, 1, 0, 1, seed=0)
    stream = np.concatenate([loader.window(i)[:8] for i in range(loader.num_windows)])
    assert stream.max() > 65_535 and loader.vocab_size == 70_000
