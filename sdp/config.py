"""Subnetwork data parallelism's config schema (Hydra group ``sdp``); see docs/specs/SDP.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from core.choices import check_choice

Kind = Literal["none", "block", "neuron"]
Strategy = Literal["cyclic", "random"]
Masking = Literal["forward", "backward"]


@dataclass
class SDPConfig:
    kind: str = "none"  # Kind
    coverage: float = 1.0  # C in (0, 1]
    strategy: str = "cyclic"  # Strategy
    masking: str = "forward"  # Masking
    flop_matched: bool = False
    workers: Optional[int] = None  # None = the world size at launch
    groups_per_block: int = 8  # N-SDP: MLP-unit groups and head groups per block
    seed: int = 0
    plan_path: Optional[str] = None  # a plan JSON written by `python scripts/plan_sdp.py --json`

    def __post_init__(self) -> None:
        check_choice("sdp.kind", self.kind, Kind)
        check_choice("sdp.strategy", self.strategy, Strategy)
        check_choice("sdp.masking", self.masking, Masking)
