"""Pooling (max with indices, average, adaptive; 1-D/2-D/3-D), its backward, and max-unpooling.

Pooling works on each (batch, channel) plane alone, so every leading dim shards with no
communication, on every operand alike (grad_output, input, indices).  Average pooling is linear:
a Partial input (or grad_output) passes.  A spatial dim is local for average pooling whose windows
tile it exactly (kernel = stride, no padding, the dim a multiple of the stride, and even pieces
of the output, so each piece holds whole windows); adaptive average pooling is that when the
output size divides the input's.  Every other split of a spatial dim stays split through a halo
(`spmd.halo`): each rank receives the rows its windows read and pools its piece of the output
(max pooling's indices are rebased to the whole plane); the backward sends the gradient of those
rows back.  Adaptive average pooling to one row (a CNN's global pooling) is a mean over the
split dim instead: each rank's average of its rows, weighted by its share of them, is a
Partial(sum) term.  Adaptive pooling whose output size does not divide the input's has windows
of uneven overlap, which no halo serves: its input is gathered (`spatial.gathered`).
"""
from __future__ import annotations

import torch

import math

from ..placement import Partial, Replicate, Shard
from .halo import Window, keep, local_grid, narrow_back, pad_back, split_dims, widen
from .registry import register, register_kernel
from .spatial import gathered, leading_strategies, per_dim, schema_args, spatial_dims, split_alike
from .strategy import OpCall, OpStrategy

aten = torch.ops.aten


def _n(name: str) -> int:
    """Spatial dims of an op from its name (max_pool2d_with_indices -> 2)."""
    return int(next(c for c in name.split("::")[-1] if c.isdigit()))


def _tiling_dims(shape, n_spatial: int, kernel, stride, padding) -> list[int]:
    """Spatial dims that windows tile exactly (kernel = stride, no padding, whole windows)."""
    k = per_dim(kernel, n_spatial)
    s = per_dim(stride, n_spatial) if stride else k  # stride=[] means the kernel size
    p = per_dim(padding, n_spatial)
    return [d for j, d in enumerate(spatial_dims(shape, n_spatial))
            if k[j] == s[j] and p[j] == 0 and shape[d] % s[j] == 0]


def _tiled(dims, n_in: int, pooled: int) -> list[OpStrategy]:
    """Each rank pools its own whole windows: the pooled operand's pieces (the forward's output,
    -1, or the backward's grad_output, 0) must be even."""
    return [OpStrategy((Shard(d),), (Shard(d),) * n_in, even=((pooled, d),)) for d in dims]


def _adaptive_dims(x, out, n: int) -> tuple[list[int], list[int]]:
    """(dims whose adaptive windows tile the input, dims whose windows overlap unevenly)."""
    tiling = [d for d in spatial_dims(x, n) if out[d] and x[d] % out[d] == 0]
    return tiling, [d for d in spatial_dims(x, n) if d not in tiling]


# -- forward -----------------------------------------------------------------------------------
_MAX = [aten.max_pool1d_with_indices, aten.max_pool2d_with_indices, aten.max_pool3d_with_indices,
        aten.max_pool1d, aten.max_pool2d, aten.max_pool3d]
_ADAPTIVE_MAX = [aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.adaptive_max_pool3d]


@register(_MAX)
def max_pool_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    return leading_strategies(call, n) + split_alike(call, spatial_dims(call.inputs[0].shape, n), "pool")


@register([aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d])
def avg_pool_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    shape = call.inputs[0].shape
    kernel = call.arg(1, "kernel_size")
    tiling = _tiling_dims(shape, n, kernel, call.arg(2, "stride", []), call.arg(3, "padding", 0))
    return (leading_strategies(call, n, linear=True) + _tiled(tiling, 1, -1)
            + split_alike(call, spatial_dims(shape, n), "pool"))


def _adaptive_local_args(args, kwargs, out_shapes):
    """The local op pools its piece to its piece of the output."""
    n = len(args[1])
    return [args[0], list(out_shapes[0][-n:])] + list(args[2:]), kwargs


