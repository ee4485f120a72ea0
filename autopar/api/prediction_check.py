"""A planned layout's prediction beside the steps it measures.

`parallelize` with a planner's layout (`config="auto"` or a `dist.plan` result) prints the
step time the planner predicted, then times the training loop's steps (from one optimizer
step to the next, after `WARMUP` steps that verify regions and fill caches) and prints the
median of `MEASURED` of them beside it, once.  A gap beyond `TOLERANCE` warns, naming the
larger of the two differences it can tell apart: the time blocked in transfers
(`comm.log.blocked_seconds`) against the planner's communication terms, and the rest
(compute, host work, the optimizer, the pipeline's bubble) against the planner's.
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from ..comm import get_rank
from ..comm.log import blocked_seconds

WARMUP, MEASURED = 2, 3
TOLERANCE = 0.25
# the planner's time categories spent in transfers (planner/model.py TIME)
TRANSFERS = ("tp_comm", "zero_comm", "p2p", "dp_comm")


class PredictionGapWarning(UserWarning):
    """The measured step is further from the planner's prediction than TOLERANCE."""


class PredictionCheck:
    """Hooked on the optimizer's steps until it has reported (then it removes itself)."""

    def __init__(self, plan: Any, optimizer: torch.optim.Optimizer):
        self.name, self.predicted = plan.name, plan.estimate.step_time
        self.transfers = sum(plan.estimate.time.get(k, 0.0) for k in TRANSFERS)
        self.last = None
        self.steps: list = []  # (seconds, seconds blocked in transfers) from one step to the next
        self.handle = optimizer.register_step_post_hook(self._stepped)
        self.line = None
        _say(f"autopar: planned {self.name}: predicted {1e3 * self.predicted:.1f} ms a step "
             f"({1e3 * self.transfers:.1f} ms of it in transfers)")

    def _stepped(self, optimizer, args, kwargs) -> None:
        now, blocked = time.perf_counter(), blocked_seconds()
        if self.last is not None:
            self.steps.append((now - self.last[0], blocked - self.last[1]))
        self.last = (now, blocked)
        if len(self.steps) == WARMUP + MEASURED:
            self.handle.remove()
            self._report()

    def _report(self) -> None:
        measured = sorted(self.steps[WARMUP:])[MEASURED // 2]  # the median step, and its blocked time
        seconds, blocked = measured
        ratio = seconds / self.predicted
        self.line = (f"autopar: planned {self.name}: predicted {1e3 * self.predicted:.1f} ms a step, measured "
                     f"{1e3 * seconds:.1f} ms (the median of steps {WARMUP + 2}-{WARMUP + MEASURED + 1}): {ratio:.2f}x")
        _say(self.line)
        if abs(ratio - 1) <= TOLERANCE:
            return
        parts = [("transfers", self.transfers, blocked),
                 ("compute, host work, the optimizer and the bubble", self.predicted - self.transfers,
                  seconds - blocked)]
        name, want, got = max(parts, key=lambda p: abs(p[2] - p[1]))
        warnings.warn(
            f"{self.line}, beyond {TOLERANCE:.0%}; the largest difference is in {name}: predicted "
            f"{1e3 * want:.1f} ms, measured {1e3 * got:.1f} ms.  A device profile measured on this machine "
            f"(python -m autopar.planner --calibrate) or predict_step, which prices the recorded program, "
            f"predicts closer", PredictionGapWarning, stacklevel=2)


def _say(line: str) -> None:
    if get_rank() == 0:
        print(line, flush=True)
