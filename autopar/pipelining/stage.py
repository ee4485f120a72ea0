"""PipelineStage: one piece of a model, its place in the pipeline, and its per-micro-batch work.

A stage keeps, per micro-batch between its forward and its backward, the inputs it made into
autograd leaves and the outputs (or loss) to start the backward from: what a pipeline holds
in memory.  The schedule decides when each micro-batch runs; the stage only computes.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import comm
from ..tensor.dtensor import DistTensor
from ..mesh import ProcessMesh
from .agree import Problem, agree
from .split_backward import backward_input, backward_weight


def pipeline_ranks(group: Optional[ProcessMesh]) -> tuple:
    """The pipeline's ranks in stage order: the group's, or the whole job's."""
    if group is None:
        return tuple(range(comm.get_world_size()))
    if not isinstance(group, ProcessMesh):
        raise TypeError(f"PipelineStage group must be a ProcessMesh of the pipeline's ranks or None, got {group!r}")
    return tuple(group.process_ids)


def _mesh_of(module: torch.nn.Module, what: str) -> Optional[ProcessMesh]:
    meshes = {p._spec.mesh for p in module.parameters() if type(p) is DistTensor}
    if len(meshes) > 1:
        raise ValueError(f"{what}: its module's distributed parameters live on several meshes {sorted(map(str, meshes))}")
    return meshes.pop() if meshes else None


