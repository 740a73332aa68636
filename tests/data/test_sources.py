"""Sources (txt / jsonl.gz / parquet / globs / embedded), hub-style tokenizers from disk, configs."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from data import TokenLoader, load_tokenizer, prepare
from data.config import DataConfig, TokenizerConfig
from data.preparation import _split_overrides
from data.shards import read_manifest
from data.sources import iter_documents

from .conftest import REPO_ROOT, local_config, make_documents, small_bpe


def _documents(cfg: DataConfig):
    return [text for _, text in iter_documents(cfg)]


def test_txt_is_split_into_paragraphs_or_lines(tmp_path):
    paragraphs = make_documents(30, seed=2)
    (tmp_path / "a.txt").write_text("\n\n".join(p.replace(" doc", "\ndoc", 1) for p in paragraphs))
    by_paragraph = _documents(local_config(tmp_path, [tmp_path / "a.txt"], val_fraction=0.0))
    assert len(by_paragraph) == 30 and "\n" in by_paragraph[0]  # line breaks inside are kept
    by_line = _documents(local_config(tmp_path, [tmp_path / "a.txt"], val_fraction=0.0, txt_sample_by="line"))
    assert len(by_line) == 60


def test_parquet_glob_and_gzipped_jsonl_in_sorted_path_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_documents(30, seed=6)
    pq.write_table(pa.table({"body": docs[10:20], "n": list(range(10))}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"body": docs[:10], "n": list(range(10))}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs[20:])
    cfg = local_config(tmp_path, [tmp_path / "*.parquet", tmp_path / "c.jsonl.gz"], text_field="body",
                       val_fraction=0.0)
    assert _documents(cfg) == docs


def test_unknown_file_type_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(Exception, match="unknown file type '.csv'"):
        _documents(local_config(tmp_path, [tmp_path / "a.csv"]))


def test_hf_tokenizer_file_adding_bos_gives_eos_separated_documents_without_bos(tmp_path, jsonl_corpus, documents):
    from tokenizers import Tokenizer, processors

    plain = prepare(local_config(tmp_path, [jsonl_corpus]), small_bpe())
    backend = Tokenizer.from_file(str(plain / "tokenizer.json"))
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    backend.enable_truncation(max_length=6)  # settings for model inputs must not cut documents
    backend.save(str(tmp_path / "with_bos.json"))

    folder = prepare(local_config(tmp_path, [jsonl_corpus]),
                     TokenizerConfig(name="with_bos", kind="hf", path=str(tmp_path / "with_bos.json")))
    tokenizer = load_tokenizer(folder)
    assert tokenizer.encode(documents[0])[0] == bos  # the tokenizer itself adds BOS ...
    manifest = read_manifest(folder)
    loader = TokenLoader(folder, "train", 8, 1, 0, 1, seed=0)
    stream = np.concatenate([loader.window(i)[:8] for i in range(loader.num_windows)])
    assert bos not in stream  # ... the shards do not: documents are separated by EOS only
    assert manifest["eos_token"] == "<|endoftext|>" and manifest["vocab_size"] == len(tokenizer)
    first_doc = next(text for split, text in iter_documents(local_config(tmp_path, [jsonl_corpus])) if split == "train")
    expected = tokenizer.encode(first_doc, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(expected) > 6 and stream[:len(expected)].tolist() == expected


def test_every_data_and_tokenizer_config_fits_the_schema():
    for group, schema in (("data", DataConfig), ("tokenizer", TokenizerConfig)):
        files = sorted((REPO_ROOT / "conf" / group).glob("*.yaml"))
        assert len(files) >= 3
        for path in files:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path)))
            assert cfg.name == path.stem, path
    assert OmegaConf.load(REPO_ROOT / "conf/data/slimpajama6b.yaml").hf_val_split == "validation"
    assert OmegaConf.load(REPO_ROOT / "conf/data/fineweb.yaml").hf_name == "sample-10BT"
    assert OmegaConf.load(REPO_ROOT / "conf/tokenizer/llama2.yaml").vocab_size == 32000


def test_command_line_accepts_group_choices_dotted_and_bare_keys():
    groups, rest = _split_overrides(["data=local", "vocab_size=300", "data.num_proc=3", "val_fraction=0.2"])
    assert groups == ["+data=local", "+tokenizer=bpe_local"]
    assert rest == ["tokenizer.vocab_size=300", "data.num_proc=3", "data.val_fraction=0.2"]
    with pytest.raises(Exception, match="unknown key"):
        _split_overrides(["no_such_key=1"])


def test_embedded_corpus_is_the_python_docs_and_stdlib_docstrings():
    from data.embedded import embedded_documents

    topics = list(embedded_documents(include_docstrings=False))
    everything = list(embedded_documents(include_docstrings=True))
    assert len(topics) > 150 and sum(map(len, topics)) > 400_000
    assert everything[:len(topics)] == topics
    assert len(everything) > len(topics) + 200 and sum(map(len, everything)) > 1_500_000
    assert any(d.startswith("The \"for\" statement") for d in topics)


@pytest.mark.parametrize("streaming", [True, False])
def test_hub_code_path_on_a_local_dataset_folder_with_its_own_validation_split(tmp_path, monkeypatch, streaming):
    """data.source=hub runs datasets.load_dataset(hf_path, ...) as for a hub id; a local dataset
    folder exercises that very call (splits, streaming, max_documents) without the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    dataset_dir = tmp_path / "my_dataset"
    dataset_dir.mkdir()
    train, validation = make_documents(60, seed=8), make_documents(15, seed=9)
    (dataset_dir / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in train))
    (dataset_dir / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in validation))
    cfg = DataConfig(name="hubstyle", source="hub", hf_path=str(dataset_dir), hf_split="train",
                     hf_val_split="validation", max_documents=40, max_val_documents=10,
                     streaming=streaming, cache_dir=str(tmp_path / "cache"), num_proc=1)
    pairs = list(iter_documents(cfg))
    assert [t for s, t in pairs if s == "train"] == train[:40]
    assert [t for s, t in pairs if s == "val"] == validation[:10]
    manifest = read_manifest(prepare(cfg, small_bpe()))
    assert manifest["splits"]["train"]["num_documents"] == 40 and manifest["splits"]["val"]["num_documents"] == 10


def test_prepare_takes_a_dict_config_and_rejects_unknown_keys(tmp_path, jsonl_corpus):
    values = {"name": "fromdict", "source": "local", "paths": [str(jsonl_corpus)], "val_fraction": 0.2,
              "cache_dir": str(tmp_path / "cache"), "num_proc": 1}
    folder = prepare(OmegaConf.create(values), OmegaConf.create({"name": "bpe_small", "vocab_size": 300}))
    assert folder.name == "fromdict-bpe_small" and read_manifest(folder)["vocab_size"] <= 300
    with pytest.raises(Exception, match="unknown DataConfig keys \\['val_fractoin'\\]"):
        prepare({**values, "val_fractoin": 0.1}, small_bpe())
