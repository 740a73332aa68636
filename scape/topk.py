"""Exact top-k by magnitude as a bool mask, fast for the k of 90-99% sparsity.

``torch.topk`` with k in the hundreds of thousands is a partial sort of the whole partition. Two
thresholds from a strided sample bracket the k-th largest value: everything at or above the upper
one is in the top-k for sure (checked: at most k of them), and the rest is chosen by an exact
top-k among the few values between the two thresholds (checked: enough of them). When the sample
misjudges, the full ``torch.topk`` runs, so the answer never depends on the sample.
"""
from __future__ import annotations

import math

import torch

SAMPLE_SIZE = 1 << 16
MARGIN_SIGMAS = 5.0  # bracket half-width in binomial standard deviations of the sample count


def topk_mask(score: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Set ``out`` (bool, like ``score``) to a mask of exactly k largest entries of ``score``."""
    n = score.numel()
    if k >= n:
        return out.fill_(True)
    out.zero_()
    if k <= 0:
        return out
    if n > 4 * SAMPLE_SIZE and _bracketed(score, k, out):
        return out
    out.zero_()
    out[torch.topk(score, k, sorted=False).indices] = True
    return out


def _bracketed(score: torch.Tensor, k: int, out: torch.Tensor) -> bool:
    n = score.numel()
    sample = score[:: n // SAMPLE_SIZE]
    s = sample.numel()
    expected = s * k / n  # sample entries expected above the k-th largest value
    margin = MARGIN_SIGMAS * math.sqrt(expected) + 8
    upper_rank, lower_rank = int(expected - margin), int(math.ceil(expected + margin))
    if lower_rank >= s:
        return False
    ranked = torch.topk(sample, lower_rank + 1).values  # descending
    lower = ranked[lower_rank]
    candidates = torch.nonzero(score >= lower).squeeze(1)  # the only full pass besides zeroing
    if candidates.numel() < k:
        return False
    values = score.index_select(0, candidates)
    if upper_rank >= 0:
        sure = values > ranked[upper_rank]
        n_sure = int(torch.count_nonzero(sure))
        if n_sure > k:
            return False
    else:
        sure, n_sure = torch.zeros_like(values, dtype=torch.bool), 0
    # the n_sure largest are in; the rest is the exact top-(k - n_sure) of the bracket
    bracket = torch.nonzero(~sure).squeeze(1)
    chosen = torch.topk(values.index_select(0, bracket), k - n_sure, sorted=False).indices
    out[candidates[sure]] = True
    out[candidates.index_select(0, bracket.index_select(0, chosen))] = True
    return True


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest entries of ``score``."""
    mask = torch.empty(score.numel(), dtype=torch.bool, device=score.device)
    return torch.nonzero(topk_mask(score, k, mask)).squeeze(1)