class PipelineStage:
    """Stage `stage_index` of `num_stages`: `module` runs on rank `i % len(group)` of the
    pipeline's ranks (`group`, a ProcessMesh; None: the whole job).  A rank may hold several
    stages (virtual pipeline).  `shared_parameters=[{"params": [p_a, p_b]}]` ties parameters
    held by different stages (a tied embedding and LM head): each schedule step sums their
    gradients across the stages, so the copies stay equal.  Every rank of the group builds
    its stages together (they check each other: a bad `stage_index` fails on every rank).

    >>> import torch, autopar as dist
    >>> from autopar.pipelining import PipelineStage, Schedule1F1B
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> stage = PipelineStage(torch.nn.Linear(4, 2), stage_index=0, num_stages=1)
    >>> schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    >>> losses = []
    >>> schedule.step(torch.ones(4, 4), target=torch.zeros(4, 2), losses=losses)
    >>> len(losses), stage.module.weight.grad.shape
    (2, torch.Size([2, 4]))
    """

    def __init__(self, module: torch.nn.Module, stage_index: int, num_stages: int,
                 group: Optional[ProcessMesh] = None, shared_parameters: Optional[list] = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"PipelineStage needs a torch.nn.Module, got {type(module).__name__}")
        self.module, self.stage_index, self.num_stages = module, stage_index, num_stages
        self.ranks = pipeline_ranks(group)
        self.rank = comm.get_rank()
        self.shared_parameters = shared_parameters
        agree(self._problem(), self.ranks, f"PipelineStage(stage_index={stage_index}, num_stages={num_stages})")
        self.mesh = _mesh_of(module, f"stage {stage_index}")
        self.device = next((p._local.device if type(p) is DistTensor else p.device for p in module.parameters()),
                           comm.current_device())
        # whether the backward can be split into input and weight steps (distributed
        # parameters' gradients are placed and reduced by autopar's own autograd nodes)
        self.splittable = not any(type(p) is DistTensor for p in module.parameters())
        self._held: dict = {}  # micro-batch -> (input leaves, outputs) until its backward
        self._weight_pending: dict = {}  # micro-batch -> (PendingWeightGrad, outputs) until its W
        self.peak_held = 0

    def _problem(self) -> Optional[Problem]:
        n, k, p = self.num_stages, self.stage_index, len(self.ranks)
        where = f"on rank {self.rank}"
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return Problem(f"PipelineStage {where}: num_stages must be an int >= 1, got {n!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n:
            return Problem(f"PipelineStage {where}: stage_index {k!r} is out of range for num_stages {n} (0..{n - 1})")
        if n % p:
            return Problem(f"PipelineStage {where}: num_stages {n} is not a multiple of the {p} pipeline ranks "
                           f"{list(self.ranks)} (stage i runs on rank i % {p})")
        if self.ranks[k % p] != self.rank:
            return Problem(f"PipelineStage {where}: stage {k} runs on rank {self.ranks[k % p]} of the pipeline ranks "
                           f"{list(self.ranks)} (stage i on rank i % {p}), not on rank {self.rank}")
        if self.shared_parameters is not None:
            entries = self.shared_parameters
            if not isinstance(entries, (list, tuple)) or not all(
                isinstance(e, dict) and isinstance(e.get("params"), (list, tuple)) and len(e["params"]) >= 2
                and all(isinstance(q, torch.Tensor) for q in e["params"]) for e in entries
            ):
                return Problem(f"PipelineStage {where}: shared_parameters must be a list of "
                               f"{{'params': [param_a, param_b, ...]}} (two or more tensors each), got {entries!r}")
        return None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def rank_of(self, stage_index: int) -> int:
        return self.ranks[stage_index % len(self.ranks)]

    # -- one micro-batch --------------------------------------------------------------------
    def forward(self, mb: int, inputs: tuple, loss_fn: Optional[Callable] = None, target: Optional[tuple] = None,
                scale: float = 1.0):
        """Run the module on one micro-batch; keep what its backward needs.  Returns the
        outputs (a tuple), or on the last stage the loss (`loss_fn(output, *target)`); the
        backward starts from the loss times `scale`."""
        leaves = tuple(inputs)  # received values are leaves already; the first stage's need no gradient
        out = self.module(*leaves)
        if self.is_last:
            loss = loss_fn(out, *target) if target else loss_fn(out)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"stage {self.stage_index}: loss_fn must return a scalar tensor, got {loss!r}")
            self._hold(mb, leaves, (loss * scale,))
            return loss
        outputs = out if isinstance(out, tuple) else (out,)
        for n, o in enumerate(outputs):
            if o is not None and not isinstance(o, torch.Tensor):
                raise TypeError(f"stage {self.stage_index}: output {n} is a {type(o).__name__}; a stage passes tensors on")
        self._hold(mb, leaves, outputs)
        return outputs

    def _hold(self, mb: int, leaves: tuple, outputs: tuple) -> None:
        self._held[mb] = (leaves, outputs)
        self.peak_held = max(self.peak_held, len(self._held) + len(self._weight_pending))

    def _start(self, mb: int, grads: Optional[tuple]):
        leaves, outputs = self._held.pop(mb)
        grads = (None,) * len(outputs) if grads is None else grads
        pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and o.requires_grad]
        inputs = [x for x in leaves if x is not None and x.requires_grad and not self.is_first]
        return leaves, [o for o, _ in pairs], [g for _, g in pairs], inputs

    def backward(self, mb: int, grads: Optional[tuple]) -> tuple:
        """The whole backward of one micro-batch: parameters' `.grad` accumulate; returns the
        inputs' gradients (None where an input needs none)."""
        leaves, outputs, grads, _ = self._start(mb, grads)
        if outputs:
            torch.autograd.backward(outputs, grads)
        if self.is_first:
            return ()
        return tuple(None if x is None or not x.requires_grad else x.grad for x in leaves)

    def backward_input(self, mb: int, grads: Optional[tuple]) -> tuple:
        """The inputs' gradients only; `backward_weight(mb)` adds the parameters' later."""
        if not self.splittable:
            return self.backward(mb, grads)
        leaves, outputs, grads, inputs = self._start(mb, grads)
        params = [p for p in self.module.parameters() if p.requires_grad]
        found, pending = backward_input(outputs, grads, inputs, params) if outputs else ([], None)
        if pending is not None:
            self._weight_pending[mb] = (pending, outputs)
        if self.is_first:
            return ()
        by_leaf = dict(zip(map(id, inputs), found))
        return tuple(None if x is None else by_leaf.get(id(x)) for x in leaves)

    def backward_weight(self, mb: int) -> None:
        held = self._weight_pending.pop(mb, None)
        if held is not None:
            backward_weight(held[0])

    def holds(self) -> int:
        """Micro-batches whose activations this stage holds now."""
        return len(self._held) + len(self._weight_pending)

    def drop_held(self) -> None:
        """Forget every held micro-batch (after a failed step)."""
        self._held.clear()
        self._weight_pending.clear()


__all__ = ["PipelineStage", "pipeline_ranks"]
