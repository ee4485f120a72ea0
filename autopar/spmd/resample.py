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
Interpolation (nearest, nearest-exact, linear, bilinear, trilinear, bicubic) and padding
(constant, reflect, replicate) along a split dim keep the split through a halo (`spmd.halo`):
along each split dim every output row reads a few input rows (its taps), which its rank
receives from their holders; the op then runs on the other dims.  Antialiased interpolation
and overlapping patches (unfold/fold) read too widely for a halo: their input is gathered.
grid_sample reads the input anywhere the grid points, so its input stays whole in space, but each
output position is its grid point's alone: the grid's positions split the output's.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from ..redistribute.halo import fetch_rows
from .halo import interpolation_map, map_rows, map_rows_backward, padding_map, probed_map, split_dims
from .registry import register, register_kernel
from .spatial import gathered, leading_strategies, schema_args, spatial_dims, split_alike
from .strategy import AFFINE_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten

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


def _blocks(dims, n_in: int, even_at: tuple) -> list[OpStrategy]:
    """Each split dim maps whole blocks to whole blocks when the pieces of `even_at` are even."""
    return [OpStrategy((Shard(d),), (Shard(d),) * n_in, even=(even_at + (d,),)) for d in dims]


def _upsample_local_args(args, kwargs, out_shapes):
    """output_size (where given) is this rank's piece of the output."""
    if args[1] is not None:
        args = [args[0], list(out_shapes[0][-len(args[1]):])] + list(args[2:])
    return args, kwargs


def _halo_modes(stem: str) -> bool:
    """Interpolations a halo serves: all but the antialiased ones (their taps span the scale)."""
    return not stem.endswith("_aa")


@register([getattr(aten, name) for name in _UPSAMPLE], local_args=_upsample_local_args)
def upsample_rule(call: OpCall) -> list[OpStrategy]:
    stem = _stem(call)
    n = _UPSAMPLE[stem]
    x, out = call.inputs[0].shape, call.outputs[0].shape
    local = _doubling_dims(x, out, n) if stem[:-2] in _NEAREST else []
    halo = [d for d in spatial_dims(x, n) if d not in local]
    strategies = leading_strategies(call, n, linear=True) + _blocks(local, 1, (0,))
    return strategies + (split_alike(call, spatial_dims(x, n), "interpolate") if _halo_modes(stem)
                         else gathered(call, halo))


def _upsample_backward_local_args(args, kwargs, out_shapes):
    """(grad_output, output_size, input_size, ...): both sizes of this rank's pieces."""
    g = args[0]
    return [g, list(g.shape[-len(args[1]):]), list(out_shapes[0])] + list(args[3:]), kwargs


@register([getattr(aten, name + "_backward") for name in _UPSAMPLE], local_args=_upsample_backward_local_args)
def upsample_backward_rule(call: OpCall) -> list[OpStrategy]:
    stem = _stem(call)[: -len("_backward")]
    n = _UPSAMPLE[stem]
    g, x = call.inputs[0].shape, call.outputs[0].shape
    local = _doubling_dims(x, g, n) if stem[:-2] in _NEAREST else []
    strategies = leading_strategies(call, n, linear=True) + _blocks(local, 1, (-1,))
    return strategies + (split_alike(call, spatial_dims(g, n), "interpolate_backward") if _halo_modes(stem) else [])


def _interpolation(stem: str, args, at: int):
    """(n spatial dims, align_corners or None, scales per spatial dim) of an upsample call whose
    settings follow argument `at` (after output_size; backward: after input_size)."""
    n = _UPSAMPLE[stem]
    nearest = stem[:-2] in _NEAREST
    align = None if nearest else args[at]
    scales = list(args[at if nearest else at + 1:])
    return n, align, scales + [None] * (n - len(scales))


