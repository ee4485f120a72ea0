"""Pooling (max with indices, average, adaptive; 1-D/2-D/3-D), its backward, and max-unpooling.

Pooling works on each (batch, channel) plane alone, so every leading dim shards with no
communication, on every operand alike (grad_output, input, indices).  Average pooling is linear:
a Partial input (or grad_output) passes.  A spatial dim is local for average pooling whose windows
tile it exactly (kernel = stride, no padding, the dim a multiple of the stride, and even pieces
of the output, so each piece holds whole windows); adaptive average pooling is that when the
output size divides the input's.  Max pooling's indices count positions in the whole plane, so a
split plane would need them rebased: refused, like every other spatial split (`needs_halo`).
"""
from __future__ import annotations

import torch

from ..placement import Shard
from .registry import register
from .spatial import halo_refusals, leading_strategies, per_dim, spatial_dims
from .strategy import OpCall, Strategy

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


def _tiled(dims, n_in: int, pooled: int) -> list[Strategy]:
    """Each rank pools its own whole windows: the pooled operand's pieces (the forward's output,
    -1, or the backward's grad_output, 0) must be even."""
    return [Strategy((Shard(d),), (Shard(d),) * n_in, even=((pooled, d),)) for d in dims]


# -- forward -----------------------------------------------------------------------------------
_MAX = [aten.max_pool1d_with_indices, aten.max_pool2d_with_indices, aten.max_pool3d_with_indices,
        aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.adaptive_max_pool1d, aten.adaptive_max_pool2d,
        aten.adaptive_max_pool3d]


@register(_MAX)
def max_pool_rule(call: OpCall) -> list[Strategy]:
    n = _n(call.func._schema.name)
    return leading_strategies(call, n) + halo_refusals(call, spatial_dims(call.inputs[0].shape, n))


@register([aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d])
def avg_pool_rule(call: OpCall) -> list[Strategy]:
    n = _n(call.func._schema.name)
    shape = call.inputs[0].shape
    kernel = call.arg(1, "kernel_size")
    tiling = _tiling_dims(shape, n, kernel, call.arg(2, "stride", []), call.arg(3, "padding", 0))
    halo = [d for d in spatial_dims(shape, n) if d not in tiling]
    return leading_strategies(call, n, linear=True) + _tiled(tiling, 1, -1) + halo_refusals(call, halo)


def _adaptive_local_args(args, kwargs, out_shapes):
    """The local op pools its piece to its piece of the output."""
    n = len(args[1])
    return [args[0], list(out_shapes[0][-n:])] + list(args[2:]), kwargs


@register([aten.adaptive_avg_pool1d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d],
          local_args=_adaptive_local_args)
def adaptive_avg_pool_rule(call: OpCall) -> list[Strategy]:
    n = _n(call.func._schema.name)
    x, out = call.inputs[0].shape, call.outputs[0].shape
    tiling = [d for d in spatial_dims(x, n) if out[d] and x[d] % out[d] == 0]
    halo = [d for d in spatial_dims(x, n) if d not in tiling]
    return leading_strategies(call, n, linear=True) + _tiled(tiling, 1, -1) + halo_refusals(call, halo)


# -- backward ----------------------------------------------------------------------------------
@register([aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward,
           aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward])
def max_pool_backward_rule(call: OpCall) -> list[Strategy]:
    """(grad_output, input, indices): linear in grad_output (the indices fixed)."""
    return leading_strategies(call, _n(call.func._schema.name), linear=True)


@register([aten.avg_pool2d_backward, aten.avg_pool3d_backward])
def avg_pool_backward_rule(call: OpCall) -> list[Strategy]:
    n = _n(call.func._schema.name)
    tiling = _tiling_dims(call.inputs[1].shape, n, call.arg(2, "kernel_size"), call.arg(3, "stride"),
                          call.arg(4, "padding"))
    return leading_strategies(call, n, linear=True, at=1) + _tiled(tiling, 2, 0)


@register([aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward])
def adaptive_avg_pool_backward_rule(call: OpCall) -> list[Strategy]:
    n = _n(call.func._schema.name)
    g, x = call.inputs[0].shape, call.inputs[1].shape
    tiling = [d for d in spatial_dims(x, n) if g[d] and x[d] % g[d] == 0]
    return leading_strategies(call, n, linear=True, at=1) + _tiled(tiling, 2, 0)


@register([aten.max_unpool2d, aten.max_unpool3d])
def max_unpool_rule(call: OpCall) -> list[Strategy]:
    """(input, indices) -> the plane with each value put back at its index: per plane, linear."""
    return leading_strategies(call, _n(call.func._schema.name), linear=True)
