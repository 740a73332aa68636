"""Exact top-k by magnitude, fast for the small k of 90-99% sparsity.

``torch.topk`` with k in the hundreds of thousands is a partial sort of the whole partition. A
threshold from a strided sample keeps about 2k candidates with one comparison pass; top-k of the
candidates is then the exact top-k of the whole (every element above the k-th largest passes the
threshold whenever at least k do). When the sample misjudges, the full ``torch.topk`` runs, so the
answer never depends on the sample.
"""
from __future__ import annotations

import torch

SAMPLE_SIZE = 1 << 16
CANDIDATE_FACTOR = 2.0


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest entries of ``score`` (already |.|)."""
    n = score.numel()
    if k >= n:
        return torch.arange(n, device=score.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    indices = None
    if CANDIDATE_FACTOR * k < 0.25 * n and n > 4 * SAMPLE_SIZE:
        sample = score[:: n // SAMPLE_SIZE]
        rank_in_sample = int(sample.numel() * (1.0 - CANDIDATE_FACTOR * k / n))
        threshold = torch.kthvalue(sample, max(1, rank_in_sample)).values
        candidates = torch.nonzero(score >= threshold).squeeze(1)
        if candidates.numel() >= k:
            chosen = torch.topk(score.index_select(0, candidates), k, sorted=False).indices
            indices = candidates.index_select(0, chosen)
    if indices is None:
        indices = torch.topk(score, k, sorted=False).indices
    return torch.sort(indices).values