def _row_map(forward, stem: str, n: int, j: int, in_size: int, out_size: int, align, scale, like: torch.Tensor):
    """The taps of `forward` (an upsample op) along its spatial dim j."""
    if stem[:-2] in _NEAREST:
        return probed_map(forward, n, j, in_size, out_size, scale, like.device.type)
    return interpolation_map("cubic" if "cubic" in stem else "linear", in_size, out_size, align, scale, like.dtype)


def _rest(first: int, splits, align, scales) -> list:
    """The op's align_corners and scale arguments for the dims not split (along the split ones
    it keeps the rows it has, with no scale: an identity in every mode)."""
    split = {sd.dim - first for sd in splits}
    return ([] if align is None else [align]) + [None if j in split else s for j, s in enumerate(scales)]


@register_kernel("interpolate")
def interpolate_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Along each split dim this rank's output rows from the input rows their taps read (sent by
    their holders); then the op along the other dims."""
    args = schema_args(func, args, kwargs)
    stem = func._schema.name.split("::")[-1]
    n, align, scales = _interpolation(stem, args, 2)
    x, x_spec, out_spec = args[0], in_specs[0], out_specs[0]
    first = x_spec.ndim - n
    splits = split_dims(x_spec, out_spec, coord, spatial_dims(x_spec.shape, n))
    for sd in splits:
        j = sd.dim - first
        taps = _row_map(func, stem, n, j, x_spec.shape[sd.dim], out_spec.shape[sd.dim], align, scales[j], x)
        x = map_rows(x, sd, taps)
    if len(splits) == n:
        return x
    if not x.numel():  # no rows here (the op refuses empty sizes)
        return x.new_zeros(out_spec.local_shape(coord))
    split = {sd.dim for sd in splits}
    sizes = [x.shape[d] if d in split else out_spec.shape[d] for d in spatial_dims(x_spec.shape, n)]
    return func(x, sizes, *_rest(first, splits, align, scales))


@register_kernel("interpolate_backward")
def interpolate_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op's backward along the dims not split, then each split dim's taps backwards, the
    gradient of the rows read from a peer sent back to it."""
    args = schema_args(func, args, kwargs)
    stem = func._schema.name.split("::")[-1][: -len("_backward")]
    forward = getattr(aten, stem).default
    n, align, scales = _interpolation(stem, args, 3)
    g, g_spec, x_spec = args[0], in_specs[0], out_specs[0]
    first = x_spec.ndim - n
    splits = split_dims(x_spec, g_spec, coord, spatial_dims(x_spec.shape, n))
    if len(splits) < n:
        split = {sd.dim for sd in splits}
        sizes = [g.shape[d] if d in split else g_spec.shape[d] for d in spatial_dims(x_spec.shape, n)]
        in_sizes = list(g.shape[:first]) + [g.shape[d] if d in split else x_spec.shape[d]
                                           for d in spatial_dims(x_spec.shape, n)]
        g = func(g, sizes, in_sizes, *_rest(first, splits, align, scales)) if g.numel() else g.new_zeros(in_sizes)
    for sd in reversed(splits):
        j = sd.dim - first
        g = map_rows_backward(g, sd, _row_map(forward, stem, n, j, x_spec.shape[sd.dim], g_spec.shape[sd.dim], align,
                                              scales[j], g))
    return g


# -- pixel shuffle ---------------------------------------------------------------------------------
@register([aten.pixel_shuffle, aten.pixel_unshuffle])
def pixel_shuffle_rule(call: OpCall) -> list[OpStrategy]:
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
def unfold_fold_rule(call: OpCall) -> list[OpStrategy]:
    """im2col (N, C, H, W) -> (N, C kh kw, L), col2im back: batch, and channels split evenly on the
    image's side (a channel's patch rows stay together); a split image or L is gathered."""
    unfold = call.func._schema.name == "aten::im2col"
    image = call.inputs[0].shape if unfold else call.outputs[0].shape
    channel = len(image) - 3
    strategies = leading_strategies(call, 3 if unfold else 2, linear=True)
    if image[channel] != 1:
        strategies += _blocks([channel], 1, (0 if unfold else -1,))
    return strategies + gathered(call, spatial_dims(call.inputs[0].shape, 2 if unfold else 1))


