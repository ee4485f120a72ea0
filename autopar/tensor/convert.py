"""Differentiable conversions between a distributed tensor and plain tensors, and between
placements: the autograd functions every layer above builds on (the public `shard_tensor`,
`reshard`, `local_value`, `unshard_dtensor`; the runtime's gradient placement; the
checkpoints' full values).  Each backward puts the gradient where the forward's input was."""
from __future__ import annotations

import functools

import torch

from ..comm import get_world_size
from ..mesh import ProcessMesh
from ..placement import Replicate, Shard
from ..redistribute import piece_of_full, redistribute_local
from ..spec import DistSpec
from . import grad_landing
from .deferred_mean import MEANS
from .dtensor import DistTensor, new_dist


class Reshard(torch.autograd.Function):
    """`x` moved to `spec`; the gradient moves back to `x`'s placements (less Partial)."""

    @staticmethod
    def forward(ctx, x, spec):
        ctx.src = x._spec
        return DistTensor(redistribute_local(x._local, x._spec, spec), spec)

    @staticmethod
    def backward(ctx, grad):
        target = ctx.src.without_partial()
        if type(grad) is not DistTensor:
            return DistTensor(piece_of_full(grad, target), target), None
        return DistTensor(redistribute_local(grad._local, grad._spec, target), target), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.spec = x._spec
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad):
        return DistTensor(grad, ctx.spec)


class FromLocal(torch.autograd.Function):
    """Each rank's `local` as its piece of `spec`; each gets its piece of the gradient back."""

    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        return DistTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        target = ctx.spec.without_partial()
        if type(grad) is DistTensor:
            return redistribute_local(grad._local, grad._spec, target), None
        return piece_of_full(grad, target), None


class _FullValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.spec = x._spec
        return gather_everywhere(x._local, x._spec)

    @staticmethod
    def backward(ctx, grad):
        target = ctx.spec.without_partial()
        return DistTensor(piece_of_full(grad, target), target)


@functools.lru_cache(maxsize=None)
def _world_mesh(world: int) -> ProcessMesh:
    return ProcessMesh(list(range(world)), dim_names=["world"])


def gather_everywhere(local: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """The global value on every rank of the job (not differentiable: `full_value` is)."""
    world = _world_mesh(get_world_size())
    if set(spec.mesh.process_ids) == set(world.process_ids):
        target = spec.with_placements([Replicate()] * spec.mesh.ndim)
    else:
        target = DistSpec(world, [Replicate()], spec.meta)
    return redistribute_local(local, spec, target)


def reshard_to(t: DistTensor, spec: DistSpec) -> DistTensor:
    """`t` under `spec` (same global meta), differentiably; `t` itself when it is there."""
    if MEANS.pending:
        MEANS.read(t)
    return t if spec == t._spec else Reshard.apply(t, spec)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` as a plain tensor (differentiable)."""
    if not isinstance(t, DistTensor):
        return t
    if MEANS.pending:
        MEANS.read(t)
    return _ToLocal.apply(t)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The global value of `t` as a plain tensor on every rank (collective over the job)."""
    if not isinstance(t, DistTensor):
        return t
    if MEANS.pending:
        MEANS.read(t)
    return _FullValue.apply(t)


class GradToPlacement:
    """The gradient hook of a distributed Parameter: a gradient that arrives Replicate on a
    mesh dim where the parameter is sharded (the sum of a sharded output, say) is cut to the
    parameter's piece there, which needs no communication, so that a gradient is never
    larger than its parameter.  Partial dims stay Partial (the optimizer or the
    data-parallel buckets reduce them), and nothing here moves bytes."""

    __slots__ = ("attrs",)
    only_places = True  # (linear: a mean loss's gradients may be scaled after it, `deferred_mean`)

    def __init__(self, param: torch.Tensor):
        # The Parameter's attribute dict, not the Parameter: a hook holding its own tensor is a
        # cycle through autograd's C++ hook list, which the garbage collector cannot see (a
        # dropped model would never be freed).  The dict follows the Parameter through
        # `swap_tensors` (which moves it with the hooks) and through in-place spec changes.
        self.attrs = param.__dict__

    def __call__(self, grad):
        spec = self.attrs.get("_spec")
        if type(grad) is not DistTensor or spec is None or grad._spec.mesh != spec.mesh:
            return None
        have = grad._spec.placements
        target = [
            q if type(p) is Replicate and type(q) is Shard and k > 1 else p
            for p, q, k in zip(have, spec.placements, spec.mesh.shape)
        ]
        placed = grad if tuple(target) == tuple(have) else reshard_to(grad, grad._spec.with_placements(target))
        # a first gradient of the step, into its bucket's slot (`grad_landing`; not under
        # create_graph, where the gradient stays in the graph)
        slot = None if torch.is_grad_enabled() else grad_landing.land_one(self.attrs, placed._local)
        if slot is not None:
            return new_dist(slot, placed._spec)
        return None if placed is grad else placed


def distributed_parameter(t: DistTensor, requires_grad: bool) -> torch.nn.Parameter:
    """`t` as a Parameter whose gradients arrive placed like it (see GradToPlacement)."""
    p = torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        p.register_hook(GradToPlacement(p))
    return p
