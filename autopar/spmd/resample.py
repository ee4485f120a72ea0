"""Resampling and rearranging images: interpolate/upsample (every mode), grid_sample,
pixel_shuffle/unshuffle, unfold/fold (im2col/col2im), padding, channel_shuffle; and their backward.

All of them treat each (batch, channel) plane alone, so leading dims shard with no
communication, and all are linear (a Partial input or grad_output passes).  Where an op maps
whole blocks of positions to whole blocks, a split there stays local too:
  nearest upsampling by a power-of-two factor (each input row becomes `factor` output rows; a
  power of two keeps the float index arithmetic exact on every piece);
  pixel_shuffle/unshuffle move r x r blocks between channels and space: channels split into
  whole groups of r^2, rows and columns into whole blocks;
  unfold/fold put a channel's patches in consecutive rows: channels split evenly.
Other spatial splits need a halo (interpolation, overlapping patches): refused (`needs_halo`).
grid_sample reads the input anywhere the grid points, so its input stays whole in space, but each
output position is its grid point's alone: the grid's positions split the output's.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import register
from .spatial import halo_refusals, leading_strategies, spatial_dims
from .strategy import OpCall, Strategy

aten = torch.ops.aten
_SUM_AVG = (Partial("sum"), Partial("avg"))

_NEAREST = {"upsample_nearest", "_upsample_nearest_exact"}
_UPSAMPLE = {  # name stem -> spatial dims
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2, "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_trilinear3d": 3, "upsample_bicubic2d": 2,
    "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2, "_upsample_lanczos2d_aa": 2,
}


def _stem(call: OpCall) -> str:
    return call.func._schema.name.split("::")[-1]


def _doubling_dims(small, big, n: int) -> list[int]:
    """Spatial dims where `big` is `small` times a power of two (nearest copies whole rows)."""
    dims = []
    for d in spatial_dims(small, n):
        factor, rest = divmod(big[d], small[d]) if small[d] else (0, 1)
        if not rest and factor & (factor - 1) == 0 and small[d] != 1:
            dims.append(d)
    return dims


def _blocks(dims, n_in: int, even_at: tuple) -> list[Strategy]:
    """Each split dim maps whole blocks to whole blocks when the pieces of `even_at` are even."""
    return [Strategy((Shard(d),), (Shard(d),) * n_in, even=(even_at + (d,),)) for d in dims]


def _upsample_local_args(args, kwargs, out_shapes):
    """output_size (where given) is this rank's piece of the output."""
    if args[1] is not None:
        args = [args[0], list(out_shapes[0][-len(args[1]):])] + list(args[2:])
    return args, kwargs


@register([getattr(aten, name) for name in _UPSAMPLE], local_args=_upsample_local_args)
def upsample_rule(call: OpCall) -> list[Strategy]:
    stem = _stem(call)
    n = _UPSAMPLE[stem]
    x, out = call.inputs[0].shape, call.outputs[0].shape
    local = _doubling_dims(x, out, n) if stem[:-2] in _NEAREST else []
    halo = [d for d in spatial_dims(x, n) if d not in local]
    return leading_strategies(call, n, linear=True) + _blocks(local, 1, (0,)) + halo_refusals(call, halo)


def _upsample_backward_local_args(args, kwargs, out_shapes):
    """(grad_output, output_size, input_size, ...): both sizes of this rank's pieces."""
    g = args[0]
    return [g, list(g.shape[-len(args[1]):]), list(out_shapes[0])] + list(args[3:]), kwargs


@register([getattr(aten, name + "_backward") for name in _UPSAMPLE], local_args=_upsample_backward_local_args)
def upsample_backward_rule(call: OpCall) -> list[Strategy]:
    stem = _stem(call)[: -len("_backward")]
    n = _UPSAMPLE[stem]
    g, x = call.inputs[0].shape, call.outputs[0].shape
    local = _doubling_dims(x, g, n) if stem[:-2] in _NEAREST else []
    return leading_strategies(call, n, linear=True) + _blocks(local, 1, (-1,))


# -- pixel shuffle ---------------------------------------------------------------------------------
@register([aten.pixel_shuffle, aten.pixel_unshuffle])
def pixel_shuffle_rule(call: OpCall) -> list[Strategy]:
    """(*, C r^2, H, W) <-> (*, C, H r, W r): the dims before the channels shard freely; channels
    in whole groups of r^2 and rows/columns in whole blocks of r (the smaller side's pieces even)."""
    x, out = call.inputs[0].shape, call.outputs[0].shape
    shuffle = _stem(call) == "pixel_shuffle"
    nd = len(x)
    channel, space = nd - 3, [nd - 2, nd - 1]
    strategies = leading_strategies(call, 3, linear=True)
    few_channels = -1 if shuffle else 0  # the operand with C (not C r^2) channels
    small_space = 0 if shuffle else -1  # the operand with H (not H r) rows
    strategies += _blocks([channel] if out[channel] != 1 and x[channel] != 1 else [], 1, (few_channels,))
    strategies += _blocks([d for d in space if min(x[d], out[d]) != 1], 1, (small_space,))
    return strategies


