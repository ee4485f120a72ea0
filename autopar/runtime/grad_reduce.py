"""Gradients to where the optimizer steps them: bucketed collectives, overlapped with backward.

A data-parallel gradient arrives Partial (each rank holds its batch's share) and must be
summed over the data-parallel ranks before the optimizer step: all-reduced to its
parameter's placements (no ZeRO), or reduce-scattered to the shard this rank steps (ZeRO-1/2:
the parameter's placements with the data-parallel mesh dim sharding one tensor dim).  Two
places do it:

- `reduce_grads` (the optimizer's pre-step, `shard_optimizer`): gradients that need one
  collective of the same kind share DDP-sized flat buckets per (mesh, collective, dtype),
  filled last parameter first, instead of one collective per parameter (`flat_shards.py`
  lays the buffer of a reduce-scatter out: piece j of every gradient in chunk j);
- `BucketPlan` (local regions, for parameters registered with `reduce_in_backward`): the
  region's parameters are cut into DDP-sized buckets in reverse order (about the order
  backward produces their gradients).  Each backward through the region starts a bucket's
  collective as soon as its last gradient is ready, while backward goes on with the
  earlier layers; the region's last backward step waits for them and hands the
  parameters gradients that are already placed where the optimizer steps them, so it has
  nothing left to reduce.  A region whose gradients fit one bucket has nothing to overlap:
  it leaves them Partial for the pre-step, which packs them with the other regions' (one
  collective where each region would send its own), so a dynamic step sends the buckets
  its captured program (`to_static`, which reduces at the pre-step) sends.
  Every rank runs the same backward, so the buckets start in the same order everywhere.
  A mixed-precision policy's `reduce_dtype` (float32 gradients of bfloat16 parameters) is
  the bucket's dtype: the ready gradients are cast into it and the reduced ones cast back
  where they land, so the policy keeps the overlap.
  Gradient accumulation (a backward while the parameters still hold gradients) switches a
  region's buckets to deferred reduction for good: the gradients it already reduced become
  Partial again without communication, later backwards leave them Partial (summed locally),
  and the optimizer reduces the sum once per step, where reducing every backward (DDP
  without `no_sync`) would cost one collective per micro-batch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..comm import all_reduce_start, get_rank, reduce_scatter_start
from ..comm.observers import capture_running
from ..tensor.grad_landing import LANDING, IN_PARTS, Landing, Reduce, follows, settle_all
from ..tensor import riders
from ..tensor.dispatch import keep_reduced
from ..tensor.dtensor import DistTensor, new_dist
from .precision import cast_dist, spec_in
from .zero.flat_shards import FlatShards
from ..placement import Partial, ReduceType, Replicate, Shard
from ..redistribute import redistribute_local
from ..spec import DistSpec
from ..tensor.convert import reshard_to

FIRST_BUCKET_BYTES = 1 << 20  # DDP's: the last layers' gradients start moving early
BUCKET_BYTES = 25 << 20

ALL_REDUCE, REDUCE_SCATTER = "all_reduce", "reduce_scatter"

_GRAD_PLANS: dict = {}


def collective(src: DistSpec, dst: DistSpec) -> Optional[tuple]:
    """The one collective that takes src's local pieces to dst's, as (kind, mesh dims, reduce
    op), or None when src -> dst needs something else: an all-reduce where dst is Replicate on
    the Partial mesh dims (one reduce op), a reduce-scatter where dst shards, on the one mesh
    dim src is Partial on (sum or avg), a tensor dim no other mesh dim cuts.  Mesh dims of size
    1 hold the whole tensor whatever their placement, so they never differ.

    >>> from autopar.mesh import ProcessMesh
    >>> from autopar.spec import TensorMeta
    >>> spec = DistSpec(ProcessMesh([[0, 1], [2, 3]]), [Partial(), Shard(0)], TensorMeta.contiguous((4, 6), torch.float32))
    >>> collective(spec, spec.with_placements([Replicate(), Shard(0)]))
    ('all_reduce', (0,), 'sum')
    >>> collective(spec, spec.with_placements([Shard(1), Shard(0)]))
    ('reduce_scatter', (0,), 'sum')
    """
    if src.mesh != dst.mesh:
        return None
    dims, op, scatter = [], None, False
    for m, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if a == b or src.mesh.shape[m] == 1:
            continue
        if type(a) is not Partial or op not in (None, a.reduce_type):
            return None
        if type(b) is Shard:
            if a.reduce_type not in (ReduceType.SUM, ReduceType.AVG) or dst.sharding_mesh_dims(b.dim) != [m]:
                return None
            scatter = True
        elif type(b) is not Replicate:
            return None
        dims.append(m)
        op = a.reduce_type
    if scatter and len(dims) != 1:
        return None
    return (REDUCE_SCATTER if scatter else ALL_REDUCE), tuple(dims), op


def grad_plan(grad: DistSpec, target: DistSpec) -> tuple:
    """(whether the gradient must move, the collective that moves it or None for a general
    reshard, its spec once placed like `target`); specs are interned, so the plan of a
    (gradient, target) spec pair is worked out once."""
    plan = _GRAD_PLANS.get((grad, target))
    if plan is None:
        placed = DistSpec(target.mesh, target.placements, grad.meta)
        plan = (not grad.same_pieces(placed), collective(grad, placed), placed)
        _GRAD_PLANS[(grad, target)] = plan
    return plan


def reduce_grads(pending: list, reduce_dtype: Optional[torch.dtype] = None, first_cap: Optional[int] = None) -> None:
    """Bring each parameter's gradient to where it is stepped, given (parameter, its
    `grad_plan`) pairs: one collective per bucket of gradients that need only that, a
    reshard for the rest; in `reduce_dtype` (a mixed-precision policy's), cast back after;
    `first_cap`: GradReduction's."""
    settle_all()  # (buckets a backward that raised started)
    # last parameter first, as a region's backward buckets them: the same flat layout sums
    # each element in the same order (a ring all-reduce's order depends on the position)
    pending = pending[::-1]
    grads = [cast_dist(p.grad, reduce_dtype) for p, _ in pending]
    plans = [plan if g is p.grad else grad_plan(g._spec, plan[2]) for g, (p, plan) in zip(grads, pending)]
    reduction = GradReduction(grads, plans, first_cap)
    _learn_landings([p for p, _ in pending], grads, reduction)
    for (p, _), (local, spec) in zip(pending, reduction.finish_pieces()):
        if local.dtype != p.grad.dtype:  # (reduced in the policy's dtype)
            local, spec = local.to(p.grad.dtype), spec_in(spec, p.grad.dtype)
        # in place: a caller holding the gradients (clip_grad_norm_'s list) sees them reduced
        keep_reduced(p.grad, local, spec)


class GradReduction:
    """Gradients on their way to `grad_plan`'s placements: one collective per bucket of those
    that need only that one (started at once, in order: every rank builds the same buckets),
    a reshard for the rest; `finish()` waits and returns them placed.  A gradient is not kept
    once its bucket has been packed.  An all-reduce bucket whose gradients already tile one
    flat buffer in its order (they landed there in backward, see `Landing`) is reduced in that
    buffer: nothing is packed or unpacked, and the gradients keep their pieces."""

    def __init__(self, grads: list, plans: list, first_cap: Optional[int] = None):
        # `first_cap`: the first bucket's (None: DDP's 1 MiB; gradients all ready at once have
        # nothing to start early)
        self.out: list = list(grads)
        self.all_reduced: list = []  # each all-reduce bucket's (position, placed) pairs, ranks, reduce op
        filling: dict = {}  # (mesh, collective, dtype) -> the bucket being filled
        buckets: list = []
        for n, (g, (moves, how, placed)) in enumerate(zip(grads, plans)):
            if not moves:
                continue
            if how is None:
                self.out[n] = reshard_to(g.detach(), placed)
            else:
                local = g._local
                b = _bucket_for(filling, buckets, (placed.mesh, how, g.dtype), local.numel() * local.element_size(),
                                lambda: _Bucket(how, placed.mesh), first_cap)
                b.members.append((n, local, placed))
        rank = get_rank()
        self.started = []
        for b in buckets:
            locals_ = [local for _, local, _ in b.members]
            if b.how[1] and rank in b.mesh and sum(t.numel() for t in locals_):
                entries = [(n, placed) for n, _, placed in b.members]
                flat = _tiled(locals_) if b.how[0] == ALL_REDUCE and not capture_running() else None
                if flat is not None:
                    self.started.append((entries, locals_, all_reduce_start(flat, b.mesh.group_of(rank, b.how[1]), b.how[2])))
                else:
                    collective = _Collective(b.how, b.mesh, [placed for _, _, placed in b.members],
                                             tuple(tuple(t.shape) for t in locals_))
                    self.started.append((entries, collective, collective.start(locals_)))
                if b.how[0] == ALL_REDUCE:
                    self.all_reduced.append((entries, b.mesh.group_of(rank, b.how[1]), b.how[2]))
                for n, _, _ in b.members:
                    self.out[n] = None
            else:
                for n, local, placed in b.members:
                    self.out[n] = new_dist(local, placed)

    def finish_pieces(self) -> list:
        """Each gradient's (local piece, spec), placed: waits for the collectives."""
        out = [None if g is None else (g._local, g._spec) for g in self.out]
        for entries, how, pending in self.started:
            reduced = pending.wait()
            pieces = how if type(how) is list else how.result(reduced)  # (in place: the pieces themselves)
            for (n, placed), local in zip(entries, pieces):
                out[n] = (local, placed)
        self.started = []
        return out

    def finish(self) -> list:
        return [new_dist(local, spec) for local, spec in self.finish_pieces()]


def _tiled(locals_: list) -> Optional[torch.Tensor]:
    """The flat buffer that `locals_` tile whole, contiguous, in this order (they landed there,
    see `tensor/grad_landing.py`, which keeps `riders.SPARE` elements after them), as one
    tensor; None when they do not."""
    first, last = locals_[0], locals_[-1]
    if first.storage_offset() != 0 or not first.is_contiguous() or not all(map(follows, locals_, locals_[1:])):
        return None
    end = last.storage_offset() + last.numel()
    if first.untyped_storage().nbytes() // first.element_size() not in (end, end + riders.SPARE):
        return None
    return first.as_strided((end,), (1,), 0)


def _learn_landings(params: list, grads: list, reduction: GradReduction) -> None:
    """Leave on each member of an all-reduce bucket of gradients reduced in their own dtype
    the bucket's layout, for the next ones to be written into (kept while the bucket's
    members and their gradients' shapes stay the same), and start its next round.  A new
    layout also learns the bucket's all-reduce, to start in backward once its gradients have
    landed, unless a member has post-accumulate hooks (which may write its gradient while
    the bucket is reduced) or gets its gradient in parts (`IN_PARTS`)."""
    for entries, ranks, op in reduction.all_reduced:
        members = [n for n, _ in entries]
        if any(grads[n] is not params[n].grad for n in members):
            continue  # (cast to a policy's reduce dtype: the cast is the packing)
        key = tuple((id(params[n]), grads[n]._local.shape) for n in members)
        specs = [grads[n]._spec for n in members]
        entry = params[members[0]].__dict__.get(LANDING)
        if entry is None or entry[0].key != key:
            landing = Landing(key, [grads[n]._local for n in members])
            for i, n in enumerate(members):
                params[n].__dict__[LANDING] = (landing, i)
            early = all(params[n]._post_accumulate_grad_hooks is None and IN_PARTS not in params[n].__dict__
                        for n in members)
        else:
            landing = entry[0]
            landing.new_round()
            if landing.reduce.specs == specs:
                continue
            # placed otherwise than when learned: the first step's gradients ran op by op (a
            # local region verifying), and on a mesh dim of one rank any placement is the same
            # values; learned again, or the bucket would never start in backward
            early = landing.reduce.early
        landing.reduce = Reduce([params[n] for n in members], specs, [placed for _, placed in entries], ranks, op,
                                early)


def _bucket_for(filling: dict, buckets: list, key, nbytes: int, new, first_cap: Optional[int] = None) -> "_Bucket":
    """The bucket of `key` that a gradient of `nbytes` joins, as DDP fills them: the one being
    filled unless the gradient would take it past the cap (`first_cap`, DDP's 1 MiB, for the
    first bucket, so that the last layers' gradients start moving early; 25 MiB after), else
    a `new()` one.  The backward buckets and the pre-step's share this rule."""
    b = filling.get(key)
    if b is None or b.nbytes + nbytes > ((first_cap or FIRST_BUCKET_BYTES) if b is buckets[0] else BUCKET_BYTES):
        b = filling[key] = new()
        buckets.append(b)
    b.nbytes += nbytes
    return b


class _Collective:
    """One bucket's collective over the gradients' local pieces (of `shapes`): an all-reduce
    of their concatenation, or a reduce-scatter of their chunk layout."""

    def __init__(self, how: tuple, mesh, placed: list, shapes: tuple):
        kind, dims, self.op = how
        rank = get_rank()
        self.ranks = mesh.group_of(rank, dims)
        self.shapes = shapes
        self.layout = None
        if kind == REDUCE_SCATTER:
            cut = [s.placements[dims[0]].dim for s in placed]
            self.layout = FlatShards.of(shapes, tuple(cut), len(self.ranks))
            self.me = self.ranks.index(rank)

    def start(self, locals_: list):
        if self.layout is None:
            return all_reduce_start(torch.cat([t.reshape(-1) for t in locals_]), self.ranks, self.op)
        return reduce_scatter_start(self.layout.pack(locals_), self.ranks, self.op)

    def result(self, out: torch.Tensor) -> list:
        """Each gradient's reduced piece, views into the collective's output."""
        if self.layout is not None:
            return self.layout.pieces_of(out, self.me)
        sizes = [math.prod(shape) for shape in self.shapes]
        return [piece.view(shape) for piece, shape in zip(out.split(sizes), self.shapes)]


# -- reduction in backward -------------------------------------------------------------------
# parameter -> (the spec its gradient is reduced to, the dtype it is
# reduced in or None for its own); keyed weakly, by identity: an entry goes with its
# parameter (a Parameter's __eq__ is elementwise)
_IN_BACKWARD: WeakIdKeyDictionary = WeakIdKeyDictionary()
_GENERATION = [0]  # bumped by every registration: regions rebuild their bucket plans


def generation() -> int:
    """Changes whenever parameters are registered for reduction in backward."""
    return _GENERATION[0]


def reduce_in_backward(targets: list, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """Let local regions reduce these (parameter, spec) pairs' gradients to the spec during
    backward: the parameters `shard_optimizer` steps, with the placements their gradients are
    stepped at (the parameter's own without ZeRO, this rank's shard with ZeRO-1/2), so
    reducing them early changes nothing but the timing.  `reduce_dtype`: the dtype the
    collectives run in (a mixed-precision policy's)."""
    for p, spec in targets:
        if type(p) is DistTensor:
            _IN_BACKWARD[p] = (spec, reduce_dtype)
    _GENERATION[0] += 1


def registered(p: torch.Tensor) -> Optional[tuple]:
    """(the spec p's gradient is reduced to in backward, the reduce dtype or None), or None
    when p was not given to `reduce_in_backward`."""
    return _IN_BACKWARD.get(p)


class _Bucket:
    __slots__ = ("members", "how", "mesh", "nbytes", "whole", "dtype")

    def __init__(self, how: tuple, mesh, dtype: Optional[torch.dtype] = None):
        self.members, self.how, self.mesh, self.nbytes = [], how, mesh, 0
        self.dtype = dtype  # what the gradients are reduced in (a backward bucket's)
        self.whole: Optional[_Collective] = None

    def collective(self, members: list, placed: dict, grads: list) -> _Collective:
        """The collective over these members' gradients (kept for the usual case: all of them)."""
        shapes = tuple(tuple(g.shape) for g in grads)
        if len(members) < len(self.members):  # some parameters got no gradient this time
            return _Collective(self.how, self.mesh, [placed[i] for i in members], shapes)
        if self.whole is None:
            self.whole = _Collective(self.how, self.mesh, [placed[i] for i in members], shapes)
        return self.whole


class BucketPlan:
    """How a region's parameter gradients (positions in its list of parameters) are bucketed."""

    def __init__(self, buckets: list, placed: dict):
        self.buckets, self.placed = buckets, placed
        # with one bucket there is nothing to overlap: no readiness hooks, the region's last
        # backward step reduces it (where DDP does too), placing the gradients once
        self.overlap = len(buckets) > 1
        self.bucket_of = {i: b for b in buckets for i in b.members}
        self.deferred = False  # (accumulation: the pre-step reduces the sum)

    @staticmethod
    def build(params: list, grad_specs: list) -> Optional["BucketPlan"]:
        """None when no parameter's gradient is reduced in backward."""
        rank = get_rank()
        reducible = []  # (position, spec reduced to, collective, dtype), last parameter first
        for i in reversed(range(len(params))):
            p, gs = params[i], grad_specs[i]
            entry = registered(p)
            if entry is None or not p.requires_grad or rank not in p._spec.mesh:
                continue
            target, reduce_dtype = entry
            _, how, spec = grad_plan(gs, target)
            if how is not None and how[1]:
                reducible.append((i, spec, how, reduce_dtype or gs.meta.dtype))
        nbytes = {i: params[i]._local.numel() * dtype.itemsize for i, _, _, dtype in reducible}
        # a region whose gradients fit one DDP bucket is one bucket: no small first bucket per
        # region (a model of many small regions would send two collectives per region)
        first_cap = FIRST_BUCKET_BYTES if sum(nbytes.values()) > BUCKET_BYTES else BUCKET_BYTES
        filling: dict = {}  # (mesh, collective, dtype) -> the bucket being filled
        buckets, placed = [], {}
        for i, spec, how, dtype in reducible:
            b = _bucket_for(filling, buckets, (spec.mesh, how, dtype), nbytes[i],
                            lambda: _Bucket(how, spec.mesh, dtype), first_cap)
            b.members.append(i)
            placed[i] = spec
        if len(buckets) <= 1:
            # one bucket has nothing to overlap: its collective would start and be waited for
            # at the region's last backward step.  Its gradients stay Partial instead, and the
            # optimizer's pre-step reduces them with every other region's in shared buckets:
            # fewer collectives, and the buckets a captured step (which reduces there) has
            return None
        return BucketPlan(buckets, placed)

    def reduction(self, params: list, grad_specs: list) -> Optional["BackwardReduction"]:
        """The state for one forward's backward, or None once the buckets are deferred.  A
        parameter still holding a gradient means accumulation: defer the buckets from now on,
        and give the gradients reduced so far back their Partial placement (a local step: one
        rank keeps the value), so that the next gradients add to them without communication."""
        if not self.deferred and any(params[i].grad is not None for i in self.bucket_of):
            for i, spec in self.placed.items():
                g = params[i].grad
                if type(g) is DistTensor and g._spec is spec:
                    params[i].grad = new_dist(redistribute_local(g._local, spec, grad_specs[i]), grad_specs[i])
            self.deferred = True
        return None if self.deferred else BackwardReduction(self)


class BackwardReduction:
    """One forward's bucket state: gradients as hooks see them, collectives in flight."""

    def __init__(self, plan: BucketPlan):
        self.plan = plan
        self._reset()

    def _reset(self) -> None:
        self.grads: dict = {}
        self.ready = {id(b): 0 for b in self.plan.buckets}
        self.pending: dict = {}  # id(bucket) -> (its members that had gradients, its _Collective, comm.Pending)

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
        mine = [i for i in b.members if i in self.grads]
        if mine:
            grads = [self.grads.pop(i).to(b.dtype) for i in mine]  # (packed: not kept)
            collective = b.collective(mine, self.plan.placed, grads)
            self.pending[id(b)] = (mine, collective, collective.start(grads))

    def finish(self, grads: list) -> dict:
        """{parameter position: reduced gradient, placed where it is stepped}, once every
        bucket is reduced (a bucket some of whose parameters got no gradient starts now)."""
        for b in self.plan.buckets:
            if id(b) not in self.pending:
                for i in b.members:
                    if i not in self.grads and grads[i] is not None:
                        self.grads[i] = grads[i]
                self._start(b)
        out = {}
        for b in self.plan.buckets:
            entry = self.pending.get(id(b))
            if entry is None:
                continue
            mine, collective, pending = entry
            for i, g in zip(mine, collective.result(pending.wait())):
                placed = self.plan.placed[i]
                out[i] = new_dist(g.to(placed.meta.dtype), placed)  # (cast back from the reduce dtype)
        self._reset()  # a second backward through the same graph (retain_graph) starts afresh
        return out
