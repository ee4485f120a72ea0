"""Gradients to their parameters' placements: bucketed all-reduces, overlapped with backward.

A data-parallel gradient arrives Partial (each rank holds its batch's share) and must be
summed over the data-parallel ranks before the optimizer step.  Two places do it:

- `reduce_grads` (the optimizer's pre-step, `shard_optimizer`): gradients that only need an
  all-reduce share one flat buffer per (mesh, reduced mesh dims, reduce op, dtype) and one
  collective, as DDP's buckets do, instead of one per parameter;
- `BucketPlan` (local regions, for parameters a ZeRO-less `shard_optimizer` steps): the
  region's parameters are cut into DDP-sized buckets in reverse order (about the order
  backward produces their gradients).  Each backward through the region starts a bucket's
  all-reduce as soon as its last gradient is ready, while backward goes on with the
  earlier layers (a model whose gradients fit one bucket has nothing to overlap: its
  bucket starts at the end); the region's last backward step waits for them and hands the
  parameters gradients that are already placed like them, so the optimizer has nothing
  left to reduce.
  Every rank runs the same backward, so the buckets start in the same order everywhere.
  Gradient accumulation (a backward while the parameters still hold gradients) switches a
  region's plan to deferred reduction for good: the gradients it already reduced become
  Partial again without communication, later backwards leave them Partial (summed locally),
  and the optimizer reduces the sum once per step, where reducing every backward (DDP
  without `no_sync`) would cost one all-reduce per micro-batch.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .comm import all_reduce, all_reduce_start, get_rank
from .dtensor import DistTensor, new_dist
from .placement import Partial, Replicate
from .reshard import redistribute_local
from .spec import DistSpec

FIRST_BUCKET_BYTES = 1 << 20  # DDP's: the last layers' gradients start moving early
BUCKET_BYTES = 25 << 20

_GRAD_PLANS: dict = {}


def _reductions(src: DistSpec, dst: DistSpec):
    """The (mesh dims, reduce op) of an all-reduce that alone takes src to dst's local
    pieces, or None when src -> dst needs more than that.  Mesh dims of size 1 hold the
    whole tensor whatever their placement, so they never differ."""
    if src.mesh != dst.mesh:
        return None
    dims, op = [], None
    for m, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if a == b or src.mesh.shape[m] == 1:
            continue
        if type(a) is not Partial or type(b) is not Replicate or op not in (None, a.reduce_type):
            return None
        dims.append(m)
        op = a.reduce_type
    return tuple(dims), op


def grad_plan(grad: DistSpec, param: DistSpec) -> tuple:
    """(whether the gradient must move, the all-reduce that moves it or None for a general
    reshard, its spec once placed like the parameter); specs are interned, so the plan of a
    (gradient, parameter) spec pair is worked out once."""
    plan = _GRAD_PLANS.get((grad, param))
    if plan is None:
        moves = grad.mesh != param.mesh or any(type(pl) is Partial for pl in grad.placements)
        plan = (moves, _reductions(grad, param), DistSpec(param.mesh, param.placements, grad.meta))
        _GRAD_PLANS[(grad, param)] = plan
    return plan


def reduce_grads(pending: list) -> None:
    """Bring each parameter's gradient to the parameter's placements, given (parameter, its
    `grad_plan`) pairs: one all-reduce per bucket of gradients that need only that, a
    reshard for the rest."""
    from .api.tensor import reshard

    buckets: dict = {}
    # last parameter first, as a region's backward buckets them: the same flat layout sums
    # each element in the same order (a ring all-reduce's order depends on the position)
    for p, (_, how, placed) in reversed(pending):
        g = p.grad
        if how is None:
            p.grad = reshard(g.detach(), p._spec.mesh, p._spec.placements)
        else:
            buckets.setdefault((p._spec.mesh, how, g.dtype), []).append((p, g._local, placed))
    rank = get_rank()
    for (mesh, (dims, op), _), entries in buckets.items():
        locals_ = [local for _, local, _ in entries]
        if dims and rank in mesh and sum(t.numel() for t in locals_):
            flat = all_reduce(_flatten(locals_), mesh.group_of(rank, dims), op, inplace=True)
            locals_ = _unflatten(flat, locals_)
        for (p, _, placed), local in zip(entries, locals_):
            p.grad = new_dist(local, placed)


def _flatten(tensors: list) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, like: list) -> list:
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in like]), like)]


# -- reduction in backward -------------------------------------------------------------------
_IN_BACKWARD: dict = {}  # id(parameter) -> weak reference (tensors compare elementwise: no WeakSet)
_GENERATION = [0]  # bumped by every registration: regions rebuild their bucket plans


def generation() -> int:
    """Changes whenever parameters are registered for reduction in backward."""
    return _GENERATION[0]


def reduce_in_backward(params) -> None:
    """Let local regions all-reduce these parameters' gradients during backward (the
    parameters a ZeRO-less `shard_optimizer` steps: their gradients go to the parameters'
    placements whole, so reducing them early changes nothing but the timing)."""
    for p in params:
        if type(p) is DistTensor:
            _IN_BACKWARD[id(p)] = weakref.ref(p, lambda _, key=id(p): _IN_BACKWARD.pop(key, None))
    _GENERATION[0] += 1


def _reduced_in_backward(p) -> bool:
    ref = _IN_BACKWARD.get(id(p))
    return ref is not None and ref() is p


class _Bucket:
    __slots__ = ("members", "ranks", "op", "nbytes")

    def __init__(self, ranks: tuple, op):
        self.members, self.ranks, self.op, self.nbytes = [], ranks, op, 0


class BucketPlan:
    """How a region's parameter gradients (positions in its list of parameters) are bucketed."""

    def __init__(self, buckets: list, placed: dict):
        self.buckets, self.placed = buckets, placed
        # with one bucket there is nothing to overlap: no readiness hooks, the region's last
        # backward step reduces it (where DDP does too), placing the gradients once
        self.overlap = len(buckets) > 1
        self.bucket_of = {i: b for b in buckets for i in b.members}
        self.deferred = False  # gradient accumulation seen: the optimizer reduces, once per step

    @staticmethod
    def build(params: list, grad_specs: list) -> Optional["BucketPlan"]:
        """None when no parameter's gradient is reduced in backward."""
        rank = get_rank()
        filling: dict = {}  # (mesh, reduction, dtype) -> the bucket being filled
        buckets, placed = [], {}
        for i in reversed(range(len(params))):
            p, gs = params[i], grad_specs[i]
            if not _reduced_in_backward(p) or not p.requires_grad or rank not in p._spec.mesh:
                continue
            _, how, spec = grad_plan(gs, p._spec)
            if how is None or not how[0]:
                continue
            key = (p._spec.mesh, how, gs.meta.dtype)
            nbytes = p._local.numel() * p._local.element_size()
            b = filling.get(key)
            if b is None or b.nbytes + nbytes > (FIRST_BUCKET_BYTES if b is buckets[0] else BUCKET_BYTES):
                b = filling[key] = _Bucket(p._spec.mesh.group_of(rank, how[0]), how[1])
                buckets.append(b)
            b.members.append(i)
            b.nbytes += nbytes
            placed[i] = spec
        if not buckets:
            return None
        return BucketPlan(buckets, placed)

    def reduction(self, params: list, grad_specs: list) -> Optional["BackwardReduction"]:
        """The state for one forward's backward, or None once reduction is deferred.  A
        parameter still holding a gradient means accumulation: defer from now on, and give
        the gradients reduced so far back their Partial placement (a local step: one rank
        keeps the value), so that the next gradients add to them without communication."""
        if not self.deferred and any(params[i].grad is not None for i in self.placed):
            self.deferred = True
            for i, spec in self.placed.items():
                g = params[i].grad
                if type(g) is DistTensor and g._spec is spec:
                    params[i].grad = new_dist(redistribute_local(g._local, spec, grad_specs[i]), grad_specs[i])
        return None if self.deferred else BackwardReduction(self)


