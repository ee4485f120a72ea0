"""BatchNorm over a split batch: the global batch's statistics, as one process computes them.

A batch norm in training normalizes each channel by the mean and variance over every other dim
(batch and space).  With those dims split, each rank's own statistics would be another model's
(what plain data parallel does); so the `batch_norm_stats` kernel computes them for the global
batch, as SyncBatchNorm does, with ONE all-reduce per layer of 2 x channels values:
  forward   per rank the count, mean and squared deviations of its piece (a stable local pass),
            sent as sums shifted by the running mean (equal on every rank: the cancellation in
            E[(x-K)^2] - E[x-K]^2 stays small once K tracks the mean); the ranks holding the
            other pieces all-reduce them, normalize their own piece, and update the running
            statistics (unbiased variance over the global count) identically;
  backward  one all-reduce of (sum dy, sum dy*xhat), each piece's summed in one fused pass (the
            native backward's weight and bias gradients); the weight and bias gradients come out
            whole (Replicate): they are those sums already.  The normalization and its gradient
            are per-channel affine maps of x and dy given the global statistics: fused passes.
Channels split instead (input Shard(1), per-channel tensors Shard(0)) every statistic is local:
the plain op.  In eval mode (running statistics) the op is per-channel affine: a split batch is
local too, and the weight and bias gradients are Partial(sum).  The backward is linear in
grad_output: a Partial one passes.

native_batch_norm / cudnn_batch_norm / miopen_batch_norm write the running statistics without
their schema saying so: the rules declare it (`writes`), so a running statistic placed elsewhere
is moved for good before the update instead of updating a copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .. import comm
from ..placement import Partial, Replicate, Shard
from .reduction import shard_group
from .registry import register, register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Forward:
    """Where a forward batch-norm op keeps its arguments and what it returns after (out, mean, invstd)."""

    params: tuple  # positions of weight, bias, running_mean, running_var (None: the op has none)
    training: Union[int, bool]  # position of the training flag, or the op's fixed mode
    momentum: int
    eps: int
    reserve: bool = False  # a reserve buffer follows the statistics
    functional: bool = False  # the updated running statistics are returned, not written


_STATS = (1, 2, 3, 4)
FORWARD = {
    aten.native_batch_norm.default: _Forward(_STATS, 5, 6, 7),
    aten._native_batch_norm_legit.default: _Forward(_STATS, 5, 6, 7),
    aten._native_batch_norm_legit.no_stats: _Forward((1, 2, None, None), 3, 4, 5),
    aten._native_batch_norm_legit_no_training.default: _Forward(_STATS, False, 5, 6),
    aten._native_batch_norm_legit_functional.default: _Forward(_STATS, 5, 6, 7, functional=True),
    aten._batch_norm_with_update.default: _Forward(_STATS, True, 5, 6, reserve=True),
    aten._batch_norm_with_update_functional.default: _Forward(_STATS, True, 5, 6, reserve=True, functional=True),
    aten._batch_norm_no_update.default: _Forward(_STATS, False, 5, 6, reserve=True),
    aten.cudnn_batch_norm.default: _Forward(_STATS, 5, 6, 7, reserve=True),
    aten.miopen_batch_norm.default: _Forward(_STATS, 5, 6, 7),
}


@dataclass(frozen=True)
class _Backward:
    """Where a backward batch-norm op keeps its arguments (weight at 2, running statistics at 3-4,
    saved mean and inverse std at 5-6 in every variant)."""

    grad_out: int
    input: int
    training: Union[int, bool]
    mask: Optional[int]  # position of output_mask (None: all three gradients)
    reserve: Optional[int] = None


BACKWARD = {
    aten.native_batch_norm_backward.default: _Backward(0, 1, 7, 9),
    aten.batch_norm_backward.default: _Backward(0, 1, 7, 9, reserve=10),
    aten.cudnn_batch_norm_backward.default: _Backward(1, 0, True, None, reserve=8),
    aten.miopen_batch_norm_backward.default: _Backward(1, 0, True, None),
}


def _flag(call: OpCall, where) -> bool:
    """A mode flag: fixed by the op, or its argument at position `where`."""
    return where if isinstance(where, bool) else bool(call.args[where])


def _strategy(call: OpCall, kinds: dict, out_kinds: tuple, places: dict, kernel=None) -> OpStrategy:
    """Placements by kind: `kinds` maps argument positions to a kind ('x' activation, 'dy' its
    gradient, 'c' per-channel tensor, 'r' reserve); `places` maps kinds to placements."""
    ins = tuple(places[kinds[i]] for i, a in enumerate(call.args) if i in kinds and a is not None)
    return OpStrategy(tuple(places[k] for k in out_kinds), ins, kernel=kernel)


def _dims(shape) -> list[int]:
    """The dims a batch norm reduces over (every dim but the channels), worth sharding."""
    return [d for d in range(len(shape)) if d != 1 and shape[d] != 1]


_R, _P = Replicate(), Partial()


# -- rules -------------------------------------------------------------------------------------
def batch_norm_rule(call: OpCall) -> list[OpStrategy]:
    """(x, per-channel tensors) -> (out, mean, invstd[, reserve][, running_mean, running_var])."""
    form = FORWARD[call.func]
    training = _flag(call, form.training)
    kinds = {0: "x", **{p: "c" for p in form.params if p is not None}}
    out_kinds = ("x", "c", "c") + (("r",) if form.reserve else ()) + (("c", "c") if form.functional else ())
    strategies = [
        _strategy(call, kinds, out_kinds, {"x": Shard(d), "c": _R, "r": _R},
                  kernel="batch_norm_stats" if training else None)
        for d in _dims(call.inputs[0].shape)
    ]
    if call.inputs[0].shape[1] != 1:
        strategies.append(_strategy(call, kinds, out_kinds, {"x": Shard(1), "c": Shard(0), "r": _R}))
    return strategies


def _running_stats_written(args, kwargs) -> tuple:
    """native/cudnn/miopen_batch_norm (training flag at 5) update the running statistics in training."""
    return ("running_mean", "running_var") if args[5] else ()


_WRITE_STATS = [aten.native_batch_norm.default, aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default]
register([op for op in FORWARD if op not in _WRITE_STATS])(batch_norm_rule)
register(_WRITE_STATS, writes=_running_stats_written)(batch_norm_rule)


@register(list(BACKWARD))
def batch_norm_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_out, x, per-channel tensors[, reserve]) -> the masked (grad_input, grad_weight, grad_bias)."""
    form = BACKWARD[call.func]
    training = _flag(call, form.training)
    kinds = {form.grad_out: "dy", form.input: "x", 2: "c", 3: "c", 4: "c", 5: "c", 6: "c"}
    if form.reserve is not None:
        kinds[form.reserve] = "r"
    mask = call.arg(form.mask, "output_mask") if form.mask is not None else (True, True, True)
    # (native_batch_norm_backward's meta kernel makes all three whatever the mask says)
    out_kinds = tuple(k for k, wanted in zip(("dx", "g", "g"), mask) if wanted or len(call.outputs) == 3)
    strategies = []
    for d in _dims(call.inputs[form.input].shape):
        sharded = Shard(d)
        g = _R if training else _P  # training: the kernel's all-reduced sums; eval: local terms
        strategies.append(_strategy(call, kinds, out_kinds, {"dy": sharded, "x": sharded, "dx": sharded, "c": _R,
                                                             "r": _R, "g": g},
                                    kernel="batch_norm_backward_stats" if training else None))
    if call.inputs[form.input].shape[1] != 1:
        channel = {"dy": Shard(1), "x": Shard(1), "dx": Shard(1), "c": Shard(0), "r": _R, "g": Shard(0)}
        strategies.append(_strategy(call, kinds, out_kinds, channel))
    for p in LINEAR_PARTIALS:  # linear in grad_out
        strategies.append(_strategy(call, kinds, out_kinds, {"dy": p, "x": _R, "dx": p, "c": _R, "r": _R, "g": p}))
    return strategies


