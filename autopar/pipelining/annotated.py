"""Schedules for annotated models in the dynamic mode: no stage modules, no rewrite.

A model whose layers carry their stage's mesh (`reshard` between meshes, as in
examples/pipeline_parallel.py, or `parallelize` with `pp_config`) already runs as a
pipeline: every rank runs the whole forward, computes only the ops on its own mesh and
sends or receives where the code moves a tensor across meshes; `loss.backward()` on every
rank sends the gradients back.  What `build_schedule` adds is the micro-batches and their
order: each rank runs forward and backward of micro-batch i when its stage's order says so
(FThenB or 1F1B), so the stages work on different micro-batches at once.  Cross-mesh sends
are posted without waiting for the receiver (`comm.deferred_sends`), so ranks in different
phases of 1F1B never wait for each other's sends; receives are taken when the code reaches
them.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .. import comm
from ..tensor.dtensor import DistTensor
from ..mesh import ProcessMesh
from .microbatch import split_batch
from .orders import format_orders, schedule_orders
from .runtime import StepTimes, format_times

DYNAMIC_MODES = ("FThenB", "1F1B")  # the schedules of one stage per mesh, every rank running the whole forward


def stage_meshes(model: torch.nn.Module) -> list[ProcessMesh]:
    """The pipeline stages of an annotated model: the meshes its parameters live on, in the
    order they first appear, leaving out a mesh that contains another (a layer on every
    stage, `global_spec`).  Stage meshes must not overlap."""
    seen: list = []
    for p in model.parameters():
        if type(p) is DistTensor and p._spec.mesh not in seen:
            seen.append(p._spec.mesh)
    ids = {m: set(m.process_ids) for m in seen}
    stages = [m for m in seen if not any(o != m and ids[o] < ids[m] for o in seen)]
    for i, a in enumerate(stages):
        for b in stages[i + 1:]:
            if ids[a] & ids[b]:
                raise ValueError(f"pipeline stages must be on disjoint meshes: {a} and {b} share ranks "
                                 f"{sorted(ids[a] & ids[b])}")
    return stages


def stage_position(model: torch.nn.Module, what: str) -> tuple[list, int]:
    """The model's stage meshes and the index of the one this rank is on."""
    meshes = stage_meshes(model)
    me = comm.get_rank()
    where = [s for s, m in enumerate(meshes) if me in m]
    if not where:
        raise ValueError(f"{what}: rank {me} is on none of the model's stage meshes {[m.process_ids for m in meshes]}")
    return meshes, where[0]


def _settings_of(model: torch.nn.Module, schedule_mode: Optional[str], accumulate_steps: Optional[int]) -> tuple:
    """The schedule and micro-batch count: as given, else from `parallelize`'s pp_config."""
    stored = getattr(model, "_autopar_pipeline", {})
    mode = schedule_mode if schedule_mode is not None else stored.get("schedule_mode", "1F1B")
    steps = accumulate_steps if accumulate_steps is not None else stored.get("accumulate_steps", 1)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"accumulate_steps (micro-batches per step) must be an int >= 1, got {steps!r}")
    return mode, steps


class ModelSchedule:
    """An annotated model run by micro-batches in a schedule's order; build with `build_schedule`."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, schedule_mode: str, accumulate_steps: int):
        if schedule_mode not in DYNAMIC_MODES:
            raise ValueError(
                f"build_schedule: schedule_mode {schedule_mode!r} is not one of {list(DYNAMIC_MODES)} in the "
                f"dynamic mode (VPP, ZBH1 and ZBVPP need the stages as modules: autopar.pipelining.PipelineStage, or "
                f"to_static with Strategy.pipeline)"
            )
        meshes, stage = stage_position(model, "build_schedule")
        self.model, self.loss_fn, self.meshes = model, loss_fn, meshes
        self.schedule_mode, self.n_microbatches, self.stage = schedule_mode, accumulate_steps, stage
        self.orders = schedule_orders(schedule_mode, len(meshes), accumulate_steps)
        self.last_times: Optional[StepTimes] = None
        self.peak_held = 0

    def step(self, *args, target=None, losses: Optional[list] = None) -> torch.Tensor:
        """One step over the batch on every rank: returns the mean of the micro-batch losses
        (as the model's loss is: distributed, on the last stage); `losses` receives each
        micro-batch's loss.  The parameters get the gradients of that mean."""
        m = self.n_microbatches
        xs = split_batch(args if len(args) > 1 else args[0], m, "ModelSchedule.step: x")
        ys = split_batch(target, m, "ModelSchedule.step: target") if target is not None else [()] * m
        held: dict = {}
        found: list = []
        start = time.perf_counter()
        with comm.deferred_sends() as window:
            for a in self.orders[self.stage]:
                if a.kind == "F":
                    loss = self.loss_fn(self.model(*xs[a.mb]), *ys[a.mb])
                    held[a.mb] = loss
                    found.append(loss.detach())
                    self.peak_held = max(self.peak_held, len(held))
                else:
                    (held.pop(a.mb) * (1.0 / m)).backward()
        total = time.perf_counter() - start
        idle, send = window.recv_seconds, window.send_seconds
        self.last_times = StepTimes(total - idle - send, send, idle, total)
        if losses is not None:
            losses.extend(found)
        with torch.no_grad():
            mean = found[0]
            for loss in found[1:]:
                mean = mean + loss
            return mean / m

    def format_order(self) -> str:
        """The order of every stage (with its ranks), one row each."""
        rows = format_orders(self.orders).splitlines()
        return "\n".join(f"stage {s} {m.process_ids}: {row.partition(': ')[2]}"
                         for s, (m, row) in enumerate(zip(self.meshes, rows)))

    def format_times(self) -> str:
        """The last step's time per rank: computing, sending, idle (collective over the job)."""
        return format_times(self.last_times, tuple(range(comm.get_world_size())))


def build_schedule(model: torch.nn.Module, loss_fn: Callable, schedule_mode: Optional[str] = None,
                   accumulate_steps: Optional[int] = None) -> ModelSchedule:
    """Run an annotated model (layers on their stages' meshes) by micro-batches in the dynamic
    mode.  `schedule_mode` ("FThenB" or "1F1B") and `accumulate_steps` (micro-batches per
    step) default to the model's `parallelize` pp_config, else 1F1B and 1.

    >>> import torch, autopar as dist
    >>> from autopar.pipelining import build_schedule
    >>> mesh = dist.ProcessMesh([0], dim_names=["pp"])
    >>> model = dist.shard_layer(torch.nn.Linear(4, 2), mesh)
    >>> schedule = build_schedule(model, torch.nn.functional.mse_loss, "1F1B", accumulate_steps=2)
    >>> loss = schedule.step(torch.ones(4, 4), target=torch.zeros(4, 2))
    >>> print(schedule.format_order())
    stage 0 [0]: F0 B0 F1 B1
    """
    mode, steps = _settings_of(model, schedule_mode, accumulate_steps)
    return ModelSchedule(model, loss_fn, mode, steps)
