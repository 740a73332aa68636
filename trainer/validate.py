"""In-loop evaluation: validation loss on every rank's fixed batches, and rank 0's lm-eval tasks.

Each component decides when it acts; the synchroniser says which module validates
(``validation_model``) and which weights it holds meanwhile (``evaluation_weights``).
"""
from __future__ import annotations

import math
from typing import Callable, ContextManager, Dict, List, Optional

import torch

from core.comm import Collectives


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, autocast, comm: Collectives) -> float:
    """Mean validation loss over every rank's fixed validation batches."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        with autocast():
            total[0] += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).double()
        total[1] += 1
    comm.all_reduce(total, kind="eval")
    model.train(was_training)
    return float(total[0] / total[1])


class Validator:
    """Validation every ``every`` steps (0 = only at the end) and at the last step; collective."""

    def __init__(self, sync, model: torch.nn.Module, batches: List, device: torch.device,
                 autocast: Callable[[], ContextManager], comm: Collectives, every: int) -> None:
        self.sync, self.model, self.batches = sync, model, batches
        self.device, self.autocast, self.comm, self.every = device, autocast, comm, every
        self.last: Optional[float] = None
        self.best = math.inf

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every and step % self.every == 0) or last

    def maybe_validate(self, step: int, last: bool) -> Optional[Dict[str, float]]:
        if not self.due(step, last):
            return None
        with self.sync.evaluation_weights():
            self.last = evaluate(self.model, self.batches, self.device, self.autocast, self.comm)
        self.best = min(self.best, self.last)
        return {"val/loss": self.last, "val/perplexity": math.exp(min(self.last, 50))}


class DownstreamEvaluator:
    """In-loop lm-eval scoring every ``every`` steps. Every rank calls ``maybe_evaluate`` and enters
    ``sync.evaluation_weights()`` (it may be a collective, e.g. sparse_avg's average); only the
    rank given a ``tokenizer`` (rank 0) scores, the others wait at the next collective. A task that
    cannot run (e.g. hub data offline) disables scoring once, with a message."""

    def __init__(self, sync, tokenizer, every: int, tasks: str, limit: Optional[float],
                 include_path: Optional[str]) -> None:
        self.sync, self.tokenizer, self.every = sync, tokenizer, every
        self.tasks, self.limit, self.include_path = tasks, limit, include_path
        self.enabled = tokenizer is not None

    def maybe_evaluate(self, step: int) -> Dict[str, float]:
        if not (self.every and step % self.every == 0):
            return {}
        with self.sync.evaluation_weights():
            return self._score() if self.enabled else {}

    def _score(self) -> Dict[str, float]:
        from evaluation.harness import DownstreamEvalError
        from evaluation.in_loop import downstream_eval_metrics

        try:
            return downstream_eval_metrics(self.sync.downstream_model(), self.tokenizer, self.tasks,
                                           limit=self.limit, include_path=self.include_path)
        except DownstreamEvalError as exc:
            self.enabled = False
            print(f"downstream evaluation disabled for this run: {exc}", flush=True)
            return {}