# -- kernels -----------------------------------------------------------------------------------
def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over (N, C, *spatial)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _group_and_count(spec, coord) -> tuple[tuple, int]:
    """The ranks holding the other pieces of this channel slice, and the global count per channel."""
    dims = set(range(spec.ndim)) - {1}
    return shard_group(spec, dims, coord), math.prod(spec.shape[d] for d in dims)


def _global_stats(x: torch.Tensor, shift: Optional[torch.Tensor], group: tuple, count: int):
    """Mean and biased variance per channel over the pieces of the ranks in `group` (one all-reduce)."""
    dims = [d for d in range(x.dim()) if d != 1]
    n = x.numel() // max(x.shape[1], 1)
    acc = x.float() if x.dtype in _LOW_PRECISION else x
    if n:
        var, mean = torch.var_mean(acc, dims, correction=0)
    else:  # an empty piece (more ranks than rows): no terms
        var = mean = acc.new_zeros(x.shape[1])
    k = shift.to(acc.dtype) if shift is not None else torch.zeros_like(mean)
    dev = mean - k
    sums = comm.all_reduce(torch.stack([n * dev, n * (var + dev * dev)]), group)
    shifted_mean = sums[0] / count
    return k + shifted_mean, (sums[1] / count - shifted_mean * shifted_mean).clamp_min_(0)


