"""The horizon as a speed-up: how many AdamS steps match a method's loss after T steps.

A lead over AdamS in nats shrinks with the length of the run even when the method's speed-up is
constant, because loss curves flatten: a method that reaches any loss in 4/5 of AdamS's steps is
ahead by L(T) - L(1.25 T), which falls as T grows. So "the gap must not grow with length" is
read here in steps as well: for each study in --method, the number of steps S that AdamS (trained
with its own schedule over S steps) needs to end at the method's final loss after T steps, and
the ratio S / T. A ratio that does not fall from the short run to the long one is an advantage
that does not fade; one above 1 is ahead of AdamS, below 1 behind.

S is interpolated linearly in log(steps) between the two nearest AdamS lengths of --reference
(each the mean of its seeds at its best lr; every seed on its own as well, paired by seed), and
is not extrapolated: a loss outside the references' range gives null and the lengths to add.
Studies of the same length, on either side, are merged seed by seed (one row per length).

    python scripts/study_steps_to_match.py --arm sma99s \\
        --reference docs/results/src300.json docs/results/src_adams375.json docs/results/src_adams450.json \\
        --method docs/results/src300.json docs/results/src1200.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REFERENCE_ARM = "adams"


def _study(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"error: cannot read the study {path}: {error}. Pass a NAME.json written "
                         f"by scripts/study_quality.py.")


def _seed_losses(study: dict, arm: str, path: Path) -> Dict[str, float]:
    record = study.get("arms", {}).get(arm)
    if record is None:
        raise SystemExit(f"error: the study {path} has no arm '{arm}' (it has "
                         f"{', '.join(sorted(study.get('arms', {}))) or 'none'}). Pass --arm with one "
                         f"of them, or a study that ran it.")
    losses = {seed: loss for seed, loss in (record.get("seed_losses_at_best_lr") or {}).items()
              if loss is not None}
    if not losses:
        raise SystemExit(f"error: the arm '{arm}' of {path} has no finished run. Run the study first.")
    return losses


def steps_to_reach(reference: Sequence[Tuple[int, float]], loss: float) -> Optional[float]:
    """Steps at which a run of that length ends at `loss`, by log-linear interpolation between
    the (steps, final loss) references; None outside their range (no extrapolation)."""
    points = sorted(reference)
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        low, high = min(l0, l1), max(l0, l1)
        if low <= loss <= high:
            if l0 == l1:
                return float(s0)
            t = (loss - l0) / (l1 - l0)
            return math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
    return None


def _by_length(paths: Sequence[Path], arm: str) -> Dict[int, Tuple[Dict[str, float], List[Path]]]:
    """The arm's final losses per seed, gathered by run length over the studies.

    A study often holds one seed (`--seeds 1` run on its own after the first), so the studies of
    one length are merged; a seed that two of them both ran is refused rather than picked."""
    merged: Dict[int, Tuple[Dict[str, float], List[Path]]] = {}
    origin: Dict[Tuple[int, str], Path] = {}
    for path in paths:
        study = _study(path)
        steps = int(study["settings"]["steps"])
        losses, sources = merged.setdefault(steps, ({}, []))
        for seed, loss in _seed_losses(study, arm, path).items():
            if (steps, seed) in origin:
                raise SystemExit(f"error: seed {seed} of '{arm}' at {steps} steps is in two studies "
                                 f"({origin[steps, seed]} and {path}). Pass each run once.")
            origin[steps, seed] = path
            losses[seed] = loss
        sources.append(path)
    return merged


def match(references: Sequence[Path], methods: Sequence[Path], arm: str) -> dict:
    ref_by_steps = {steps: losses for steps, (losses, _) in _by_length(references, REFERENCE_ARM).items()}
    if len(ref_by_steps) < 2:
        raise SystemExit("error: --reference needs AdamS at two lengths or more to interpolate.")
    mean_ref = [(steps, sum(l.values()) / len(l)) for steps, l in ref_by_steps.items()]
    rows: List[dict] = []
    for steps, (losses, sources) in sorted(_by_length(methods, arm).items()):
        mean = sum(losses.values()) / len(losses)
        matched = steps_to_reach(mean_ref, mean)
        per_seed = {}
        for seed, loss in sorted(losses.items()):
            seed_ref = [(s, l[seed]) for s, l in ref_by_steps.items() if seed in l]
            seed_steps = steps_to_reach(seed_ref, loss) if len(seed_ref) >= 2 else None
            per_seed[seed] = {"loss": loss, "adams_steps": seed_steps,
                              "ratio": None if seed_steps is None else seed_steps / steps}
        rows.append({"studies": [str(path) for path in sources], "steps": steps, "loss": mean,
                     "adams_steps": matched, "ratio": None if matched is None else matched / steps,
                     "per_seed": per_seed,
                     "note": None if matched is not None else
                     f"loss {mean:.4f} is outside AdamS's references "
                     f"({', '.join(f'{s} steps: {l:.4f}' for s, l in sorted(mean_ref))}); add AdamS at "
                     f"a length whose loss brackets it"})
    return {"arm": arm, "reference_arm": REFERENCE_ARM,
            "reference": {str(s): l for s, l in sorted(mean_ref)}, "methods": rows}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True, help="the method's arm in the --method studies")
    parser.add_argument("--reference", nargs="+", type=Path, required=True,
                        help="study JSONs with AdamS at different lengths (--steps)")
    parser.add_argument("--method", nargs="+", type=Path, required=True,
                        help="study JSONs with the method's arm")
    args = parser.parse_args(argv)
    print(json.dumps(match(args.reference, args.method, args.arm), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
