"""Subnetwork data parallelism's config schema (Hydra group ``sdp``); see docs/specs/SDP.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SDPConfig:
    kind: str = "none"  # none | block | neuron
    coverage: float = 1.0  # C in (0, 1]
    strategy: str = "cyclic"  # cyclic | random
    masking: str = "forward"  # forward | backward
    flop_matched: bool = False
    workers: Optional[int] = None  # None = the world size at launch
    groups_per_block: int = 8  # N-SDP: MLP-unit groups and head groups per block
    seed: int = 0
    plan_path: Optional[str] = None  # a plan JSON written by `python scripts/plan_sdp.py --json`
