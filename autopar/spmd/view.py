"""View and layout ops: reshape/view, transpose/permute/t, (un)squeeze, expand (and their *_copy).

All are linear, so every Partial kind passes through.  A reshape keeps a shard on the
outermost dim of a group of merged or split dims when that dim divides evenly (otherwise
the local pieces would not be the pieces of the new shape).  Merging dims whose sharded
dim is not the outermost ([b, h] split on h, viewed as [b * h]: attention heads merged
into a batched matmul's batch) gives a StridedShard, every block of h split alike, and
splitting such a dim back at its block size gives the Shard again.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..placement import Shard, StridedShard
from .registry import register, register_kernel
from .strategy import ALL_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten


def _partials(n_in: int = 1) -> list[OpStrategy]:
    return [OpStrategy((p,), (p,) + (None,) * (n_in - 1)) for p in ALL_PARTIALS]


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products: [(src dims, dst dims), ...] (size-1 dims dropped)."""
    groups = []
    i = j = 0
    src_dims = [d for d, s in enumerate(src) if s != 1]
    dst_dims = [d for d, s in enumerate(dst) if s != 1]
    if 0 in src or 0 in dst:  # no elements: products say nothing; pair the leading equal dims
        pairs = zip(src_dims, dst_dims)
        return [([a], [b]) for a, b in itertools.takewhile(lambda p: src[p[0]] == dst[p[1]], pairs)]
    while i < len(src_dims) and j < len(dst_dims):
        gi, gj = [src_dims[i]], [dst_dims[j]]
        a, b = src[src_dims[i]], dst[dst_dims[j]]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                gi.append(src_dims[i])
                a *= src[src_dims[i]]
                i += 1
            else:
                gj.append(dst_dims[j])
                b *= dst[dst_dims[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def _view_local_args(args, kwargs, out_shapes):
    return [args[0], list(out_shapes[0])] + list(args[2:]), kwargs


@register([aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten._reshape_alias, aten.view_copy,
           aten.expand_copy], local_args=_view_local_args)
def view_rule(call: OpCall) -> list[OpStrategy]:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    extra = (None,) * (len(call.inputs) - 1)
    if call.func._schema.name in ("aten::expand", "aten::expand_copy"):
        offset = len(dst) - len(src)
        strategies = [
            OpStrategy((Shard(d + offset),), (Shard(d),) + extra)
            for d in range(len(src))
            if src[d] == dst[d + offset] and src[d] != 1
        ]
        return strategies + _partials(len(call.inputs))
    strategies = []
    for gi, gj in reshape_groups(src, dst):
        d_in, d_out = gi[0], gj[0]
        if len(gi) == 1 and len(gj) == 1:
            strategies.append(OpStrategy((Shard(d_out),), (Shard(d_in),) + extra))
        elif len(gi) == 1:  # split one dim: the outer new dim must cut evenly
            strategies.append(OpStrategy((Shard(d_out),), (Shard(d_in),) + extra, even=((0, d_in), (-1, d_out))))
        elif len(gj) == 1:  # merge dims: the outer old dim must cut evenly
            strategies.append(OpStrategy((Shard(d_out),), (Shard(d_in),) + extra, even=((0, d_in),)))
            for j in range(1, len(gi)):  # an inner dim split: every block of the outer ones alike
                blocks = math.prod(src[d] for d in gi[:j])
                strategies.append(OpStrategy((StridedShard(d_out, blocks),), (Shard(gi[j]),) + extra,
                                             even=((0, gi[j]),)))
        if len(gi) == 1 and len(gj) > 1:  # a strided dim split back at its block size
            for j in range(1, len(gj)):
                blocks = math.prod(dst[d] for d in gj[:j])
                strategies.append(OpStrategy((Shard(gj[j]),), (StridedShard(d_in, blocks),) + extra,
                                             even=((-1, gj[j]),)))
    return strategies + _partials(len(call.inputs))


def _permuted(call: OpCall, perm: list[int]) -> list[OpStrategy]:
    """Output dim i is input dim perm[i]."""
    return [OpStrategy((Shard(i),), (Shard(p),)) for i, p in enumerate(perm)] + _partials()


@register([aten.permute, aten.permute_copy])
def permute_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    return _permuted(call, [d % nd if nd else 0 for d in call.arg(1, "dims")])


@register([aten.transpose, aten.t, aten.transpose_, aten.t_, aten.transpose_copy, aten.t_copy])
def transpose_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    perm = list(range(nd))
    if nd >= 2:
        a, b = 0, 1
        if "transpose" in call.func._schema.name:
            a, b = call.arg(1, "dim0") % nd, call.arg(2, "dim1") % nd
        perm[a], perm[b] = perm[b], perm[a]
    return _permuted(call, perm)


# squeeze of every size-1 dim -> squeeze of the dims it names
_SQUEEZE_ALL = {aten.squeeze.default: aten.squeeze.dims, aten.squeeze_.default: aten.squeeze_.dims,
                aten.squeeze_copy.default: aten.squeeze_copy.dims}


@register([aten.unsqueeze, aten.squeeze, aten.unsqueeze_, aten.squeeze_, aten.unsqueeze_copy, aten.squeeze_copy])
def squeeze_rule(call: OpCall) -> list[OpStrategy]:
    """(Un)squeeze only adds/drops size-1 dims: the other dims keep their shards.  A squeeze of
    every size-1 dim squeezes the global ones only (a piece of 1 row is no size-1 dim)."""
    kernel = "squeeze_global" if call.func in _SQUEEZE_ALL else None
    return [
        OpStrategy((Shard(gj[0]),), (Shard(gi[0]),), kernel=kernel)
        for gi, gj in reshape_groups(call.inputs[0].shape, call.outputs[0].shape)
    ] + _partials()


def _global_ones(spec) -> list[int]:
    return [d for d, n in enumerate(spec.shape) if n == 1]


def _no_local_ones(func, in_specs, coord) -> bool:
    """Where no piece has a size-1 dim the global tensor lacks, squeeze() is the plain op."""
    return [d for d, n in enumerate(in_specs[0].local_shape(coord)) if n == 1] == _global_ones(in_specs[0])


@register_kernel("squeeze_global", plain_when=_no_local_ones)
def squeeze_global_kernel(func, args, kwargs, in_specs, out_specs, coord):
    return _SQUEEZE_ALL[func](args[0], _global_ones(in_specs[0]))
