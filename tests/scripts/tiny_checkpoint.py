"""A debug-size trained checkpoint in the trainer's format, made in a second or two.

A BPE tokenizer is trained on a handful of sentences and a 2-block Llama is fitted to them for
a few dozen steps, so its next-token distributions are peaked (a random model's near-uniform
ones would hide an off-by-one position in scoring or decoding).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List

import torch

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the sun is hot and the moon is cold",
    "birds fly over the green hills",
    "we drink water when we are thirsty",
]
EOS = "<|endoftext|>"


def _train_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(SENTENCES * 10, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))  # tokenizer.json + tokenizer_config.json, as prepare does
    return tokenizer


def _stream(tokenizer) -> List[int]:
    ids: List[int] = []
    for sentence in SENTENCES:
        ids += [tokenizer.eos_token_id] + tokenizer.encode(sentence)
    return ids


def make_tiny_checkpoint(root: Path, steps: int = 60) -> Path:
    """``root/run/step-<steps>`` (model.safetensors + meta.json naming ``root/prepared``'s
    tokenizer); returns the step folder."""
    from core.checkpoint import write_model_folder
    from models import build_model, load_model_config

    tokenizer = _train_tokenizer(root / "prepared")
    cfg = load_model_config("tiny_llama")
    cfg = dataclasses.replace(cfg, n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_hidden=128,
                              vocab_size=320, seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg)
    stream = torch.tensor(_stream(tokenizer))
    windows = torch.stack([stream.roll(-shift)[:33] for shift in range(0, len(stream), 3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(windows[:, :-1], windows[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    meta = {"step": steps, "tokenizer_path": str(root / "prepared" / "tokenizer.json"),
            "config": {"run_name": "tiny_eval", "model": dataclasses.asdict(cfg),
                       "logger": {"wandb": "disabled", "project": "scape-sdp"}}}
    return write_model_folder(root / "run" / f"step-{steps}", model.state_dict(), meta)


def write_choice_task(folder: Path, name: str, dataset_lines: str) -> None:
    """An lm-eval multiple-choice task YAML (question / choices / label) over ``dataset_lines``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(dataset_lines + f"""
task: {name}
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
