"""Softmax, log_softmax, their backwards, and nll_loss (cross_entropy = log_softmax + nll_loss).

Softmax is pointwise along every dim but its own, so those dims shard freely.  When the
softmax dim itself is sharded (class-sharded logits, a vocab-parallel LM head) a kernel
all-reduces the row max (MAX) and the row sum of exps (SUM), two (rows x 1) tensors, and
the output stays sharded on the class dim.

nll_loss picks -w[t] * logp[t] per sample:
  batch-like dims shard with the target (reduction none: output sharded like the target;
  sum: output and total weight Partial);
  the class dim shards with a kernel that picks only targets in this rank's class range
  (sum: output Partial(sum); the total weight needs no communication, target and weight
  are whole along that mesh dim);
  mean: the global mean needs the global total weight (uneven shards, ignore_index), so
  the kernel all-reduces (local loss sum, local total weight) together, one collective
  over the mesh dims sharding batch-like dims, where the loss comes out Replicate (reduced
  already: reading its value costs nothing more); along mesh dims splitting the classes
  it stays Partial(sum), as for sum.  Without class weights a `MeanTaker` above the rules
  (the distributed tensor's deferred means) may take the pair instead and reduce it later;
  a Partial input passes through (the loss is linear in logp).
"""
from __future__ import annotations

import math
from typing import Optional, Protocol

import torch

from .. import comm
from ..placement import Partial, ReduceType, Replicate, Shard
from .reduction import shard_group
from .registry import STRIDED_KERNELS, register, register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulate half precision in fp32, as aten's softmax kernels do."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


# -- softmax / log_softmax ---------------------------------------------------------------------
def _softmax_strategies(call: OpCall, ndim: int, dim: int, n_in: int, kernel: str) -> list[OpStrategy]:
    """A dtype aten's kernels refuse (integers, bool, complex) is refused on an empty piece
    too, but not by the meta kernel: such a tensor runs whole on every rank, so every rank
    raises torch's error (a piece with no rows would return instead)."""
    if not call.inputs[-1].dtype.is_floating_point:
        return []
    strategies = [OpStrategy((Shard(d),), (Shard(d),) * n_in) for d in range(ndim) if d != dim]
    if ndim:
        strategies.append(OpStrategy((Shard(dim),), (Shard(dim),) * n_in, kernel=kernel))
    return strategies


@register([aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default])
def softmax_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    return _softmax_strategies(call, nd, _norm_dim(call.arg(1, "dim"), nd), 1, "softmax_split_dim")


@register([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default])
def softmax_backward_rule(call: OpCall) -> list[OpStrategy]:
    """Also linear in grad_output: a Partial gradient with the output whole stays Partial."""
    nd = len(call.inputs[1].shape)
    strategies = _softmax_strategies(call, nd, _norm_dim(call.arg(2, "dim"), nd), 2, "softmax_backward_split_dim")
    return strategies + [OpStrategy((p,), (p, Replicate())) for p in LINEAR_PARTIALS]


@register_kernel("softmax_split_dim")
def softmax_split_dim(func, args, kwargs, in_specs, out_specs, coord):
    x, spec = args[0], in_specs[0]
    dim = _norm_dim(args[1], x.dim())
    group = shard_group(spec, {dim}, coord)
    xf = _acc(x)
    if x.shape[dim]:
        local_max = xf.amax(dim, keepdim=True)
    else:  # more ranks than classes: this piece is empty
        local_max = xf.new_full(xf.shape[:dim] + (1,) + xf.shape[dim + 1:], float("-inf"))
    row_max = comm.all_reduce(local_max, group, ReduceType.MAX)
    shifted = xf - row_max
    exps = shifted.exp()
    row_sum = comm.all_reduce(exps.sum(dim, keepdim=True), group, ReduceType.SUM)
    name = func._schema.name
    if name == "aten::_log_softmax":
        out = shifted - row_sum.log()
    else:
        out = exps / row_sum
        if name == "aten::_safe_softmax":  # rows masked out entirely give 0, not nan
            out = out.masked_fill(row_max == float("-inf"), 0.0)
    return out.to(out_specs[0].meta.dtype)


