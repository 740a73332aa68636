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


def encode(name: str, local_mask: torch.Tensor, partitions: int, partition_size: int,
           k: int) -> torch.Tensor:
    """The send buffer for this rank's partitions.

    ``local_mask``: bool, ``partitions * partition_size`` long (this rank's contiguous region),
    exactly k set per partition. Packing first makes the indices path scan bytes, not bits.
    """
    packed = kernels.pack_bits(local_mask, torch.empty(local_mask.numel() // 8, dtype=torch.uint8,
                                                       device=local_mask.device))
    if resolve(name, partition_size, k) == "bitmap":
        return packed
    positions = kernels.set_bit_positions(packed).view(partitions, k)
    offsets = torch.arange(partitions, device=packed.device).unsqueeze(1) * partition_size
    return (positions - offsets).to(torch.int32).reshape(-1)


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
    return kernels.set_bit_positions(received)
