"""The flat parameter space split into equal contiguous partitions, one owner rank each.

The same split a ZeRO-1 / Megatron distributed optimizer uses. Every quantity here is a pure
function of (number of parameters, number of partitions, density), so all ranks agree on every
collective's size without talking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Each partition is a multiple of this many elements: its bitmap is whole bytes (8) and its
# slices start on 128-element boundaries, which keeps the Triton kernels' loads aligned.
PARTITION_ALIGN = 128


def values_per_partition(density: float, partition_size: int) -> int:
    """k = ceil(density * |P_r|), robust to float noise (1 - 0.99 is 0.010000000000000009)."""
    k = math.ceil(round(density * partition_size, 6))
    return max(1, min(partition_size, k))


@dataclass(frozen=True)
class Partitioning:
    numel: int  # trainable parameters, unpadded
    num_partitions: int  # N; a multiple of the world size (equal to it in a real run)
    world: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.num_partitions % self.world:
            raise ValueError(f"num_partitions ({self.num_partitions}) must be a multiple of the "
                             f"world size ({self.world})")

    @property
    def pad_multiple(self) -> int:
        return self.num_partitions * PARTITION_ALIGN

    @property
    def padded_numel(self) -> int:
        return math.ceil(self.numel / self.pad_multiple) * self.pad_multiple

    @property
    def partition_size(self) -> int:
        return self.padded_numel // self.num_partitions

    @property
    def partitions_per_rank(self) -> int:
        return self.num_partitions // self.world

    @property
    def owned_start(self) -> int:
        """First flat index of the contiguous region whose masks this rank generates."""
        return self.rank * self.partitions_per_rank * self.partition_size

    @property
    def owned_numel(self) -> int:
        return self.partitions_per_rank * self.partition_size

    def k(self, density: float) -> int:
        return values_per_partition(density, self.partition_size)
