"""The schedules: a batch in micro-batches through the stages, in a chosen order.

`schedule.step(x, target=y, losses=list)` runs on every rank with the same batch: the first
stage reads `x`, the last `y` (the others only check that both cut evenly, so a bad batch
fails everywhere alike).  The stages' gradients are those of the mean of the micro-batch
losses, the whole batch's mean loss: a pipelined step equals the single-process step.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import comm
from ..tensor.dtensor import DistTensor
from ..api.tensors import reshard
from ..placement import Replicate
from .microbatch import split_batch
from .orders import Orders, fthenb, format_orders, interleaved, one_f_one_b, zbh1, zbvpp
from .executor import StageExecutor
from .runtime import OrderRunner, StepTimes, format_times, open_channels
from .shared import TiedParameters
from .stage import PipelineStage


def _signature(values: tuple) -> tuple:
    return tuple(v._spec if type(v) is DistTensor else (tuple(v.shape), v.dtype) for v in values)


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (a Partial distributed loss is reduced on the last stage's ranks)."""
    if type(loss) is not DistTensor:
        return loss
    if any(p.is_partial() for p in loss._spec.placements):
        loss = reshard(loss, loss._spec.mesh, [Replicate()] * loss._spec.mesh.ndim)
    return loss._local


class PipelineSchedule:
    """What every schedule shares: the step, the order per rank and the measured times."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable,
                 orders: Callable[[int, int], Orders], min_microbatches: int = 1):
        name = type(self).__name__
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name} needs PipelineStage objects, got {stages!r}")
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if n_microbatches < min_microbatches:
            raise ValueError(
                f"{name} needs at least {min_microbatches} micro-batches for its {stages[0].num_stages} stages, "
                f"got n_microbatches={n_microbatches}"
            )
        if not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable (output, target) -> scalar loss, got {loss_fn!r}")
        self.stages, self.n_microbatches, self.loss_fn = list(stages), n_microbatches, loss_fn
        self.ranks, self.num_stages = stages[0].ranks, stages[0].num_stages
        self.orders = orders(len(self.ranks), n_microbatches)
        mine = self.orders[self.ranks.index(comm.get_rank())]
        self._executor = StageExecutor({s.stage_index: s for s in stages}, self.num_stages)
        open_channels(self._executor.links)
        self._runner = OrderRunner(self._executor, mine)
        self._tied = TiedParameters(self.stages, self.ranks)
        self._signature: Optional[tuple] = None
        self.last_times: Optional[StepTimes] = None

    def step(self, *args, target=None, losses: Optional[list] = None) -> None:
        """One step over the batch `args` (the first stage's inputs) and `target` (the loss's
        second argument), on every rank; on the last stage, `losses` receives each
        micro-batch's loss.  The stages' parameters get the gradients of the mean loss."""
        name = type(self).__name__
        if not args:
            raise TypeError(f"{name}.step needs the batch on every rank (the first stage reads it)")
        m = self.n_microbatches
        xs = split_batch(args if len(args) > 1 else args[0], m, f"{name}.step: x")
        ys = split_batch(target, m, f"{name}.step: target") if target is not None else [()] * m
        signature = _signature(xs[0]) + _signature(ys[0])
        if signature != self._signature:
            self._executor.renew()
        self._signature = None  # until this step succeeds
        self._executor.begin(xs, ys, self.loss_fn, 1.0 / m)
        try:
            self.last_times = self._runner.run(f"{name}.step")
        except BaseException:
            self._executor.drop_held()
            raise
        found = self._executor.losses
        self._signature = signature
        self._tied.sum_grads()
        if losses is not None:
            losses.extend(_plain(loss) for loss in found)

    def format_order(self) -> str:
        """The order of every rank, one row each (`rank 0: F0 F1 B0 ...`)."""
        return format_orders(self.orders)

    def format_times(self) -> str:
        """The last step's time per rank of the pipeline: computing, sending, idle (the
        bubble: waiting for a message), collective over the pipeline's ranks."""
        return format_times(self.last_times, self.ranks)


class _OneStagePerRank(PipelineSchedule):
    """A schedule of one stage per rank; subclasses name their order."""

    order: Callable = staticmethod(fthenb)
    needs_a_microbatch_per_stage = False

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable):
        name = type(self).__name__
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{name} needs one PipelineStage (ScheduleVPP takes a list), got {stage!r}")
        if stage.num_stages != len(stage.ranks):
            raise ValueError(
                f"{name} runs one stage per rank: {stage.num_stages} stages on the {len(stage.ranks)} ranks "
                f"{list(stage.ranks)}; give ScheduleVPP the stages of each rank"
            )
        least = stage.num_stages if self.needs_a_microbatch_per_stage else 1
        super().__init__([stage], n_microbatches, loss_fn, type(self).order, min_microbatches=least)


