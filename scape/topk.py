"""Top-k by magnitude as a bool mask with exactly k entries, fast for the k of 90-99% sparsity.

Two methods (``optimizer.topk_method``), both exact: the same k, the same set as ``torch.topk``
whenever the k-th largest value is unique.

- ``exact``: on CUDA, ``torch.topk`` itself (a radix select there; k is known, so nothing is read
  back to the host). On the CPU ``torch.topk`` with k in the hundreds of thousands is a partial
  sort of the whole partition, so two thresholds from a strided sample bracket the k-th largest
  value: everything at or above the upper one is in the top-k for sure (checked: at most k of
  them), and the rest is chosen by an exact top-k among the few values between the two
  thresholds (checked: enough of them). When the sample misjudges, the full ``torch.topk`` runs.
  Among values equal to the k-th largest, which ones are chosen is up to ``torch.topk``.
- ``threshold``: find the k-th largest value v itself, then mark ``score > v`` and, of the
  entries equal to v, the lowest-indexed ones until there are exactly k (the tie rule: the
  canonical top-k). No index list of the k chosen entries is ever built, which is what the exact
  method pays for at 90% (nonzero, index_select and a scatter over 10% of the partition).
  On the CPU v comes from the same sampled bracket (a few comparison passes, then a small top-k
  of the values inside it); on CUDA, and on the CPU when the sample misjudges, from a two-pass
  radix select over the float bits with 65,536-bin histograms, which is all device tensor ops,
  so no host synchronisation, run over slices of ``RADIX_CHUNK`` elements so that its transient
  memory is bounded (6 bytes a slice element) whatever the partition's size.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

SAMPLE_SIZE = 1 << 16
MARGIN_SIGMAS = 5.0  # bracket half-width in binomial standard deviations of the sample count
TOPK_METHODS = ("exact", "threshold")
_RADIX_BINS = 1 << 16
# elements per slice of the radix select's passes: its transient memory is at most 6 bytes a slice
# element (96 MiB) and three histograms of 65,536 bins, whatever the partition's size
RADIX_CHUNK = 1 << 24


def topk_mask(score: torch.Tensor, k: int, out: torch.Tensor, method: str = "exact",
              scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Set ``out`` (bool, like ``score``) to a mask of exactly k largest entries of ``score``.

    ``scratch``: a bool tensor like ``out`` that the threshold method may overwrite (a caller
    that selects every step keeps one, so no partition-sized buffer is allocated per call).
    """
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method {method!r} is not supported; allowed: {', '.join(TOPK_METHODS)}")
    n = score.numel()
    if k >= n:
        return out.fill_(True)
    if k <= 0:
        return out.zero_()
    if method == "threshold":
        return threshold_mask(score, k, out, scratch)
    if score.device.type != "cpu":
        return _torch_topk_mask(score, k, out)
    out.zero_()
    if n > 4 * SAMPLE_SIZE and _bracketed(score, k, out):
        return out
    out.zero_()
    out[torch.topk(score, k, sorted=False).indices] = True
    return out


