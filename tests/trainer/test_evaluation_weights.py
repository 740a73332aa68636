"""The Trainer's evaluation components enter ``sync.evaluation_weights()`` on every rank.

sparse_avg averages the ranks' copies inside it (a collective), so the validator and the in-loop
downstream evaluator must enter it on every rank and only when due, and only rank 0 (the one
holding a tokenizer) scores.
"""
from __future__ import annotations

import contextlib

import torch

from core.comm import Collectives
from core.sync import GradientSynchronizer
from trainer.validate import DownstreamEvaluator, Validator


class _Recorder(GradientSynchronizer):
    def __init__(self) -> None:
        model = torch.nn.Linear(2, 1)
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.1))
        self.entered = 0

    @contextlib.contextmanager
    def evaluation_weights(self):
        self.entered += 1
        yield


class _Loss(torch.nn.Module):
    def forward(self, x, y):
        return (x - y).square().mean()


def test_downstream_evaluator_enters_the_evaluation_weights_on_a_rank_that_does_not_score():
    sync = _Recorder()
    evaluator = DownstreamEvaluator(sync, tokenizer=None, every=2, tasks="small", limit=None, include_path=None)
    assert evaluator.maybe_evaluate(1) == {} and sync.entered == 0
    assert evaluator.maybe_evaluate(2) == {} and sync.entered == 1  # not scored, but entered
    off = DownstreamEvaluator(sync, tokenizer=None, every=0, tasks="small", limit=None, include_path=None)
    assert off.maybe_evaluate(2) == {} and sync.entered == 1


def test_validator_validates_inside_the_evaluation_weights():
    sync = _Recorder()
    batches = [(torch.ones(2, 1), torch.zeros(2, 1))]
    validator = Validator(sync, _Loss(), batches, torch.device("cpu"), contextlib.nullcontext, Collectives(), 3)
    assert validator.maybe_validate(2, last=False) is None and sync.entered == 0
    scores = validator.maybe_validate(3, last=False)
    assert scores["val/loss"] == 1.0 and sync.entered == 1