@register_kernel("softmax_backward_split_dim")
def softmax_backward_split_dim(func, args, kwargs, in_specs, out_specs, coord):
    grad, out, spec = _acc(args[0]), _acc(args[1]), in_specs[1]
    dim = _norm_dim(args[2], out.dim())
    group = shard_group(spec, {dim}, coord)
    if func._schema.name == "aten::_log_softmax_backward_data":
        result = grad - out.exp() * comm.all_reduce(grad.sum(dim, keepdim=True), group, ReduceType.SUM)
    else:
        result = out * (grad - comm.all_reduce((grad * out).sum(dim, keepdim=True), group, ReduceType.SUM))
    return result.to(out_specs[0].meta.dtype)


# -- nll_loss ------------------------------------------------------------------------------------
class MeanTaker(Protocol):
    """Holds a mean loss's (sum, count) of this rank to reduce later than the forward."""

    def take(self, loss_sum: torch.Tensor, count: torch.Tensor, targets: int, ranks: tuple) -> Optional[tuple]:
        """This rank's sum of the losses and count of the targets not ignored, of `targets` over
        `ranks`: the (loss, total weight) locals to hand out in their place, or None to have
        them reduced now."""

    def before_backward(self, total: torch.Tensor) -> None:
        """nll_loss's backward is about to divide by `total`: one handed out by `take` is
        reduced now unless its backward was allowed to run on the guess."""


_MEAN_TAKER: list = []  # the one MeanTaker, once a layer above has offered itself


def defer_means_to(taker: MeanTaker) -> None:
    """Offer every unweighted mean nll_loss split over ranks to `taker` (see `MeanTaker`)."""
    _MEAN_TAKER[:] = [taker]


def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _batch_dims(ndim: int):
    """(input dim, target dim) pairs of the dims other than the class dim."""
    c = _class_dim(ndim)
    return [(d, d if d < c else d - 1) for d in range(ndim) if d != c]


@register([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default])
def nll_loss_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    reduction = call.arg(3, "reduction")
    w = (Replicate(),) * (len(call.inputs) - 2)  # the class weights, if given, stay whole
    strategies = []
    for d, td in _batch_dims(nd):
        if reduction == _NONE:
            outs, kernel = (Shard(td), Replicate()), None
        elif reduction == _SUM:
            outs, kernel = (Partial(), Partial()), None
        else:
            outs, kernel = (Replicate(), Replicate()), "nll_loss"
        strategies.append(OpStrategy(outs, (Shard(d), Shard(td)) + w, kernel=kernel))
    if nd:
        strategies.append(OpStrategy((Partial(), Replicate()), (Shard(_class_dim(nd)), Replicate()) + w,
                                     kernel="nll_loss"))
    return strategies + [OpStrategy((p, Replicate()), (p, Replicate()) + w) for p in LINEAR_PARTIALS]


@register([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default])
def nll_loss_backward_rule(call: OpCall) -> list[OpStrategy]:
    """Inputs: grad_output, self (read for its shape only), target, [weight], total_weight.

    `self` is given the gradient's placement although only its shape is read: the gradient
    of the log-probabilities then comes out placed like them wherever that costs nothing
    (replicated labels would otherwise pick the class split, which is free here and costs an
    all-to-all in the log_softmax backward right after)."""
    nd = len(call.inputs[1].shape)
    reduction = call.arg(4, "reduction")
    w = (Replicate(),) * (len(call.inputs) - 4)
    total = (Replicate() if reduction == _MEAN else None,)
    k = "nll_loss_backward"
    strategies = [
        OpStrategy((Shard(d),), (Shard(td) if reduction == _NONE else Replicate(), Shard(d), Shard(td)) + w + total, k)
        for d, td in _batch_dims(nd)
    ]
    if nd:
        c = _class_dim(nd)
        strategies.append(OpStrategy((Shard(c),), (Replicate(), Shard(c), Replicate()) + w + total, k))
    return strategies + [OpStrategy((p,), (p, None, Replicate()) + w + total, k) for p in LINEAR_PARTIALS]


