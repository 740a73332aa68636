"""Autoregressive sampling through our own model (no HF generate, no KV cache).

Each step runs the model on the whole (window-cropped) sequence: O(T^2) per token, which is
plenty for inspecting a run's samples and keeps the numbers those of the training forward.
Temperature 0 is greedy (argmax) decoding; top_k keeps the k most likely tokens before sampling.
A torch.Generator makes a sample reproducible for a fixed seed on a given device.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch


def next_token_distribution(logits: torch.Tensor, temperature: float,
                            top_k: Optional[int]) -> torch.Tensor:
    """Probabilities of the next token from one position's logits [V] (fp32)."""
    if temperature <= 0:
        raise ValueError("temperature 0 is greedy decoding: take the argmax instead of sampling")
    scaled = logits.float() / temperature
    if top_k is not None and 0 < top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    return torch.softmax(scaled, dim=-1)


@torch.no_grad()
def iter_sampled_tokens(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                        temperature: float = 1.0, top_k: Optional[int] = None,
                        generator: Optional[torch.Generator] = None,
                        window: Optional[int] = None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` tokens one at a time, so a caller can stop on its own
    condition (an EOS id, a stop string) without decoding what it will throw away.

    ``window`` (default: the model's seq_len) crops the context to the most recent tokens once
    the sequence outgrows what the model was trained on.
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token (use the EOS id for an empty prompt)")
    window = window or model.cfg.seq_len
    device = next(model.parameters()).device
    sequence = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(sequence[-window:].unsqueeze(0))[0, -1]
        if temperature == 0:
            token = int(torch.argmax(logits).item())
        else:
            probs = next_token_distribution(logits, temperature, top_k)
            token = int(torch.multinomial(probs, 1, generator=generator).item())
        sequence = torch.cat([sequence, sequence.new_tensor([token])])
        yield token


def sample_tokens(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  temperature: float = 1.0, top_k: Optional[int] = None, seed: Optional[int] = None,
                  stop_token_ids: Sequence[int] = ()) -> List[int]:
    """The new tokens only (not the prompt); stops after emitting any of ``stop_token_ids``."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device)
        generator.manual_seed(seed)
    stop = set(stop_token_ids)
    new_tokens: List[int] = []
    for token in iter_sampled_tokens(model, prompt_ids, max_new_tokens, temperature, top_k, generator):
        new_tokens.append(token)
        if token in stop:
            break
    return new_tokens


def prompt_token_ids(tokenizer, prompt: str) -> List[int]:
    """The prompt's ids as the model saw text in training: documents start after an EOS, so an
    empty prompt is the EOS alone (and no BOS is added)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    return ids or [tokenizer.eos_token_id]
