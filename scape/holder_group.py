"""SCAPE inside one SDP holder group: the parameters the group holds, partitioned among its ranks.

SDP (sdp/groups.py) builds one of these per holder group a worker belongs to, over the module of
the tensors that group holds, with collectives bound to the group's process group: the mask
partitions, the mask all-gather and THE one all-reduce of the masked values are the group's,
not the world's. The only thing that crosses groups is the clipping norm: SDP sums each group's
``gradient_norm()`` (counted once per group) over the world and hands the total back through
``clip_with_norm``, so every holder of every component clips with one coefficient, as plain SCAPE
and plain SDP do.
"""
from __future__ import annotations

from typing import Optional

import torch

from scape.synchronizer import ScapeSynchronizer


class HolderGroupScape(ScapeSynchronizer):
    """ScapeSynchronizer whose clipping norm may come from outside (the norm over all groups)."""

    TABLE_LR_SCALE = False

    _norm: Optional[torch.Tensor] = None

    def gradient_norm(self) -> torch.Tensor:
        """The norm of this group's ghat (equal on the group's ranks), after reduce_gradients."""
        return super()._ghat_norm()

    def clip_with_norm(self, norm: torch.Tensor, max_norm: float) -> float:
        """``clip_gradients`` with ``norm`` as the norm to clip by (and to roll back on)."""
        self._norm = norm
        try:
            return self.clip_gradients(max_norm)
        finally:
            self._norm = None

    def _ghat_norm(self) -> torch.Tensor:
        return self._norm if self._norm is not None else super()._ghat_norm()
