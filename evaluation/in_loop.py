"""Downstream scores during training: a small lm-eval task list every N steps.

The trainer calls ``downstream_eval_metrics`` on rank 0 with the full model it validates on and
logs the returned ``eval/<task>/<metric>`` values with its other metrics. The evaluation leaves
no trace on training: the model's train/eval mode and every global RNG lm-eval reseeds (python,
numpy, torch, CUDA) are restored, so a run with in-loop evaluation draws the same batches and
dropout as one without. Task indexes are built once per process and reused.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import torch

from core.checkpoint import capture_rng, restore_rng
from evaluation.harness import downstream_metrics, evaluate_model


def downstream_eval_metrics(model: torch.nn.Module, tokenizer,
                            tasks: Union[str, Sequence[str]] = "small", *,
                            limit: Optional[float] = 200, num_fewshot: Optional[int] = None,
                            batch_size: int = 16, include_path: Optional[str] = None,
                            seed: int = 1234) -> Dict[str, float]:
    """``eval/<task>/<metric>`` for ``model`` (our CausalLM, unwrapped: not DDP or compiled) on
    ``tasks`` (names or a conf/eval/ preset), at most ``limit`` documents per task.

    Raises HubTaskUnavailableError when a task's data is neither reachable nor cached; a caller
    in the training loop should catch DownstreamEvalError once and stop calling.
    """
    rng = capture_rng()
    try:
        with torch.no_grad():
            results = evaluate_model(model, tokenizer, tasks, batch_size=batch_size, limit=limit,
                                     num_fewshot=num_fewshot, include_path=include_path, seed=seed)
    finally:
        restore_rng(rng)
    return downstream_metrics(results)
