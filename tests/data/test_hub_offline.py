"""The hub code paths are real; offline they fail fast with a message naming the offline options."""
from __future__ import annotations

import os
import subprocess
import sys

from .conftest import REPO_ROOT, make_documents, write_jsonl

_SCRIPT = """
import sys
from data.preparation import main
cache = sys.argv[1]
corpus = sys.argv[2]
print("RC", main(["data=openwebtext", "data.cache_dir=" + cache]), flush=True)
print("RC", main(["data=slimpajama6b", "tokenizer=llama2", "data.cache_dir=" + cache]), flush=True)
print("RC", main(["data=local", "data.paths=[" + corpus + "]", "tokenizer=gpt2", "data.cache_dir=" + cache]), flush=True)
"""


def test_hub_datasets_and_tokenizers_offline_say_so(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_documents(20))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "cache"), str(corpus)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.stdout.split().count("RC") == 3, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("RC")] == ["RC 2"] * 3
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, result.stderr[-3000:]
    dataset_error, llama_error, tokenizer_error = errors
    assert "Skylion007/openwebtext" in dataset_error
    assert "DKYoon/SlimPajama-6B" in llama_error  # the dataset is probed before the tokenizer
    assert "tokenizer 'gpt2'" in tokenizer_error
    for error in errors:
        assert "hub is unreachable" in error
        for option in ("data=embedded", "data=local", "tokenizer=bpe_local", "HF_DATASETS_OFFLINE"):
            assert option in error
    assert not (tmp_path / "cache").exists()


def test_network_failures_are_told_apart_from_other_loading_errors():
    from data.errors import looks_like_network_failure

    def chained(outer: Exception, inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception as cause:
                raise outer from cause
        except Exception as exc:
            return exc

    assert looks_like_network_failure(chained(OSError("We couldn't load the files"), ConnectionError("DNS")))
    assert looks_like_network_failure(ValueError("Couldn't reach 'x/y' on the Hub (OfflineModeIsEnabled)"))
    assert not looks_like_network_failure(OSError("gpt3 is not a valid model identifier listed on the hub"))
    assert not looks_like_network_failure(ValueError("Unknown split 'valid'. Should be one of ['train']"))