class ScheduleFThenB(_OneStagePerRank):
    """Every micro-batch's forward, then every backward (GPipe): simple, holds all micro-batches.

    >>> import torch
    >>> from autopar.pipelining import PipelineStage
    >>> stage = PipelineStage(torch.nn.Linear(4, 1), 0, 1)
    >>> print(ScheduleFThenB(stage, 2, torch.nn.functional.mse_loss).format_order())
    rank 0: F0 F1 B0 B1
    """

    order = staticmethod(fthenb)


class Schedule1F1B(_OneStagePerRank):
    """One forward, one backward: stage s holds at most num_stages - s micro-batches.
    Needs at least as many micro-batches as stages (see `PipelineStage` for a step)."""

    order = staticmethod(one_f_one_b)
    needs_a_microbatch_per_stage = True


class ScheduleZBH1(_OneStagePerRank):
    """Zero bubble (ZB-H1): 1F1B whose backward is split into the input gradient (sent back at
    once) and the weight gradient (run where the rank would wait); the peak memory of 1F1B's
    first stage on every stage.

    >>> from autopar.pipelining.orders import format_orders, zbh1
    >>> print(format_orders(zbh1(2, 2)))
    rank 0: F0 F1 I0 W0 I1 W1
    rank 1: F0 I0 F1 I1 W0 W1
    """

    order = staticmethod(zbh1)
    needs_a_microbatch_per_stage = True


class ScheduleVPP(PipelineSchedule):
    """Interleaved 1F1B over a virtual pipeline: this rank's stages (`[stage r, stage r+p, ...]`
    for p pipeline ranks) take turns, cutting the bubble by their number.  Needs a multiple
    of p micro-batches.

    >>> import torch
    >>> from autopar.pipelining import PipelineStage
    >>> stages = [PipelineStage(torch.nn.Linear(4, 4), k, 2) for k in range(2)]
    >>> print(ScheduleVPP(stages, 1, torch.nn.functional.mse_loss).format_order())
    rank 0: F0s0 F0s1 B0s1 B0s0
    """

    order: Callable = staticmethod(interleaved)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Callable):
        name = type(self).__name__
        if isinstance(stages, PipelineStage) or not stages:
            raise TypeError(f"{name} needs the list of this rank's PipelineStages, got {stages!r}")
        ranks, n = stages[0].ranks, stages[0].num_stages
        p = len(ranks)
        me = comm.get_rank()
        want = [k for k in range(n) if ranks[k % p] == me]
        got = sorted(s.stage_index for s in stages)
        if any(s.ranks != ranks or s.num_stages != n for s in stages) or got != want:
            raise ValueError(
                f"{name} on rank {me}: it needs this rank's stages {want} of {n} (stage i on rank i % {p} of "
                f"{list(ranks)}), got stages {got}"
            )
        v = n // p
        if isinstance(n_microbatches, int) and n_microbatches % p:
            raise ValueError(f"{name} needs a multiple of the {p} pipeline ranks as n_microbatches, "
                             f"got {n_microbatches}")
        order = type(self).order
        super().__init__(sorted(stages, key=lambda s: s.stage_index), n_microbatches, loss_fn,
                         lambda ranks_, m: order(ranks_, v, m), min_microbatches=p)


class ScheduleZBVPP(ScheduleVPP):
    """Zero bubble over a virtual pipeline (torch's ScheduleInterleavedZeroBubble, Paddle's
    ZBVPP): interleaved 1F1B with each backward split into the input gradient, sent back at
    once, and the weight gradient, run where the rank would wait; about a third of interleaved
    1F1B's bubble, and no rank holds more activations than interleaved 1F1B's first.

    >>> import torch
    >>> from autopar.pipelining import PipelineStage
    >>> stages = [PipelineStage(torch.nn.Linear(4, 4), k, 2) for k in range(2)]
    >>> print(ScheduleZBVPP(stages, 1, torch.nn.functional.mse_loss).format_order())
    rank 0: F0s0 F0s1 I0s1 I0s0 W0s1 W0s0
    """

    order = staticmethod(zbvpp)


__all__ = ["PipelineSchedule", "Schedule1F1B", "ScheduleFThenB", "ScheduleVPP", "ScheduleZBH1", "ScheduleZBVPP"]
