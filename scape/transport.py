"""How the owners' mask parts travel: bitmap, indices, or whichever is smaller (auto).

Every rank knows the partition size and k, so the receive buffer has a fixed size and the
decoded mask needs no lengths or headers.
"""
from __future__ import annotations

import torch

from scape import kernels

TRANSPORTS = ("bitmap", "indices", "auto")


def bitmap_nbytes(partition_size: int) -> int:
    return partition_size // 8


def indices_nbytes(k: int) -> int:
    return 4 * k


def resolve(name: str, partition_size: int, k: int) -> str:
    """``auto`` picks indices only when strictly smaller (density < 1/32), else the bitmap."""
    if name not in TRANSPORTS:
        raise ValueError(f"optimizer.mask_transport={name!r}: allowed values are {TRANSPORTS}")
    if name != "auto":
        return name
    return "indices" if indices_nbytes(k) < bitmap_nbytes(partition_size) else "bitmap"


def local_nbytes(name: str, partition_size: int, k: int, partitions: int = 1) -> int:
    """Bytes one rank contributes to the all-gather for ``partitions`` owned partitions."""
    one = bitmap_nbytes(partition_size) if resolve(name, partition_size, k) == "bitmap" \
        else indices_nbytes(k)
    return partitions * one


def encode(name: str, local_indices: torch.Tensor, partition_size: int) -> torch.Tensor:
    """The send buffer for this rank's partitions.

    ``local_indices``: (partitions, k) int64, ascending, partition-local.
    """
    partitions, k = local_indices.shape
    device = local_indices.device
    if resolve(name, partition_size, k) == "indices":
        return local_indices.to(torch.int32).reshape(-1)
    offsets = torch.arange(partitions, device=device).unsqueeze(1) * partition_size
    mask = torch.zeros(partitions * partition_size, dtype=torch.bool, device=device)
    mask[(local_indices + offsets).reshape(-1)] = True
    return kernels.pack_bits(mask, torch.empty(mask.numel() // 8, dtype=torch.uint8, device=device))


def receive_buffer(name: str, num_partitions: int, partition_size: int, k: int,
                   device: torch.device) -> torch.Tensor:
    if resolve(name, partition_size, k) == "indices":
        return torch.empty(num_partitions * k, dtype=torch.int32, device=device)
    return torch.empty(num_partitions * bitmap_nbytes(partition_size), dtype=torch.uint8,
                       device=device)


def decode(name: str, received: torch.Tensor, num_partitions: int, partition_size: int,
           k: int) -> torch.Tensor:
    """The global mask as ascending flat indices (int64), k per partition."""
    device = received.device
    if resolve(name, partition_size, k) == "indices":
        offsets = torch.arange(num_partitions, device=device).unsqueeze(1) * partition_size
        return (received.view(num_partitions, k).long() + offsets).reshape(-1)
    mask = kernels.unpack_bits(received, torch.empty(received.numel() * 8, dtype=torch.bool,
                                                     device=device))
    return torch.nonzero(mask).squeeze(1)
