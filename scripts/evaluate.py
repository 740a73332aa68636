"""Score a checkpoint on downstream tasks with lm-evaluation-harness.

    python scripts/evaluate.py checkpoint=RUN/step-N tasks=paper
    python scripts/evaluate.py checkpoint=RUN/step-N tasks=piqa,arc_easy limit=100 batch_size=32 device=cuda
    python scripts/evaluate.py checkpoint=RUN/step-N tasks=my_task include_path=my_tasks/ wandb=disabled

Arguments are Hydra-style key=value (see EvalConfig below; presets in conf/eval/). The model is
ours (models/), scored through lm-eval's Python API; results go to RUN/step-N/eval-<time>.json
(``output=`` to change) and, when wandb is on, to the training run's wandb id. Exit status 2
means the evaluation could not run as asked (the message says why, e.g. an unreachable hub).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass
class EvalConfig:
    checkpoint: str = "???"  # RUN/step-N
    tasks: str = "paper"  # comma-separated lm-eval task names and/or conf/eval/ presets
    batch_size: int = 16  # requests per forward
    device: str = "auto"  # auto (cuda if present) | cpu | cuda | cuda:1 ...
    dtype: str = "fp32"  # fp32 (exact) | bf16 | fp16
    limit: Optional[float] = None  # documents per task (an int) or a fraction (< 1); None = all
    num_fewshot: Optional[int] = None  # None = each task's default (0 unless its YAML says)
    include_path: Optional[str] = None  # folder of custom task YAMLs
    log_samples: bool = False  # also write per-request inputs and scores (…-samples.jsonl)
    output: Optional[str] = None  # results JSON path; default RUN/step-N/eval-<time>.json
    wandb: str = "auto"  # auto (as the training run did) | online | offline | disabled
    wandb_resume: bool = True  # log into the training run's wandb id; false: a new <run>-eval run
    seed: int = 1234
    max_gen_toks: int = 256  # generation budget of generate_until tasks


def parse_config(argv: List[str]) -> EvalConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [a for a in argv if "=" not in a]
    if bad:
        raise SystemExit(f"error: arguments are key=value (got {bad}); keys: "
                         f"{', '.join(EvalConfig.__dataclass_fields__)}")
    # tasks=a,b is a plain comma list here (no Hydra sweep); [a,b] is accepted as well.
    dotlist = []
    for arg in argv:
        key, value = arg.split("=", 1)
        if key.lstrip("+") == "tasks":
            value = value.strip("[]").replace(" ", "")
            value = f"'{value}'"
        dotlist.append(f"{key.lstrip('+')}={value}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(EvalConfig), OmegaConf.from_dotlist(dotlist))
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise SystemExit(f"error: {str(exc).splitlines()[0]}") from None
    return obj  # type: ignore[return-value]


def main(argv: Optional[List[str]] = None) -> int:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)

    from evaluation.checkpoint import CheckpointLoadError, load_checkpoint_for_inference
    from evaluation.harness import (DownstreamEvalError, evaluate_model, format_table,
                                    log_to_wandb, results_path, wandb_mode_for_run, write_results)

    try:
        loaded = load_checkpoint_for_inference(cfg.checkpoint, device=cfg.device, dtype=cfg.dtype)
        run_config = loaded.meta.get("config") or {}
        wandb_mode = wandb_mode_for_run(cfg.wandb, run_config)
        results = evaluate_model(
            loaded.model, loaded.tokenizer, cfg.tasks, batch_size=cfg.batch_size, limit=cfg.limit,
            num_fewshot=cfg.num_fewshot, include_path=cfg.include_path,
            log_samples=cfg.log_samples, seed=cfg.seed, max_gen_toks=cfg.max_gen_toks)
    except (DownstreamEvalError, CheckpointLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from dataclasses import asdict

    out = Path(cfg.output) if cfg.output else results_path(loaded.path)
    out, samples = write_results(results, out, {
        "checkpoint": str(loaded.path.resolve()), "step": loaded.step, "run_name": loaded.run_name,
        "model": asdict(loaded.config), "eval_config": asdict(cfg)})
    record = json.loads(out.read_text())
    print(format_table(record["metrics"]))
    wandb_id = log_to_wandb(record["metrics"], run_name=loaded.run_name, run_config=run_config,
                            step=loaded.step, mode=wandb_mode, resume_run=cfg.wandb_resume,
                            run_dir=loaded.path.resolve().parent)
    print(json.dumps({"results": str(out), "samples": str(samples) if samples else None,
                      "tasks": cfg.tasks, "wandb": wandb_id}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