def _to_one_row(x, out, dims) -> tuple[list[int], list[int]]:
    """(dims of `dims` pooled to one row, the others): a split of the first is a mean's."""
    whole = [d for d in dims if out[d] == 1 and x[d] != 1]
    return whole, [d for d in dims if d not in whole]


@register([aten.adaptive_avg_pool1d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d],
          local_args=_adaptive_local_args)
def adaptive_avg_pool_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    x, out = call.inputs[0].shape, call.outputs[0].shape
    tiling, uneven = _adaptive_dims(x, out, n)
    means, tiling = _to_one_row(x, out, tiling)
    return (leading_strategies(call, n, linear=True) + _tiled(tiling, 1, -1) + split_alike(call, tiling, "pool")
            + [OpStrategy((Partial(),), (Shard(d),), kernel="pool") for d in means] + gathered(call, uneven))


@register(_ADAPTIVE_MAX, local_args=_adaptive_local_args)
def adaptive_max_pool_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    tiling, uneven = _adaptive_dims(call.inputs[0].shape, call.outputs[0].shape, n)
    return leading_strategies(call, n) + split_alike(call, tiling, "pool") + gathered(call, uneven)


# -- backward ----------------------------------------------------------------------------------
@register([aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward])
def max_pool_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_output, input, indices): linear in grad_output (the indices fixed)."""
    n = _n(call.func._schema.name)
    return (leading_strategies(call, n, linear=True)
            + split_alike(call, spatial_dims(call.inputs[1].shape, n), "pool_backward", at=1))


@register([aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward])
def adaptive_max_pool_backward_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    tiling, _ = _adaptive_dims(call.inputs[1].shape, call.inputs[0].shape, n)
    return leading_strategies(call, n, linear=True) + split_alike(call, tiling, "pool_backward", at=1)


@register([aten.avg_pool2d_backward, aten.avg_pool3d_backward])
def avg_pool_backward_rule(call: OpCall) -> list[OpStrategy]:
    n = _n(call.func._schema.name)
    x = call.inputs[1].shape
    tiling = _tiling_dims(x, n, call.arg(2, "kernel_size"), call.arg(3, "stride"), call.arg(4, "padding"))
    return (leading_strategies(call, n, linear=True, at=1) + _tiled(tiling, 2, 0)
            + split_alike(call, spatial_dims(x, n), "pool_backward", at=1))


@register([aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward])
def adaptive_avg_pool_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_output, input); pooled to one row: the mean's gradient, grad_output whole."""
    n = _n(call.func._schema.name)
    g, x = call.inputs[0].shape, call.inputs[1].shape
    tiling, _ = _adaptive_dims(x, g, n)
    means, tiling = _to_one_row(x, g, tiling)
    return (leading_strategies(call, n, linear=True, at=1) + _tiled(tiling, 2, 0)
            + split_alike(call, tiling, "pool_backward", at=1)
            + [OpStrategy((Shard(d),), (Replicate(), Shard(d)), kernel="pool_backward") for d in means])


@register([aten.max_unpool2d, aten.max_unpool3d])
def max_unpool_rule(call: OpCall) -> list[OpStrategy]:
    """(input, indices) -> the plane with each value put back at its index: per plane, linear."""
    return leading_strategies(call, _n(call.func._schema.name), linear=True)


