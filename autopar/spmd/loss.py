"""Elementwise losses with a reduction: mse, smooth L1, Huber, binary cross-entropy (with logits),
soft margin.

Every tensor operand has the input's shape (or broadcasts to it: a weight stays whole along the
dims it lacks), so they shard alike on any dim:
  reduction 'none' -> the output keeps the shard;
  'sum'            -> each rank holds a Partial(sum) term;
  'mean'           -> a Partial(avg) term, computed as local sum * k / global count (k: the
                      ranks holding pieces), so uneven pieces average right.
Backward: 'none' keeps the shard; 'sum' and 'mean' take the Replicate scalar grad, and 'mean'
scales by the global count (the local op would divide by the local one).
The losses are not linear in their inputs: Partial inputs are reduced first.
Per-sample losses of (N, C) scores (multi-margin, multilabel margin) split N only, and their mean
divides by N.
"""
from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate, Shard
from .reduction import shard_group
from .registry import register, register_kernel
from .strategy import OpCall, OpStrategy

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2
# op -> position of its `reduction` argument
FORWARD = {aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2,
           aten.binary_cross_entropy.default: 3, aten.binary_cross_entropy_with_logits.default: 4,
           aten.soft_margin_loss.default: 2}
BACKWARD = {aten.mse_loss_backward.default: 3, aten.smooth_l1_loss_backward.default: 3,
            aten.huber_loss_backward.default: 3, aten.binary_cross_entropy_backward.default: 4,
            aten.soft_margin_loss_backward.default: 3}


def _aligned(call: OpCall, first: int, d: int) -> tuple:
    """Operands from `first` on, split along the loss input's dim d: a weight broadcast there
    (pos_weight of one class per column...) stays whole."""
    shape = call.inputs[first].shape
    out = []
    for m in call.inputs[first:]:
        dd = d - (len(shape) - len(m.shape))
        out.append(Shard(dd) if dd >= 0 and m.shape[dd] == shape[d] else Replicate())
    return tuple(out)


@register(list(FORWARD))
def loss_rule(call: OpCall) -> list[OpStrategy]:
    reduction = call.arg(FORWARD[call.func], "reduction", MEAN)
    reduced = {SUM: Partial("sum"), MEAN: Partial("avg")}.get(reduction)
    return [
        OpStrategy((Shard(d) if reduced is None else reduced,), _aligned(call, 0, d),
                   kernel="loss_mean" if reduction == MEAN else None)
        for d, size in enumerate(call.inputs[0].shape)
        if size != 1
    ]


@register(list(BACKWARD))
def loss_backward_rule(call: OpCall) -> list[OpStrategy]:
    reduction = call.arg(BACKWARD[call.func], "reduction", MEAN)
    return [
        OpStrategy((Shard(d),), ((Shard(d) if reduction == NONE else Replicate()),) + _aligned(call, 1, d),
                   kernel="loss_mean_backward" if reduction == MEAN else None)
        for d, size in enumerate(call.inputs[1].shape)
        if size != 1
    ]


# losses of one sample's scores (N, C): the mean divides by N, only the batch dim splits (their
# backwards have no meta kernel: the dispatcher runs them whole)
PER_SAMPLE = {aten.multi_margin_loss.default: 5, aten.multilabel_margin_loss_forward.default: 2}
FORWARD.update(PER_SAMPLE)


def _per_sample(call: OpCall) -> tuple:
    """Scores and target split on the batch, a class weight whole."""
    n, weight = call.inputs[0].shape[0], call.arg(4, "weight")
    return tuple(Shard(0) if m.shape and m.shape[0] == n and m is not weight else Replicate() for m in call.inputs)


@register(list(PER_SAMPLE))
def per_sample_loss_rule(call: OpCall) -> list[OpStrategy]:
    """(N, C) scores split on N: 'none' keeps the split, 'sum' leaves Partial(sum), 'mean'
    Partial(avg) by the kernel (is_target, multilabel's second output, keeps the split)."""
    if len(call.inputs[0].shape) != 2 or call.inputs[0].shape[0] == 1:
        return []
    reduction = call.arg(PER_SAMPLE[call.func], "reduction", MEAN)
    loss = {SUM: Partial("sum"), MEAN: Partial("avg")}.get(reduction, Shard(0))
    return [OpStrategy((loss,) + (Shard(0),) * (len(call.outputs) - 1), _per_sample(call),
                       kernel="loss_mean" if reduction == MEAN else None)]


def _count(func, spec) -> int:
    """How many terms the mean divides by: the elements, or the samples of a per-sample loss."""
    return spec.shape[0] if func in PER_SAMPLE else math.prod(spec.shape)


def _as_sum(func, args, kwargs, position: int):
    """Run the local op with reduction='sum'."""
    if position < len(args):
        args = list(args)
        args[position] = SUM
    else:
        kwargs = {**kwargs, "reduction": SUM}
    return func(*args, **kwargs)


@register_kernel("loss_mean")
def loss_mean_kernel(func, args, kwargs, in_specs, out_specs, coord):
    spec = in_specs[0]
    k = len(shard_group(spec, set(range(spec.ndim)), coord))
    out = _as_sum(func, args, kwargs, FORWARD[func])
    if isinstance(out, tuple):  # multilabel_margin_loss: (loss, is_target)
        return (out[0].mul_(k / _count(func, spec)),) + out[1:]
    return out.mul_(k / _count(func, spec))


@register_kernel("loss_mean_backward")
def loss_mean_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    return _as_sum(func, args, kwargs, BACKWARD[func]).div_(math.prod(in_specs[1].shape))