# -- padding and channel shuffle -----------------------------------------------------------------------
_PADS = {"reflection_pad1d": 1, "reflection_pad2d": 2, "reflection_pad3d": 3,
         "replication_pad1d": 1, "replication_pad2d": 2, "replication_pad3d": 3}


def _pairs(pad, ndim: int) -> dict:
    """{dim: (before, after)} of a pad list (its first pair pads the last dim)."""
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def _pad_strategies(call: OpCall, n: int, pad, kernel: str, at: int = 0, linear: bool = True) -> list[OpStrategy]:
    """Leading dims and unpadded dims split locally; padded dims through `kernel`'s halo."""
    shape = call.inputs[at].shape
    pairs = _pairs(pad, len(shape))
    padded = [d for d in spatial_dims(shape, n) if any(pairs.get(d, (0, 0)))]
    n_in, n_out = len(call.inputs), len(call.outputs)
    plain = [OpStrategy((Shard(d),) * n_out, (Shard(d),) * n_in) for d in spatial_dims(shape, n)
             if d not in padded and shape[d] != 1]
    return leading_strategies(call, n, linear=linear, at=at) + plain + split_alike(call, padded, kernel, at=at)


@register([getattr(aten, name) for name in _PADS])
def pad_rule(call: OpCall) -> list[OpStrategy]:
    """Reflecting or repeating borders is linear."""
    return _pad_strategies(call, _PADS[_stem(call)], call.arg(1, "padding"), "pad")


@register([getattr(aten, name + "_backward") for name in _PADS])
def pad_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_output, input, padding)."""
    return _pad_strategies(call, _PADS[_stem(call)[: -len("_backward")]], call.arg(2, "padding"), "pad_backward", at=1)


@register(aten.constant_pad_nd)
def constant_pad_rule(call: OpCall) -> list[OpStrategy]:
    """Dims the pad leaves alone keep their shards, padded (or cropped) ones through a halo; a
    zero pad is linear (any value: avg is)."""
    pad = list(call.arg(1, "pad"))
    value = call.arg(2, "value", 0)
    kinds = LINEAR_PARTIALS if not value else AFFINE_PARTIALS
    return _pad_strategies(call, len(pad) // 2, pad, "pad", linear=False) + [OpStrategy((p,), (p,)) for p in kinds]


def _constant_pad(x: torch.Tensor, splits, pairs: dict, pad: list, value) -> torch.Tensor:
    """constant_pad_nd of this rank's piece along split dims: output row o copies input row
    o - before where there is one; the rows it copies come from their holders."""
    pad = list(pad)
    ndim = x.dim()
    for sd in splits:
        before = pairs[sd.dim][0]
        need = [[(max(c - before, 0), min(e - before, sd.size))] if min(e - before, sd.size) > max(c - before, 0)
                else [] for c, e in sd.out]
        x = fetch_rows(x, sd.dim, sd.group, sd.me, sd.have, need)
        c, e = sd.out[sd.me]
        i = 2 * (ndim - 1 - sd.dim)
        pad[i] = min(max(before - c, 0), e - c)
        pad[i + 1] = min(max(e - before - sd.size, 0), e - c)
    return torch.constant_pad_nd(x, pad, value)


@register_kernel("pad")
def pad_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Padding along each split dim from the rows it copies (reflected, repeated or shifted),
    sent by their holders; then the op along the other dims."""
    args = schema_args(func, args, kwargs)
    x, x_spec, pad = args[0], in_specs[0], list(args[1])
    pairs = _pairs(pad, x_spec.ndim)
    splits = split_dims(x_spec, out_specs[0], coord, sorted(pairs))
    if func._schema.name == "aten::constant_pad_nd":
        return _constant_pad(x, splits, pairs, pad, args[2] or 0)
    mode = "reflect" if "reflection" in func._schema.name else "replicate"
    for sd in splits:
        x = map_rows(x, sd, padding_map(mode, sd.size, *pairs[sd.dim]))
        i = 2 * (x_spec.ndim - 1 - sd.dim)
        pad[i] = pad[i + 1] = 0
    if not x.numel():  # no rows here (the op refuses empty pieces)
        return x.new_zeros(out_specs[0].local_shape(coord))
    return func(x, pad) if any(pad) else x


