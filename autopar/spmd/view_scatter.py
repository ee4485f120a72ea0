"""Diagonals, windows and scatters into views: diagonal (its copy and backward), diag_embed,
diagonal_scatter, select_scatter, slice_scatter, unfold (its copy and backward), rot90, and
as_strided where it is a plain view.

Each moves elements of some dims (the two of a diagonal, the selected or sliced one, the
windowed one, the rotated pair) and leaves the others alone: those keep their shards, in the
order the op lays them out.  The dims it moves along stay whole.  None combines elements, and
what they fill is zeros (or self's values), so every Partial kind passes through.
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from .registry import register, register_kernel
from .strategy import ALL_PARTIALS, OpCall, OpStrategy
from .tensor_ops import _input_sizes_local, _uncut

aten = torch.ops.aten


def _norm(d: int, nd: int) -> int:
    return d % nd if nd else 0


def _paired(pairs, n_in: int, n_moved: int = 0) -> list[OpStrategy]:
    """`pairs`: (output dim, placement per input) for each dim that may shard; every Partial
    kind passes on the first `n_in - n_moved` inputs (the rest, the moved operands, Replicate)."""
    strategies = [OpStrategy((Shard(o),), ins) for o, ins in pairs]
    kept = n_in - n_moved
    return strategies + [OpStrategy((p,), (p,) * kept + (Replicate(),) * n_moved) for p in ALL_PARTIALS]


def _others(nd: int, dims) -> list[int]:
    return [d for d in range(nd) if d not in dims]


def _diagonal_dims(call: OpCall, at: int, nd: int, defaults=(0, 1)) -> tuple[int, int]:
    return _norm(call.arg(at, "dim1", defaults[0]), nd), _norm(call.arg(at + 1, "dim2", defaults[1]), nd)


@register([aten.diagonal.default, aten.diagonal_copy.default])
def diagonal_rule(call: OpCall) -> list[OpStrategy]:
    """The other dims keep their order, the diagonal comes last."""
    shape = call.inputs[0].shape
    others = _others(len(shape), _diagonal_dims(call, 2, len(shape)))
    return _paired([(i, (Shard(d),)) for i, d in enumerate(others) if shape[d] != 1], 1)


@register([aten.diagonal_backward.default], local_args=_input_sizes_local)
def diagonal_backward_rule(call: OpCall) -> list[OpStrategy]:
    """grad (others..., diagonal) into zeros of the input's size."""
    shape = call.outputs[0].shape
    others = _others(len(shape), _diagonal_dims(call, 3, len(shape)))
    return _paired([(d, (Shard(i),)) for i, d in enumerate(others) if shape[d] != 1], 1)


@register([aten.diag_embed.default])
def diag_embed_rule(call: OpCall) -> list[OpStrategy]:
    """The input's last dim becomes the diagonal of (dim1, dim2); its other dims fill the rest."""
    shape = call.outputs[0].shape
    others = _others(len(shape), _diagonal_dims(call, 2, len(shape), (-2, -1)))
    return _paired([(d, (Shard(i),)) for i, d in enumerate(others) if shape[d] != 1], 1)


@register([aten.diagonal_scatter.default])
def diagonal_scatter_rule(call: OpCall) -> list[OpStrategy]:
    """self (others..., dim1, dim2) with src (others..., diagonal) written on the diagonal."""
    shape = call.outputs[0].shape
    others = _others(len(shape), _diagonal_dims(call, 3, len(shape)))
    return _paired([(d, (Shard(d), Shard(i))) for i, d in enumerate(others) if shape[d] != 1], 2)


@register([aten.select_scatter.default])
def select_scatter_rule(call: OpCall) -> list[OpStrategy]:
    """src is self without `dim`."""
    shape = call.outputs[0].shape
    dim = _norm(call.arg(2, "dim"), len(shape))
    return _paired([(d, (Shard(d), Shard(d - (d > dim)))) for d in _others(len(shape), {dim}) if shape[d] != 1], 2)


@register([aten.slice_scatter.default])
def slice_scatter_rule(call: OpCall) -> list[OpStrategy]:
    """src is self sliced along `dim`: the dims it holds whole shard alike (the sliced one too,
    when the slice takes it whole)."""
    uncut = _uncut(call.inputs[0].shape, call.inputs[1].shape)
    return _paired([(d, (Shard(d), Shard(d))) for d in uncut if call.inputs[0].shape[d] != 1], 2)


@register([aten.unfold.default, aten.unfold_copy.default])
def unfold_rule(call: OpCall) -> list[OpStrategy]:
    """Windows along `dimension` (a new last dim holds each window): the other dims shard."""
    shape = call.inputs[0].shape
    dim = _norm(call.arg(1, "dimension"), len(shape))
    return _paired([(d, (Shard(d),)) for d in _others(len(shape), {dim}) if shape[d] != 1], 1)


@register([aten.unfold_backward.default], local_args=_input_sizes_local)
def unfold_backward_rule(call: OpCall) -> list[OpStrategy]:
    """grad (input dims with `dim` as windows, window) summed back into the input's size."""
    shape = call.outputs[0].shape
    dim = _norm(call.arg(2, "dim"), len(shape))
    return _paired([(d, (Shard(d),)) for d in _others(len(shape), {dim}) if shape[d] != 1], 1)


@register([aten.rot90.default])
def rot90_rule(call: OpCall) -> list[OpStrategy]:
    """The two rotated dims stay whole (a quarter turn swaps them)."""
    shape = call.inputs[0].shape
    dims = {_norm(d, len(shape)) for d in call.arg(2, "dims", (0, 1))}
    return _paired([(d, (Shard(d),)) for d in _others(len(shape), dims) if shape[d] != 1], 1)


# -- as_strided ------------------------------------------------------------------------------------
def plain_view(meta, size, stride, offset) -> dict | None:
    """{output dim: input dim} when as_strided(size, stride, offset) is a plain view of a tensor
    of `meta`: the first elements of some dims (index 0 of the others), in some order, maybe
    expanded (stride 0).  None otherwise (overlapping windows, another start)."""
    if offset not in (None, 0):
        return None
    used, mapping = set(), {}
    for d, (n, st) in enumerate(zip(size, stride)):
        if n == 1 or st == 0:
            continue
        match = [p for p, (m, t) in enumerate(zip(meta.shape, meta.stride)) if t == st and m != 1]
        if len(match) != 1 or match[0] in used or n > meta.shape[match[0]]:
            return None
        used.add(match[0])
        mapping[d] = match[0]
    return mapping


@register([aten.as_strided.default, aten.as_strided_copy.default])
def as_strided_rule(call: OpCall) -> list[OpStrategy]:
    """A plain view: a dim it takes whole shards (the kernel gives the piece's strides)."""
    size, stride = call.arg(1, "size"), call.arg(2, "stride")
    mapping = plain_view(call.inputs[0], size, stride, call.arg(3, "storage_offset"))
    if mapping is None:
        return []
    shape = call.inputs[0].shape
    return [OpStrategy(s.outputs, s.inputs, kernel="as_strided_piece")
            for s in _paired([(d, (Shard(p),)) for d, p in mapping.items() if size[d] == shape[p]], 1)]


@register_kernel("as_strided_piece")
def as_strided_piece_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The same view of the local piece: its sizes and strides, from its start."""
    local, size, stride = args[0], args[1], args[2]
    mapping = plain_view(in_specs[0].meta, size, stride, args[3] if len(args) > 3 else None)
    local_stride = [local.stride(mapping[d]) if d in mapping else st for d, st in enumerate(stride)]
    return func(local, out_specs[0].local_shape(coord), local_stride, local.storage_offset())