def _pick(target, weight, ignore_index, spec, coord, dtype):
    """Per sample: local class index, weight (0 where ignored), and whether the target's class
    lies in this rank's class range."""
    c = _class_dim(spec.ndim)
    lo, hi = spec.block_box(coord)[c]  # (the rows may be split strided: see _rows_only)
    valid = target != ignore_index
    t = torch.where(valid, target, 0)
    in_bounds = ((t >= 0) & (t < spec.shape[c])).all()  # asserted without a host sync on accelerators
    torch._assert_async(in_bounds, f"nll_loss: a target is out of bounds for {spec.shape[c]} classes")
    wt = weight[t] if weight is not None else torch.ones(t.shape, dtype=dtype, device=t.device)
    wt = torch.where(valid, wt, 0)
    mine = valid & (t >= lo) & (t < hi)
    return (t - lo).clamp(0, max(hi - lo - 1, 0)), wt, mine, c, hi > lo


def _classes_split(spec) -> bool:
    c = _class_dim(spec.ndim)
    return any(type(p) is Shard and p.dim == c for p, k in zip(spec.placements, spec.mesh.shape) if k > 1)


def _rows_only(first: int):
    """Whether a strategy leaves the class dim of input `first` whole: the kernels then sum
    over the rows they hold, wherever those lie (a strided split of the rows works too)."""
    return lambda call, s: s.inputs[first] != Shard(_class_dim(len(call.inputs[first].shape)))


STRIDED_KERNELS.update({"nll_loss": _rows_only(0), "nll_loss_backward": _rows_only(1)})


@register_kernel("nll_loss")
def nll_loss_kernel(func, args, kwargs, in_specs, out_specs, coord):
    x, target, weight, reduction, ignore_index = args
    spec = in_specs[0]
    c = _class_dim(spec.ndim)
    if not _classes_split(spec):  # every class here: the fused local op gives (sum, total weight)
        if reduction != _MEAN:
            return func(*args)
        loss_sum, total = func(x, target, weight, _SUM, ignore_index)
    else:
        local_t, wt, mine, c, has_classes = _pick(target, weight, ignore_index, spec, coord, x.dtype)
        picked = x.gather(c, local_t.unsqueeze(c)).squeeze(c) if has_classes else torch.zeros_like(wt)
        loss = torch.where(mine, -wt * picked, 0)
        if reduction == _NONE:
            return loss, x.new_zeros(())
        loss_sum, total = loss.sum(), wt.sum()
        if reduction == _SUM:
            return loss_sum, total
    # one all-reduce of (sum, total weight) over the mesh dims sharding batch-like dims
    ranks = shard_group(spec, set(range(spec.ndim)) - {c}, coord)
    if weight is None and _MEAN_TAKER and len(ranks) > 1:
        taken = _MEAN_TAKER[0].take(loss_sum, total, math.prod(in_specs[1].shape), ranks)
        if taken is not None:
            return taken
    both = comm.all_reduce(torch.stack([loss_sum, total]), ranks, ReduceType.SUM)
    return both[0] / both[1], both[1]


@register_kernel("nll_loss_backward")
def nll_loss_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    grad_out, _, target, weight, reduction, ignore_index, total = args
    if _MEAN_TAKER and reduction == _MEAN:
        _MEAN_TAKER[0].before_backward(total)
    spec = out_specs[0]
    if not _classes_split(spec):  # the fused local op, with the global total weight (read for self: its shape)
        shape = grad_out.new_empty(spec.local_shape(coord), dtype=spec.meta.dtype)
        return func(grad_out, shape, target, weight, reduction, ignore_index, total)
    local_t, wt, mine, c, has_classes = _pick(target, weight, ignore_index, spec, coord, spec.meta.dtype)
    coef = -wt * grad_out
    if reduction == _MEAN:
        coef = coef / total
    grad = torch.zeros(spec.local_shape(coord), dtype=spec.meta.dtype, device=grad_out.device)
    if has_classes:
        grad.scatter_(c, local_t.unsqueeze(c), torch.where(mine, coef, 0).unsqueeze(c).to(grad.dtype))
    return grad