class BackwardReduction:
    """One forward's bucket state: gradients as hooks see them, all-reduces in flight."""

    def __init__(self, plan: BucketPlan):
        self.plan = plan
        self._reset()

    def _reset(self) -> None:
        self.grads: dict = {}
        self.ready = {id(b): 0 for b in self.plan.buckets}
        self.pending: dict = {}  # id(bucket) -> PendingAllReduce

    def watch(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """A view of parameter i's local piece whose gradient hook counts it ready."""
        v = local.view_as(local)
        v.register_hook(lambda g, i=i: self._ready(i, g))
        return v

    def _ready(self, i: int, grad: torch.Tensor) -> None:
        self.grads[i] = grad
        b = self.plan.bucket_of[i]
        self.ready[id(b)] += 1
        if self.ready[id(b)] == len(b.members):
            self._start(b)

    def _start(self, b: _Bucket) -> None:
        present = [self.grads[i] for i in b.members if i in self.grads]
        if present:
            self.pending[id(b)] = all_reduce_start(_flatten(present), b.ranks, b.op)

    def finish(self, grads: list) -> dict:
        """{parameter position: reduced gradient, placed like its parameter}, once every
        bucket is reduced (a bucket some of whose parameters got no gradient starts now)."""
        for b in self.plan.buckets:
            if id(b) not in self.pending:
                for i in b.members:
                    if i not in self.grads and grads[i] is not None:
                        self.grads[i] = grads[i]
                self._start(b)
        out = {}
        for b in self.plan.buckets:
            pending = self.pending.get(id(b))
            if pending is None:
                continue
            mine = [i for i in b.members if i in self.grads]
            for i, g in zip(mine, _unflatten(pending.wait(), [self.grads[i] for i in mine])):
                out[i] = new_dist(g, self.plan.placed[i])
        self._reset()  # a second backward through the same graph (retain_graph) starts afresh
        return out