def _torch_topk_mask(score: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``torch.topk``'s k entries set in ``out``: k is known, so nothing is read back to the host
    (on CUDA a radix select: besides its workspace, k values and k int64 indices, 12 bytes each)."""
    indices = torch.topk(score.reshape(-1), k, sorted=False).indices
    out.view(-1).zero_().index_fill_(0, indices, True)
    return out


def _bracket(score: torch.Tensor, k: int):
    """(lower, upper) sample values with count(score >= lower) >= k >= count(score > upper)
    expected by a wide margin (upper None: no sure entries), or None when the sample is too small."""
    n = score.numel()
    sample = score[:: n // SAMPLE_SIZE]
    s = sample.numel()
    expected = s * k / n  # sample entries expected above the k-th largest value
    margin = MARGIN_SIGMAS * math.sqrt(expected) + 8
    upper_rank, lower_rank = int(expected - margin), int(math.ceil(expected + margin))
    if lower_rank >= s:
        return None
    ranked = torch.topk(sample, lower_rank + 1).values  # descending
    return ranked[lower_rank], (ranked[upper_rank] if upper_rank >= 0 else None)


def _bracketed(score: torch.Tensor, k: int, out: torch.Tensor) -> bool:
    bracket = _bracket(score, k)
    if bracket is None:
        return False
    lower, upper = bracket
    candidates = torch.nonzero(score >= lower).squeeze(1)  # the only full pass besides zeroing
    if candidates.numel() < k:
        return False
    values = score.index_select(0, candidates)
    if upper is not None:
        sure = values > upper
        n_sure = int(torch.count_nonzero(sure))
        if n_sure > k:
            return False
    else:
        sure, n_sure = torch.zeros_like(values, dtype=torch.bool), 0
    # the n_sure largest are in; the rest is the exact top-(k - n_sure) of the bracket
    inside = torch.nonzero(~sure).squeeze(1)
    chosen = torch.topk(values.index_select(0, inside), k - n_sure, sorted=False).indices
    out[candidates[sure]] = True
    out[candidates.index_select(0, inside.index_select(0, chosen))] = True
    return True


def threshold_mask(score: torch.Tensor, k: int, out: torch.Tensor,
                   scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The canonical top-k (ties at the k-th value: lowest index first) of a float32 ``score``."""
    if score.dtype != torch.float32:
        raise TypeError(f"threshold top-k needs float32 scores, got {score.dtype}")
    if not 0 < k < score.numel():
        return topk_mask(score, k, out, "exact")
    if score.device.type == "cpu" and score.numel() > 4 * SAMPLE_SIZE and _sampled(score, k, out, scratch):
        return out
    return _radix_mask(score, k, out)


def _sampled(score: torch.Tensor, k: int, out: torch.Tensor,
             scratch: Optional[torch.Tensor]) -> bool:
    """``out`` = canonical top-k via the sampled bracket [lower, upper]; False when it misjudges.

    Every entry equal to the k-th largest value lies inside the bracket, so the k-th value, the
    entries above it and the ties are all settled among the bracket's few entries: three passes
    over the partition (two comparisons and one nonzero), none of them writing k indices.
    """
    bracket = _bracket(score, k)
    if bracket is None or bracket[1] is None:
        return False
    lower, upper = bracket
    torch.gt(score, upper, out=out)  # the sure ones
    above = int(torch.count_nonzero(out))
    if above >= k:
        return False
    inside = torch.ge(score, lower, out=scratch if scratch is not None else torch.empty_like(out))
    inside ^= out  # lower <= score <= upper
    where = _sparse_nonzero(inside)
    if above + where.numel() < k:
        return False
    values = score.index_select(0, where)
    top = torch.topk(values, k - above, sorted=False)
    kth = top.values.min()
    ties = values == kth
    if int(torch.count_nonzero(ties)) == 1:  # the usual case: the top-k set is unique
        out[where.index_select(0, top.indices)] = True
        return True
    chosen = values > kth
    missing = k - above - int(torch.count_nonzero(chosen))
    chosen[torch.nonzero(ties).squeeze(1)[:missing]] = True  # ties: the lowest-indexed ones
    out[where[chosen]] = True
    return True


def _sparse_nonzero(marks: torch.Tensor) -> torch.Tensor:
    """Ascending indices of the True entries of a bool vector with few of them: the scan runs over
    8-byte words (an eighth of the elements), then only the words holding a True are expanded."""
    if marks.numel() % 8 or marks.data_ptr() % 8:
        return torch.nonzero(marks).squeeze(1)
    words = torch.nonzero(marks.view(torch.int64)).squeeze(1)
    word_and_byte = torch.nonzero(marks.view(-1, 8).index_select(0, words))
    return words.index_select(0, word_and_byte[:, 0]).mul_(8).add_(word_and_byte[:, 1])


def _ordered_keys(score: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the floats are (negative floats: magnitude bits flipped), in one
    new buffer of 4 bytes an element."""
    bits = score.view(torch.int32)
    return torch.bitwise_right_shift(bits, 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)


def _kth_bin(hist: torch.Tensor, k: torch.Tensor):
    """Highest bin b with count(bins >= b) >= k, and the count strictly above it (device tensors)."""
    from_top = hist.flip(0).cumsum(0)
    index = torch.searchsorted(from_top, k.reshape(1)).clamp_(max=hist.numel() - 1)
    b = hist.numel() - 1 - index
    return b, from_top.index_select(0, index) - hist.index_select(0, b)


def _slices(n: int):
    return [(start, min(start + RADIX_CHUNK, n)) for start in range(0, n, RADIX_CHUNK)]


# Each slice's temporaries live inside one of these functions, so that they are freed before the
# next slice's are made.
def _add_counts(hist: torch.Tensor, counts: torch.Tensor, ones: torch.Tensor, bins: torch.Tensor) -> None:
    """``hist`` += the counts of ``bins`` (int32 in 0..65536; 65536: not counted)."""
    hist += counts.zero_().index_add_(0, bins, ones.expand(bins.numel()))[:_RADIX_BINS]


def _high_bins(piece: torch.Tensor) -> torch.Tensor:
    """The keys' high 16 bits, shifted to 0..65535 (ordered as the keys)."""
    return _ordered_keys(piece).bitwise_right_shift_(16).add_(_RADIX_BINS // 2)


def _low_bins(piece: torch.Tensor, first_key: torch.Tensor, last_key: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of the keys in [first_key, last_key], 65536 for the others."""
    keys = _ordered_keys(piece)
    outside = torch.lt(keys, first_key)
    outside |= keys > last_key
    return keys.bitwise_and_(0xFFFF).masked_fill_(outside, _RADIX_BINS)


def _mark(piece: torch.Tensor, chosen: torch.Tensor, kth_key: torch.Tensor,
          missing: torch.Tensor) -> torch.Tensor:
    """``chosen`` = ``piece``'s keys above ``kth_key`` and its first ``missing`` ties; returns
    ``missing`` less the ties this piece holds."""
    keys = _ordered_keys(piece)
    torch.gt(keys, kth_key, out=chosen)
    ties = keys == kth_key
    rank = keys.copy_(ties).cumsum_(0)  # in place: the cumsum of a bool would convert it first
    ties &= rank <= missing.clamp(0, piece.numel()).int()
    chosen |= ties
    return missing - rank[-1:]


def _radix_kth(flat: torch.Tensor, k: int):
    """(the k-th largest key, how many of the entries equal to it complete the k), both device
    tensors, from two 16-bit histogram passes over RADIX_CHUNK-element slices."""
    device = flat.device
    counts = torch.empty(_RADIX_BINS + 1, dtype=torch.int32, device=device)  # one slice's
    ones = torch.ones(1, dtype=torch.int32, device=device)
    hist = torch.zeros(_RADIX_BINS, dtype=torch.int64, device=device)
    for start, end in _slices(flat.numel()):
        _add_counts(hist, counts, ones, _high_bins(flat[start:end]))
    target = torch.full((1,), k, dtype=torch.int64, device=device)
    high_bin, above_high = _kth_bin(hist, target)
    first = (high_bin - _RADIX_BINS // 2) << 16  # the keys of that bin: [first, first + 0xFFFF]
    first_key, last_key = first.int(), (first + 0xFFFF).int()
    hist.zero_()
    for start, end in _slices(flat.numel()):
        _add_counts(hist, counts, ones, _low_bins(flat[start:end], first_key, last_key))
    low_bin, above_low = _kth_bin(hist, target - above_high)
    return (first | low_bin).int(), target - above_high - above_low


def _radix_mask(score: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Exact k-th key by two 16-bit histogram passes, then ``>`` and the lowest-indexed ties.

    Device tensor ops only (no host read), over slices of RADIX_CHUNK elements: at most 6 bytes
    a slice element besides the histograms, whatever the partition's size."""
    flat = score.reshape(-1).contiguous()
    kth_key, missing = _radix_kth(flat, k)  # missing >= 1: ties complete the k
    flat_out = out.view(-1)
    for start, end in _slices(flat.numel()):
        missing = _mark(flat[start:end], flat_out[start:end], kth_key, missing)
    return out


def topk_indices(score: torch.Tensor, k: int, method: str = "exact") -> torch.Tensor:
    """Ascending indices of the k largest entries of ``score``."""
    mask = torch.empty(score.numel(), dtype=torch.bool, device=score.device)
    return torch.nonzero(topk_mask(score, k, mask, method)).squeeze(1)
