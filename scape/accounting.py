"""The analytic byte formula for SCAPE and dense steps (docs/SCAPE.md), in core.comm's convention.

Bytes sent per rank per step, ring algorithms: an all-reduce of S bytes over N ranks sends
2 (N - 1) / N * S; an all-gather whose local part is S bytes sends (N - 1) S. The benchmark
applies these to the large layouts, and the tests check that the counters of a real run equal them.
"""
from __future__ import annotations

from typing import Dict, Optional

from scape import transport
from scape.partition import Partitioning
from core.comm import all_gather_bytes, all_reduce_bytes

VALUE_BYTES = {"fp32": 4, "bf16": 2}


def dense_step_bytes(numel: int, world: int) -> float:
    """The dense fp32 all-reduce of the gradients of ``numel`` parameters (DDP, AdamW, AdamS)."""
    return all_reduce_bytes(4 * numel, world)


def scape_step_bytes(numel: int, world: int, sparsity: float, mask_transport: str = "auto",
                     value_dtype: str = "fp32", num_partitions: Optional[int] = None
                     ) -> Dict[str, float]:
    """A sparse SCAPE step: the values all-reduce and the mask all-gather (steady state).

    With P the padded length (a multiple of 128 N), |P_r| = P / N and k = ceil(rho |P_r|):
    values = 2 (N - 1) / N * N k * s (s = 4 or 2 bytes); mask = (N - 1) * |P_r| / 8 (bitmap)
    or (N - 1) * 4 k (indices).
    """
    layout = Partitioning(numel, num_partitions or world, world, 0)
    k = layout.k(round(1.0 - sparsity, 12))
    values = all_reduce_bytes(layout.num_partitions * k * VALUE_BYTES[value_dtype], world)
    mask = all_gather_bytes(transport.local_nbytes(mask_transport, layout.partition_size, k,
                                                   layout.partitions_per_rank), world)
    return {"values": values, "mask": mask, "total": values + mask,
            "transport": transport.resolve(mask_transport, layout.partition_size, k),
            "k": k, "padded_numel": layout.padded_numel}