@register_kernel("pad_backward")
def pad_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op's backward along the dims not split, then each split dim's copies backwards."""
    args = schema_args(func, args, kwargs)
    g, x, x_spec, pad = args[0], args[1], in_specs[1], list(args[2])
    pairs = _pairs(pad, x_spec.ndim)
    splits = split_dims(x_spec, in_specs[0], coord, sorted(pairs))
    mode = "reflect" if "reflection" in func._schema.name else "replicate"
    for sd in splits:
        i = 2 * (x_spec.ndim - 1 - sd.dim)
        pad[i] = pad[i + 1] = 0
    if any(pad):  # `self` gives the shape only: the rows this rank's output rows come from
        split = {sd.dim for sd in splits}
        shape = [g.shape[d] if d in split else x.shape[d] for d in range(x.dim())]
        g = func(g, x.new_empty(shape), pad) if g.numel() else g.new_zeros(shape)
    for sd in reversed(splits):
        g = map_rows_backward(g, sd, padding_map(mode, sd.size, *pairs[sd.dim]))
    return g


@register([aten.channel_shuffle, aten.native_channel_shuffle])
def channel_shuffle_rule(call: OpCall) -> list[OpStrategy]:
    """(N, C, *): channels are permuted (whole), every other dim shards."""
    x = call.inputs[0].shape
    strategies = [OpStrategy((Shard(d),), (Shard(d),)) for d in range(len(x)) if d != 1 and x[d] != 1]
    return strategies + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


# -- grid_sample -----------------------------------------------------------------------------------
@register([aten.grid_sampler_2d, aten.grid_sampler_3d])
def grid_sampler_rule(call: OpCall) -> list[OpStrategy]:
    """input (N, C, *space), grid (N, *out_space, k) -> (N, C, *out_space), einsum-like
    "nc..,nO..->ncO..": batch on both, channels on the input, output positions on the grid;
    linear in the input."""
    x, grid = call.inputs[0].shape, call.inputs[1].shape
    strategies = [OpStrategy((Shard(0),), (Shard(0),) * 2)] if x[0] != 1 else []
    if x[1] != 1:
        strategies.append(OpStrategy((Shard(1),), (Shard(1), Replicate())))
    strategies += [OpStrategy((Shard(d + 1),), (Replicate(), Shard(d)))
                   for d in range(1, len(grid) - 1) if grid[d] != 1]
    return strategies + [OpStrategy((p,), (p, Replicate())) for p in LINEAR_PARTIALS]


@register([aten.grid_sampler_2d_backward, aten.grid_sampler_3d_backward])
def grid_sampler_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_output, input, grid) -> (grad_input?, grad_grid): each forward letter backwards (the
    grid's gradient sums over channels, the input's over output positions)."""
    x, grid = call.inputs[1].shape, call.inputs[2].shape
    with_input = len(call.outputs) == 2
    outs = lambda gi, gg: (gi, gg) if with_input else (gg,)  # noqa: E731
    strategies = [OpStrategy(outs(Shard(0), Shard(0)), (Shard(0),) * 3)] if x[0] != 1 else []
    if x[1] != 1:
        strategies.append(OpStrategy(outs(Shard(1), Partial()), (Shard(1), Shard(1), Replicate())))
    strategies += [OpStrategy(outs(Partial(), Shard(d)), (Shard(d + 1), Replicate(), Shard(d)))
                   for d in range(1, len(grid) - 1) if grid[d] != 1]
    return strategies + [OpStrategy(outs(p, p), (p, Replicate(), Replicate())) for p in LINEAR_PARTIALS]