@register_kernel("batch_norm_stats")
def batch_norm_stats_kernel(func, args, kwargs, in_specs, out_specs, coord):
    form = FORWARD[func]
    x = args[0]
    weight, bias, running_mean, running_var = (args[p] if p is not None else None for p in form.params)
    momentum, eps = args[form.momentum], args[form.eps]
    group, count = _group_and_count(in_specs[0], coord)
    mean, var = _global_stats(x, running_mean, group, count)
    invstd = (var + eps).rsqrt()
    # normalizing by given statistics is the eval-mode kernel: one fused pass (x * scale + shift),
    # its parameters in the statistics' precision (a low-precision input takes float ones)
    affine = [None if p is None else p.to(mean.dtype) for p in (weight, bias)]
    out = torch.batch_norm(x, *affine, mean, var, False, 0.0, eps, False)
    stat_dtype = out_specs[1].meta.dtype
    results = [out, mean.to(stat_dtype), invstd.to(stat_dtype)]
    if form.reserve:
        results.append(torch.empty(out_specs[3].local_shape(coord), dtype=out_specs[3].meta.dtype, device=x.device))
    if running_mean is not None:
        unbiased = var * (count / (count - 1)) if count > 1 else var
        new_mean = momentum * mean + (1 - momentum) * running_mean
        new_var = momentum * unbiased + (1 - momentum) * running_var
        if form.functional:
            results += [new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)]
        else:
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
    return tuple(results)


@register_kernel("batch_norm_backward_stats")
def batch_norm_backward_stats_kernel(func, args, kwargs, in_specs, out_specs, coord):
    form = BACKWARD[func]
    dy, x, weight, save_mean, save_invstd = args[form.grad_out], args[form.input], args[2], args[5], args[6]
    mask = args[form.mask] if form.mask is not None else (True, True, True)
    group, count = _group_and_count(in_specs[form.input], coord)
    acc = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    mean, invstd = save_mean.to(acc), save_invstd.to(acc)
    if x.numel():  # this piece's sums of dy and dy * xhat in one fused pass: the native
        # backward's weight and bias gradients
        _, local_dy_xhat, local_dy = aten.native_batch_norm_backward(
            dy, x, None, None, None, mean, invstd, True, 0.0, [False, True, True])
    else:  # an empty piece (more ranks than rows; the native kernel divides by its count)
        local_dy = local_dy_xhat = mean.new_zeros(x.shape[1])
    sums = comm.all_reduce(torch.stack([local_dy, local_dy_xhat]), group)
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    grads = [None, None, None]
    if mask[0]:
        # w * invstd * (dy - sum_dy / count - xhat * sum_dy_xhat / count) is per channel
        # a * dy + b * x + c: two fused passes
        a = invstd if weight is None else invstd * weight.to(acc)
        b = -a * invstd * sum_dy_xhat / count
        c = -a * sum_dy / count - b * mean
        n = x.dim()
        dx = torch.addcmul(_per_channel(c, n), _per_channel(b, n), x).addcmul_(_per_channel(a, n), dy)
        grads[0] = dx.to(x.dtype)
    param_dtype = weight.dtype if weight is not None else x.dtype
    if mask[1]:
        grads[1] = sum_dy_xhat.to(param_dtype)
    if mask[2]:
        grads[2] = sum_dy.to(param_dtype)
    return tuple(grads)
