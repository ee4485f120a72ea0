"""to_static with a pipeline: the train step as micro-batches in a schedule (`Strategy.pipeline`).

The first call for a batch signature captures one micro-batch's step eagerly (forward, the
loss scaled by 1/accumulate_steps, backward; the random state is put back and the
gradients dropped: the capture only records), cuts the program into its stages' parts
(`stage_split`) and runs the whole batch through them.  Every call runs `accumulate_steps`
micro-batches in the schedule's order on this rank's parts; the cross-mesh transfers are
asynchronous messages posted ahead (`pipelining.runtime`), the parameters' gradients add
up over the micro-batches (those of the batch's mean loss), and the optimizer steps once.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import comm
from ..api.parallelize import check_schedule
from ..tensor.dtensor import DistTensor, local_piece
from ..pipelining.agree import Problem, agree
from ..pipelining.annotated import stage_position
from ..pipelining.orders import schedule_orders
from ..pipelining.runtime import OrderRunner, StepTimes, open_channels
from ..pipelining.transfer import Inbox, Outbox, describe
from .program import Recorder, _fold_aliases
from .stage_split import SplitError, StagedProgram, split_stages

VIRTUAL_MODES = ("VPP", "ZBVPP")  # the schedules of several stages per rank


def check_settings(layer: torch.nn.Module, mode: str, m: int, vpp: int) -> tuple[int, int, frozenset]:
    """(pipeline ranks p, this rank's position, the ranks of its stage mesh) for a schedule the
    model can run; raises
    ValueError (on every rank alike: it depends on the annotations only) otherwise."""
    check_schedule("Strategy.pipeline.", mode, m, vpp)
    if (mode in VIRTUAL_MODES) != (vpp > 1):
        raise ValueError(f"Strategy.pipeline: schedule_mode {mode!r} with vpp_degree {vpp}: VPP and ZBVPP run "
                         f"vpp_degree > 1 stages per rank, the other schedules one")
    meshes, position = stage_position(layer, "Strategy.pipeline")
    p = len(meshes)
    if mode != "FThenB" and m < p:
        raise ValueError(f"Strategy.pipeline: {mode} needs at least {p} micro-batches for its {p} stages, got "
                         f"accumulate_steps={m}")
    if mode in VIRTUAL_MODES and m % p:
        raise ValueError(f"Strategy.pipeline: {mode} needs a multiple of the {p} stage meshes as accumulate_steps, got {m}")
    return p, position, frozenset(meshes[position].process_ids)


def _rng_devices() -> list:
    device = comm.current_device()
    return [device.index] if device.type == "cuda" else []


class ProgramExecutor:
    """Runs the parts of a `StagedProgram` for the schedule's actions, one slot list per
    micro-batch; adds up the gradients and keeps the losses."""

    def __init__(self, staged: StagedProgram, p: int, device):
        self.staged, self.p = staged, p
        self.links: dict = {}
        for key, part in staged.parts.items():
            ins = [self._end(Inbox(m.channel, m.peer, f"{m.channel} ({key[0]}{key[1]})", device, None), m)
                   for _, m in part.receives]
            outs = [self._end(Outbox(m.channel, m.peer, f"{m.channel} ({key[0]}{key[1]})", device), m)
                    for _, m in part.sends]
            self.links[key] = (ins, outs)
        touches = [0] * staged.n_slots
        for part in staged.parts.values():
            for s in part.touched:
                touches[s] += 1
        for out in staged.outputs:
            if hasattr(out, "i"):
                touches[out.i] += 1  # read once more: into the step's sums
        self.touches = touches

    @staticmethod
    def _end(end, message):
        end.agreed = describe((torch.empty(message.shape, dtype=message.dtype, device="meta"),))
        return end

    def all_links(self) -> list:
        return [x for ins, outs in self.links.values() for x in ins + outs]

    def begin(self, inputs: list) -> None:
        """`inputs[i]`: the program's inputs (parameters, buffers, micro-batch i's tensors)."""
        self.inputs = inputs
        self.envs: dict = {}
        self.sums: list = [None] * len(self.staged.outputs)
        self.losses: list = []

    def _key(self, a) -> tuple:
        return (a.kind, a.stage // self.p)

    def incoming(self, a) -> list:
        return self.links[self._key(a)][0]

    def outgoing(self, a) -> list:
        return self.links[self._key(a)][1]

    def compute(self, a, received: list) -> dict:
        key = self._key(a)
        part = self.staged.parts[key]
        if a.mb not in self.envs:
            env = [None] * self.staged.n_slots
            env[: self.staged.n_inputs] = self.inputs[a.mb]
            self.envs[a.mb] = (env, list(self.touches), [0])
        env, left, done = self.envs[a.mb]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            sent = part.run(env, [r[0] for r in received])
        for j, (out, final) in enumerate(zip(self.staged.outputs, self.staged.final_part)):
            if final == key:
                self._collect(j, env[out.i])
                self._release(env, left, [out.i])
        self._release(env, left, part.touched)
        done[0] += 1
        if done[0] == len(self.staged.parts):
            del self.envs[a.mb]
        return {end: (t,) for end, t in zip(self.outgoing(a), sent)}

    def _release(self, env: list, left: list, slots) -> None:
        n_inputs = self.staged.n_inputs
        for s in slots:
            left[s] -= 1
            if left[s] == 0 and s >= n_inputs:
                env[s] = None

    def _collect(self, j: int, value: torch.Tensor) -> None:
        if j == 0:
            self.losses.append(value)
        elif self.sums[j] is None:
            self.sums[j] = value.clone()
        else:
            self.sums[j].add_(value)

    def drop(self) -> None:
        self.envs.clear()


class PipelinedProgram:
    """A captured micro-batch step, cut into parts, and what it needs to run a whole batch."""

    def __init__(self, staged: StagedProgram, loss_spec, grad_specs: list, mode: str, m: int, vpp: int, p: int,
                 position: int, device):
        self.staged, self.loss_spec, self.grad_specs = staged, loss_spec, grad_specs
        self.m, self.mode = m, mode
        self.order = schedule_orders(mode, p, m, vpp)[position]
        self.executor = ProgramExecutor(staged, p, device)
        open_channels(self.executor.all_links())
        self.runner = OrderRunner(self.executor, self.order)
        self.last_times: Optional[StepTimes] = None

    def run(self, inputs: list, holders: list):
        """Every micro-batch (`inputs[i]`: its program inputs); sets the holders' gradients and
        returns the mean loss."""
        self.executor.begin(inputs)
        try:
            self.last_times = self.runner.run(f"DistModel step (Strategy.pipeline {self.mode})")
        finally:
            self.executor.drop()
        sums = iter(self.executor.sums[1:])
        for p, spec in zip(holders, self.grad_specs):
            if spec is not None:
                local = next(sums)
                p.grad = DistTensor(local, spec) if spec is not False else local
        losses = self.executor.losses
        if losses:
            local = losses[0].clone()
            for loss in losses[1:]:
                local.add_(loss)
            local.div_(self.m)
        else:  # off the loss's mesh: its empty piece
            local = local_piece(self.staged.outputs[0])
        return DistTensor(local, self.loss_spec) if self.loss_spec is not None else local

    def __str__(self) -> str:
        head = f"pipeline {self.mode}, {self.m} micro-batches, this rank: " + " ".join(
            a.label(self.staged.chunks > 1) for a in self.order)
        return head + "\n" + str(self.staged)


def capture(forward: Callable, batch: tuple, inputs: list, holders: list, settings: tuple, p: int, position: int,
            stage_ranks: frozenset):
    """Record one micro-batch's train step (`forward(batch)` -> loss) and cut it into parts.
    `inputs`: the program inputs (parameters, buffers, the batch's tensors); `stage_ranks`:
    this rank's stage mesh (transfers among them, as `shard_tensor` from the mesh's first
    rank, are steps of a part, not messages between stages)."""
    mode, m, vpp = settings
    for h in holders:
        h.grad = None
    recorder = Recorder([local_piece(t) for t in inputs])
    with torch.random.fork_rng(devices=_rng_devices()):
        try:
            with torch.enable_grad(), recorder:
                loss = forward(batch)
                mark = len(recorder.entries)
                (loss * (1.0 / m)).backward()
        finally:
            recorder.close()
    grads = [h.grad for h in holders]
    for h in holders:
        h.grad = None
    outputs = [local_piece(loss)] + [local_piece(g) for g in grads if g is not None]
    backward = {id(e) for e in recorder.entries[mark:]}
    entries, outs = _fold_aliases(recorder.entries, [recorder.slot(o) for o in outputs])
    meta = [(tuple(t.shape), t.dtype) for t in recorder.alive]
    me = comm.get_rank()
    problem, staged = None, None
    try:
        staged = split_stages(entries, backward, recorder.n_inputs, recorder.n_slots, outs, meta, me,
                              stage_ranks, zero_bubble=mode in ("ZBH1", "ZBVPP"))
        if staged.chunks != vpp:
            raise SplitError(f"rank {me}'s step holds {staged.chunks} stage(s) of the pipeline, but "
                             f"Strategy.pipeline asks for {vpp} per rank (vpp_degree)")
    except SplitError as e:
        problem = Problem(f"to_static with Strategy.pipeline: {e}")
    agree(problem, tuple(range(comm.get_world_size())), "to_static with Strategy.pipeline")
    loss_spec = loss._spec if type(loss) is DistTensor else None
    grad_specs = [None if g is None else (g._spec if type(g) is DistTensor else False) for g in grads]
    device = next((local_piece(t).device for t in inputs), comm.current_device())
    return PipelinedProgram(staged, loss_spec, grad_specs, mode, m, vpp, p, position, device)