# -- unfold / fold ---------------------------------------------------------------------------------
@register([aten.im2col, aten.col2im])
def unfold_fold_rule(call: OpCall) -> list[Strategy]:
    """im2col (N, C, H, W) -> (N, C kh kw, L), col2im back: batch, and channels split evenly on the
    image's side (a channel's patch rows stay together); a split image or L needs a halo."""
    unfold = call.func._schema.name == "aten::im2col"
    image = call.inputs[0].shape if unfold else call.outputs[0].shape
    channel = len(image) - 3
    strategies = leading_strategies(call, 3 if unfold else 2, linear=True)
    if image[channel] != 1:
        strategies += _blocks([channel], 1, (0 if unfold else -1,))
    return strategies + halo_refusals(call, spatial_dims(call.inputs[0].shape, 2 if unfold else 1))


# -- padding and channel shuffle -----------------------------------------------------------------------
_PADS = {"reflection_pad1d": 1, "reflection_pad2d": 2, "reflection_pad3d": 3,
         "replication_pad1d": 1, "replication_pad2d": 2, "replication_pad3d": 3}


@register([getattr(aten, name) for name in _PADS])
def pad_rule(call: OpCall) -> list[Strategy]:
    """The padded (trailing) dims stay whole; reflecting or repeating borders is linear."""
    return leading_strategies(call, _PADS[_stem(call)], linear=True)


@register([getattr(aten, name + "_backward") for name in _PADS])
def pad_backward_rule(call: OpCall) -> list[Strategy]:
    """(grad_output, input, padding)."""
    return leading_strategies(call, _PADS[_stem(call)[: -len("_backward")]], linear=True, at=1)


@register(aten.constant_pad_nd)
def constant_pad_rule(call: OpCall) -> list[Strategy]:
    """Dims the pad leaves alone keep their shards; a zero pad is linear (any value: avg is)."""
    x = call.inputs[0].shape
    pad = list(call.arg(1, "pad"))
    padded = {len(x) - 1 - i // 2 for i, p in enumerate(pad) if p}
    value = call.arg(2, "value", 0)
    strategies = [Strategy((Shard(d),), (Shard(d),)) for d in range(len(x)) if d not in padded and x[d] != 1]
    kinds = _SUM_AVG if not value else (Partial("avg"),)
    return strategies + [Strategy((p,), (p,)) for p in kinds]


@register([aten.channel_shuffle, aten.native_channel_shuffle])
def channel_shuffle_rule(call: OpCall) -> list[Strategy]:
    """(N, C, *): channels are permuted (whole), every other dim shards."""
    x = call.inputs[0].shape
    strategies = [Strategy((Shard(d),), (Shard(d),)) for d in range(len(x)) if d != 1 and x[d] != 1]
    return strategies + [Strategy((p,), (p,)) for p in _SUM_AVG]


# -- grid_sample -----------------------------------------------------------------------------------
@register([aten.grid_sampler_2d, aten.grid_sampler_3d])
def grid_sampler_rule(call: OpCall) -> list[Strategy]:
    """input (N, C, *space), grid (N, *out_space, k) -> (N, C, *out_space), einsum-like
    "nc..,nO..->ncO..": batch on both, channels on the input, output positions on the grid;
    linear in the input."""
    x, grid = call.inputs[0].shape, call.inputs[1].shape
    strategies = [Strategy((Shard(0),), (Shard(0),) * 2)] if x[0] != 1 else []
    if x[1] != 1:
        strategies.append(Strategy((Shard(1),), (Shard(1), Replicate())))
    strategies += [Strategy((Shard(d + 1),), (Replicate(), Shard(d))) for d in range(1, len(grid) - 1) if grid[d] != 1]
    return strategies + [Strategy((p,), (p, Replicate())) for p in _SUM_AVG]


@register([aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward])
def grid_sampler_backward_rule(call: OpCall) -> list[Strategy]:
    """(grad_output, input, grid) -> (grad_input?, grad_grid): each forward letter backwards (the
    grid's gradient sums over channels, the input's over output positions)."""
    x, grid = call.inputs[1].shape, call.inputs[2].shape
    with_input = len(call.outputs) == 2
    outs = lambda gi, gg: (gi, gg) if with_input else (gg,)  # noqa: E731
    strategies = [Strategy(outs(Shard(0), Shard(0)), (Shard(0),) * 3)] if x[0] != 1 else []
    if x[1] != 1:
        strategies.append(Strategy(outs(Shard(1), Partial()), (Shard(1), Shard(1), Replicate())))
    strategies += [Strategy(outs(Partial(), Shard(d)), (Shard(d + 1), Replicate(), Shard(d)))
                   for d in range(1, len(grid) - 1) if grid[d] != 1]
    return strategies + [Strategy(outs(p, p), (p, Replicate(), Replicate())) for p in _SUM_AVG]
