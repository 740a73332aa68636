"""scripts/generate.py: greedy decoding is our model's argmax chain, a fixed seed fixes the text
(across processes too), and top-k / temperature act as documented."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loaded(checkpoint: Path):
    from evaluation.checkpoint import load_checkpoint_for_inference

    return load_checkpoint_for_inference(checkpoint, device="cpu")


def _generate_cli(args: List[str]) -> List[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "scripts/generate.py", "json=true", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _argmax_chain(model, ids: List[int], steps: int) -> List[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def test_cli_greedy_and_seeded_samples(checkpoint: Path, loaded) -> None:
    from evaluation.sampling import sample_tokens

    greedy, = _generate_cli([f"checkpoint={checkpoint}", "prompt=the cat", "temperature=0",
                             "max_new_tokens=12", "stop_at_eos=false", "device=cpu"])
    prompt_ids = loaded.tokenizer.encode("the cat", add_special_tokens=False)
    assert greedy["prompt_ids"] == prompt_ids
    assert prompt_ids + greedy["new_ids"] == _argmax_chain(loaded.model, prompt_ids, 12)
    assert greedy["completion"].startswith(" sat on the mat")  # what the fitted model learned

    seeded = _generate_cli([f"checkpoint={checkpoint}", "prompt=", "temperature=1.5", "top_k=50",
                            "max_new_tokens=15", "seed=7", "num_samples=2", "stop_at_eos=false",
                            "device=cpu"])
    eos = [loaded.tokenizer.eos_token_id]
    assert [s["prompt_ids"] for s in seeded] == [eos, eos]  # an empty prompt starts a document
    for sample, seed in zip(seeded, (7, 8)):
        assert sample["new_ids"] == sample_tokens(loaded.model, eos, 15, temperature=1.5, top_k=50,
                                                  seed=seed)
    assert seeded[0]["new_ids"] != seeded[1]["new_ids"]


def test_temperature_and_top_k(loaded) -> None:
    from evaluation.sampling import next_token_distribution, sample_tokens

    model, eos = loaded.model, [loaded.tokenizer.eos_token_id]
    greedy = sample_tokens(model, eos, 20, temperature=0)
    assert eos + greedy == _argmax_chain(model, eos, 20)
    assert sample_tokens(model, eos, 20, temperature=1.0, top_k=1, seed=3) == greedy
    assert sample_tokens(model, eos, 20, temperature=1e-4, seed=3) == greedy
    draws = {tuple(sample_tokens(model, eos, 20, temperature=2.0, seed=s)) for s in range(4)}
    assert len(draws) > 1 and sample_tokens(model, eos, 20, temperature=2.0, seed=0) in map(list, draws)

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    probs = next_token_distribution(logits, temperature=1.0, top_k=2)
    assert probs[2:].eq(0).all() and torch.allclose(probs[:2], torch.softmax(logits[:2], 0))
    hot = next_token_distribution(logits, temperature=10.0, top_k=None)
    assert hot.max() - hot.min() < torch.softmax(logits, 0).max() - torch.softmax(logits, 0).min()


def test_stops_at_eos_and_crops_to_the_window(loaded) -> None:
    from evaluation.sampling import sample_tokens

    model, tokenizer = loaded.model, loaded.tokenizer
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("the cat sat on the", add_special_tokens=False)
    stopped = sample_tokens(model, prompt, 30, temperature=0, stop_token_ids=[eos])
    assert stopped[-1] == eos and eos not in stopped[:-1]
    # Past seq_len=64 tokens the model sees only the latest 64: generation goes on regardless.
    long_prompt = tokenizer.encode(" ".join(["a dog ran in the park"] * 15), add_special_tokens=False)
    assert len(long_prompt) > model.cfg.seq_len
    continued = sample_tokens(model, long_prompt, 5, temperature=0)
    assert continued == sample_tokens(model, long_prompt[-model.cfg.seq_len:], 5, temperature=0)