# -- kernels: pooling a piece widened by its halo -----------------------------------------------
def _windows(name: str, args, x_shape, out_shape, splits) -> list[Window]:
    """The window along each split dim, from the forward's arguments (`args[0]` the input) and
    the global shapes of its input and output."""
    n = _n(name)
    first = len(x_shape) - n
    if "adaptive" in name:  # windows that tile: kernel = stride = input / output
        return [Window(x_shape[sd.dim] // out_shape[sd.dim], x_shape[sd.dim] // out_shape[sd.dim]) for sd in splits]
    kernel = per_dim(args[1], n)
    stride = per_dim(args[2], n) if args[2] else kernel
    padding = per_dim(args[3], n)
    dilation = per_dim(args[4], n) if "max" in name else [1] * n
    return [Window(kernel[j], stride[j], padding[j], dilation[j]) for j in (sd.dim - first for sd in splits)]


def _plane(t: torch.Tensor, n: int) -> list[int]:
    return list(t.shape[-n:])


def _mean_dims(x_spec, other_spec) -> list[int]:
    """Dims the input splits where the other operand (the output, or the backward's
    grad_output) is not split alike: adaptive average pooling to one row, a mean's term."""
    return sorted({p.dim for p, o, k in zip(x_spec.placements, other_spec.placements, x_spec.mesh.shape)
                   if type(p) is Shard and o != p and k > 1})


def _share(x: torch.Tensor, x_spec, dims) -> float:
    """This rank's share of the rows along `dims` (what weighs its average in the mean)."""
    return math.prod(x.shape[d] / x_spec.shape[d] for d in dims)


@register_kernel("pool")
def pool_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op on the input piece widened by its halo, cut to this rank's output rows; max
    pooling's indices (positions in the widened plane) are rebased to the whole plane; a mean
    over split rows is this rank's average weighted by its share."""
    args = schema_args(func, args, kwargs)
    name = func._schema.name
    n = _n(name)
    x, x_spec = args[0], in_specs[0]
    means = _mean_dims(x_spec, out_specs[0])
    splits = split_dims(x_spec, out_specs[0], coord, [d for d in spatial_dims(x_spec.shape, n) if d not in means])
    windows = _windows(name, args, x_spec.shape, out_specs[0].shape, splits)
    wide = widen(x, splits, windows)
    if wide is None or not all(x.shape[d] for d in means):  # no output rows, or no rows to average
        outs = tuple(torch.zeros(s.local_shape(coord), dtype=s.meta.dtype, device=x.device) for s in out_specs)
        return outs if len(outs) > 1 else outs[0]
    out = func(wide, *args[1:])
    if not isinstance(out, tuple):
        out = keep(out, splits, windows)
        return out * _share(x, x_spec, means) if means else out
    values, index = out
    index = local_grid(index, splits, windows, _plane(wide, n), list(x_spec.shape[-n:]), to_global=True)
    return keep(values, splits, windows), keep(index, splits, windows)


@register_kernel("pool_backward")
def pool_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op's backward on the widened plane (read for its shape only: nothing moves before
    it), the output gradient padded with zeros to the local forward's output; the gradient of
    each received row goes back to its holder.  A mean's gradient is weighted by the share."""
    args = schema_args(func, args, kwargs)
    name = func._schema.name
    n = _n(name)
    g, x, x_spec = args[0], args[1], in_specs[1]
    forward = getattr(aten, name.split("::")[-1][: -len("_backward")]).default
    if "adaptive" in name:  # (grad_output, self[, indices]): the output size is grad_output's
        fargs = [x, _plane(g, n)]
    else:  # (grad_output, self, the forward's settings[, indices])
        fargs = [x] + (args[2:-1] if "max" in name else args[2:])
    means = _mean_dims(x_spec, in_specs[0])
    splits = split_dims(x_spec, in_specs[0], coord, [d for d in spatial_dims(x_spec.shape, n) if d not in means])
    windows = _windows(name, fargs, x_spec.shape, in_specs[0].shape, splits)
    wide = widen(x, splits, windows, values=False)
    grad = None
    if wide is not None and all(x.shape[d] for d in means):
        full = forward(wide.to("meta"), *fargs[1:])
        full = (full[0] if isinstance(full, tuple) else full).shape
        largs = [pad_back(g, splits, windows, full), wide] + args[2:]
        if "max" in name:  # the indices, last: rebased to the widened plane
            index = local_grid(args[-1], splits, windows, _plane(wide, n), list(x_spec.shape[-n:]), to_global=False)
            largs[-1] = pad_back(index, splits, windows, full)
        grad = func(*largs)
        if means:
            grad = grad * _share(x, x_spec, means)
    return narrow_back(grad, x, splits, windows)
