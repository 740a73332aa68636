"""How far apart the ranks' copies of a sparse_avg checkpoint are, and what each validates at.

    python scripts/copy_divergence.py RUN/step-N [--per-tensor]

Sparse model averaging (``optimizer=sparse_avg``) keeps one model per rank; the checkpoint holds
their average (``model.safetensors``) and each rank's copy (``rank-R.pt``). This reads every copy,
validates each one and their average (the mean of the copies plus the owners' pending errors) on
the run's own validation windows (the same windows the trainer validated on), and prints one JSON
object: the losses, the RMS of the average's weights and the RMS distance of the copies from their
average, overall and (``--per-tensor``) per parameter. That average is the trainer's model, and
reproduces the run's validation loss, when the copies take their whole local step
(``local_step_scale`` 1, the default up to 4 copies); with a share s < 1 the trainer's model is
x + (mean_i d_i + e) / s, which this does not rebuild. A diagnostic; it runs on CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def load_copies(checkpoint: Path) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """(every rank's flat copy y_i in rank order, what the owners' mean still owes the average).

    The flat layout: matrices first. The second is the sum of the owners' pending
    re-quantization errors (each chunk owner's ``mean_error`` of the compressed all-reduce, with
    ``optimizer.value_bits`` > 0; zero with value_bits 0), which the average model holds and no
    copy does; the ranks of one copy hold the same error, so each rank's counts copies / world
    times."""
    files = sorted(checkpoint.glob("rank-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise SystemExit(f"error: {checkpoint} has no rank-R.pt files: it is not a checkpoint of a run")
    copies, pending = [], None
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=False).get("sync", {})
        if "params" not in state:
            raise SystemExit(f"error: {path} holds no sparse_avg copy (was the run optimizer=sparse_avg?)")
        copies.append(state["params"].float())
        if pending is None:
            pending = torch.zeros_like(copies[-1])
        if "mean_error" in state:
            error, start = state["mean_error"].float(), int(state["mean_error_start"])
            pending[start:start + error.numel()].add_(error, alpha=int(state["copies"]) / len(files))
    return copies, pending


def divergence(checkpoint: Path, per_tensor: bool = False) -> Dict:
    from omegaconf import OmegaConf

    from core.flat import flat_order
    from data.loader import TokenLoader
    from data.preparation import prepared_dir_for
    from models import build_model

    run = checkpoint.resolve().parent
    cfg = OmegaConf.load(run / "config.yaml")
    model = build_model(cfg.model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ordered = flat_order(params, param=lambda named: named[1])
    numel = sum(p.numel() for _, p in ordered)
    loaded, pending = load_copies(checkpoint)
    copies = torch.stack([c[:numel] for c in loaded])
    average = copies.mean(0) + pending[:numel]  # the model the trainer validated and saved
    world = copies.shape[0]
    val = TokenLoader(prepared_dir_for(cfg.data, cfg.tokenizer), "val", cfg.model.seq_len, cfg.train.micro_batch_size, 0, 1,
                      int(cfg.seed))
    # the trainer's windows: eval_batches per rank on `world` ranks = eval_batches * world here
    batches = val.eval_batches(int(cfg.train.eval_batches) * world)

    @torch.no_grad()
    def validate(flat: torch.Tensor) -> float:
        offset = 0
        for _, p in ordered:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        model.eval()
        return sum(float(model(x, y).double()) for x, y in batches) / len(batches)

    out = {"checkpoint": str(checkpoint), "ranks": world,
           "average_val_loss": validate(average),
           "copy_val_losses": [validate(copy) for copy in copies],
           "weights_rms": float(average.square().mean().sqrt()),
           "copy_distance_rms": float((copies - average).square().mean().sqrt())}
    if per_tensor:
        rows, offset = {}, 0
        for name, p in ordered:
            k = p.numel()
            mean, spread = average[offset:offset + k], copies[:, offset:offset + k] - average[offset:offset + k]
            rows[name] = {"numel": k, "weights_rms": float(mean.square().mean().sqrt()),
                          "copy_distance_rms": float(spread.square().mean().sqrt())}
            offset += k
        out["per_tensor"] = rows
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="RUN/step-N of an optimizer=sparse_avg run")
    parser.add_argument("--per-tensor", action="store_true", help="also per parameter")
    args = parser.parse_args(argv)
    if not (args.checkpoint / "model.safetensors").is_file():
        print(f"error: {args.checkpoint} is not a checkpoint folder (no model.safetensors)", file=sys.stderr)
        return 2
    print(json.dumps(divergence(args.checkpoint, args.per_tensor), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
