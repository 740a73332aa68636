"""How the owners' mask parts travel: bitmap, indices, or whichever is smaller (auto).

Every rank knows the partition size and k, so the receive buffer has a fixed size and the
decoded mask needs no lengths or headers. For the same reason both directions are fixed-size
device arithmetic: a bitmap with exactly ``count`` set bits becomes its ``count`` positions by a
per-byte popcount and a running offset (``set_bit_positions``), never by ``nonzero``, whose
output size the host would have to wait for.
"""
from __future__ import annotations

import torch

from scape import kernels

# bytes of a bitmap decoded per pass: bounds the decode's int64 temporaries (~24 bytes a byte)
DECODE_CHUNK_BYTES = 1 << 20

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
    positions = set_bit_positions(packed, partitions * k).view(partitions, k)
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
    return set_bit_positions(received, num_partitions * k)


def _popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each value of an int64 tensor holding bytes (0..255)."""
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


def set_bit_positions(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending positions (int64) of the set bits of a packed bitmap (LSB-first, as
    ``kernels.pack_bits`` writes it) that holds exactly ``count`` of them.

    Byte i's set bits go to ``out[start_i:start_i + popcount_i]`` in bit order, ``start_i`` the
    set bits of the bytes before it; clear bits write into one extra slot that is dropped. All
    sizes are known beforehand, so nothing waits for the device. A bitmap with another number of
    set bits gives a wrong answer, not an error: the senders guarantee k per partition.
    """
    device = packed.device
    out = torch.empty(count + 1, dtype=torch.int64, device=device)
    carry = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(0, packed.numel(), DECODE_CHUNK_BYTES):
        chunk = packed[first:first + DECODE_CHUNK_BYTES].to(torch.int64)
        counts = _popcount(chunk)
        running = torch.cumsum(counts, 0).sub_(counts).add_(carry)  # each byte's first slot
        carry = running[-1] + counts[-1]
        base = torch.arange(first * 8, (first + chunk.numel()) * 8, 8, dtype=torch.int64, device=device)
        for bit in range(8):
            is_set = (chunk >> bit) & 1
            out.index_copy_(0, torch.where(is_set.bool(), running, count), base + bit)
            running += is_set
    return out[:count]
