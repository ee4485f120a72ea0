"""Convolutions (1-D/2-D/3-D, transposed, grouped) and their backward, as einsum letters.

Only three letters of a convolution's operands can split without a halo: the batch `n`, the
input channels `i` and the output channels `o`:
  forward    input "ni...", weight "oi..." (transposed: "io..."), output "no...":
             n: input Shard(0) -> output Shard(0) (weight whole: data parallel, no communication);
             o: weight split on its output channels -> output Shard(1) (the column pattern);
             i: input Shard(1) with the weight split on its input channels -> output Partial(sum)
                (the row pattern: each rank holds one term of the channel sum, nothing is gathered);
             linear in input and in weight: a Partial one (the other whole) gives a Partial output.
  The bias follows the output channels.  A grouped convolution splits only whole groups (input and
  output channels together, the local op running groups/k groups), offered when the groups are the
  input or the output channels (depthwise), so that even channel pieces are whole groups.
  backward   each forward strategy read backwards: grad_output placed as the output's gradient
             and every gradient as the dual of its operand (Shard stays, Replicate -> Partial(sum),
             Partial(sum) -> Replicate), since the local backward computes the local part of the
             global one; and linear in grad_output (Partial passes, operands whole).
A spatial dim split stays split: for a 1x1, stride-1, unpadded kernel along it each piece is
its own; for any other kernel (strided, padded, dilated, grouped, transposed) each rank receives
the rows of its neighbours that its windows read (a halo, `spmd.halo`) and computes its piece of
the output, and its backward sends the gradient of those rows back.
A rank may hold no channels (3 channels over 4 ranks): torch's kernels refuse such pieces or
return the wrong shape, so the channel and halo strategies run the `convolution` kernels, which
give that rank its (zero, or bias-only) term and let it take part in every exchange.
"""
from __future__ import annotations

import torch

from ..placement import Partial, ReduceType, Replicate, Shard
from .einsum import einsum_strategies
from .halo import Window, keep, narrow_back, pad_back, spatially_split, split_dims, widen
from .registry import register, register_kernel
from .spatial import per_dim, schema_args, spatial_dims
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten
_KERNEL = "convolution"


class _Conv:
    """The settings of one convolution call, from the forward's or the backward's arguments."""

    def __init__(self, x_shape, w_shape, stride, padding, dilation, output_padding, transposed: bool, groups: int):
        self.x_shape, self.w_shape = tuple(x_shape), tuple(w_shape)
        self.n_spatial = len(w_shape) - 2
        self.stride, self.padding = per_dim(stride, self.n_spatial), per_dim(padding, self.n_spatial)
        self.dilation = per_dim(dilation, self.n_spatial)
        self.output_padding = per_dim(output_padding, self.n_spatial)
        self.transposed, self.groups = transposed, groups

    def letter_strategies(self, out_channels: int) -> list[tuple]:
        """(input, weight, bias, output, even, kernel) placements, one tuple per letter, Partial or
        halo strategy.  Channel and spatial splits run the `convolution` kernels (empty pieces,
        halos); the batch and Partial ones are the plain op."""
        found = []
        for s in einsum_strategies("ni,io->no" if self.transposed else "ni,oi->no", linear_in=(0, 1)):
            (x, w), out = s.inputs, s.outputs[0]
            if self.groups == 1 or out == Shard(0) or Partial in (type(x), type(w)):  # groups: no channel letter
                channels = type(w) is Shard or x == Shard(1)
                found.append((x, w, _bias_for(out), out, (), _KERNEL if channels else None))
        if self.groups > 1 and self.groups in (self.x_shape[1], out_channels):  # even pieces hold whole groups
            found.append((Shard(1), Shard(0), Shard(0), Shard(1), ((0, 1), (-1, 1)), None))
        for d in spatial_dims(self.x_shape, self.n_spatial):
            if self.x_shape[d] != 1:  # pointwise along d: each piece its own; else a halo
                found.append((Shard(d), Replicate(), Replicate(), Shard(d), (), _KERNEL))
        return found

    def windows(self, splits) -> list[Window]:
        """The window along each split dim."""
        first = len(self.x_shape) - self.n_spatial
        return [Window(self.w_shape[2 + j], self.stride[j], self.padding[j], self.dilation[j], self.transposed)
                for j in (sd.dim - first for sd in splits)]

    def pointwise_along(self, j: int) -> bool:
        """Spatial dim j maps each position to itself (1x1 kernel, stride 1, no padding)."""
        return (self.w_shape[2 + j] == 1 and self.stride[j] == 1 and self.padding[j] == 0
                and self.output_padding[j] == 0)

    def halo_dims(self) -> list[int]:
        return [d for j, d in enumerate(spatial_dims(self.x_shape, self.n_spatial)) if not self.pointwise_along(j)]

    def local_args(self, args, x, at: int, splits) -> list:
        """The op's arguments on a widened input `x` (argument `at`): a transposed window gets
        zero rows instead of output_padding along the split dims (`Window.piece`)."""
        args = list(args)
        args[at] = x
        if self.transposed and splits:
            first = len(self.x_shape) - self.n_spatial
            padding = list(self.output_padding)
            for sd in splits:
                padding[sd.dim - first] = 0
            args[at + 7] = padding
        return args


def _bias_for(out):
    """The bias follows the output channels; into a Partial output it enters as one term."""
    if type(out) is Shard:
        return Shard(0) if out.dim == 1 else Replicate()
    return out


def _dual(p):
    """The placement of the gradient of a value placed `p` (for Partial: only sum has one)."""
    if type(p) is Replicate:
        return Partial()
    if type(p) is Partial:
        return Replicate() if p.reduce_type is ReduceType.SUM else None
    return p


def _conv_of(args, at: int) -> _Conv:
    """The convolution of a call whose input is argument `at` (0 forward; 1 backward, whose
    arguments are the forward's shifted by grad_output); tensors or their metas."""
    x, w = args[at], args[at + 1]
    return _Conv(x.shape, w.shape, *args[at + 3:at + 6], args[at + 7], args[at + 6], args[at + 8])


def _local_groups(x_channels: int, out_channels: int, w_shape, transposed: bool, groups: int) -> int:
    """The groups of the local op: the global count unless whole groups are split."""
    per_group = w_shape[1]  # input channels per group (transposed: output channels per group)
    channels = out_channels if transposed else x_channels
    return channels // per_group if per_group else groups


def _forward_local_args(args, kwargs, out_shapes):
    """(At the dispatch every argument of these schemas arrives positionally.)"""
    args = list(args)
    args[8] = _local_groups(args[0].shape[1], out_shapes[0][1], args[1].shape, args[6], args[8])
    return args, kwargs


def _backward_local_args(args, kwargs, out_shapes):
    args = list(args)
    grad_out, x, w = args[0], args[1], args[2]
    args[9] = _local_groups(x.shape[1], grad_out.shape[1], w.shape, args[7], args[9])
    if args[3] is not None:  # bias_sizes: this rank's output channels
        args[3] = [grad_out.shape[1]]
    return args, kwargs


@register([aten.convolution, aten._convolution], local_args=_forward_local_args)
def convolution_rule(call: OpCall) -> list[OpStrategy]:
    conv = _conv_of(schema_args(call.func, call.args, call.kwargs), 0)
    has_bias = call.arg(2, "bias") is not None
    return [
        OpStrategy((out,), (x, w, b) if has_bias else (x, w), even=even, kernel=kernel)
        for x, w, b, out, even, kernel in conv.letter_strategies(call.outputs[0].shape[1])
    ]


@register(aten.convolution_backward, local_args=_backward_local_args)
def convolution_backward_rule(call: OpCall) -> list[OpStrategy]:
    """Inputs (grad_output, input, weight); outputs the gradients that output_mask asks for."""
    conv = _conv_of(schema_args(call.func, call.args, call.kwargs), 1)
    wanted = [i for i, w in enumerate(call.arg(10, "output_mask")) if w]
    strategies = []
    for x, w, b, out, even, kernel in conv.letter_strategies(call.inputs[0].shape[1]):
        grads = (_dual(x), _dual(w), _dual(b))
        if None in grads or _dual(out) is None:
            continue  # Partial(avg) operands: no linear adjoint
        # `even` names the forward's output (-1): the backward's grad_output (input 0) has its shape
        even = tuple((0, d) if i == -1 else (i + 1, d) for i, d in even)
        strategies.append(OpStrategy(tuple(grads[i] for i in wanted), (_dual(out), x, w), even=even,
                                     kernel=kernel and _KERNEL + "_backward"))
    rest = (Replicate(), Replicate())
    return strategies + [OpStrategy((p,) * len(wanted), (p,) + rest) for p in LINEAR_PARTIALS]


# -- kernels -----------------------------------------------------------------------------------
def _is_plain(func, in_specs, coord) -> bool:
    """No spatial dim split and every piece holds channels: the kernels run the plain op."""
    at = 1 if func._schema.name == "aten::convolution_backward" else 0
    x, w = in_specs[at], in_specs[at + 1]
    return (not spatially_split(x, x.ndim - 2) and all(x.local_shape(coord)[1:2])
            and all(w.local_shape(coord)[:2]))


def _empty(x: torch.Tensor, w: torch.Tensor, out_shape, splits) -> bool:
    """This rank's term has no channel to convolve, or no output element along a dim it does
    not exchange rows of: alike on every member of its halo groups, so none of them sends."""
    halo = {sd.dim for sd in splits}
    return not (x.shape[1] and w.shape[0] and w.shape[1]) or not all(
        n for d, n in enumerate(out_shape) if d not in halo)


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@register_kernel(_KERNEL, plain_when=_is_plain)
def convolution_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op on this rank's input piece widened by its halo, cut to its output piece; a piece
    without channels gives its term: zeros, plus the bias this rank holds."""
    x, w, bias = args[0], args[1], args[2]
    conv = _conv_of(args, 0)
    splits = split_dims(in_specs[0], out_specs[0], coord, conv.halo_dims())
    windows = conv.windows(splits)
    out_shape = out_specs[0].local_shape(coord)
    if _empty(x, w, out_shape, splits):
        out = x.new_zeros(out_shape)
        return out if bias is None or not out.numel() else out + _per_channel(bias, out.dim())
    if not splits:
        return func(*args, **kwargs)
    wide = widen(x, splits, windows)
    if wide is None:
        return x.new_zeros(out_shape)
    return keep(func(*conv.local_args(args, wide, 0, splits), **kwargs), splits, windows)


@register_kernel(_KERNEL + "_backward", plain_when=_is_plain)
def convolution_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The op's backward on the widened piece, with the output gradient padded by zeros to the
    local op's output; the input rows' gradients go back to the ranks that sent them.  The
    input's rows move only when the weight's gradient is asked for (the input gradient reads
    its shape alone)."""
    g, x, w = args[0], args[1], args[2]
    mask = args[10]
    conv = _conv_of(args, 1)
    splits = split_dims(in_specs[1], in_specs[0], coord, conv.halo_dims())
    windows = conv.windows(splits)
    if _empty(x, w, g.shape, splits):
        grads = (x.new_zeros(x.shape), w.new_zeros(w.shape), g.sum([d for d in range(g.dim()) if d != 1]))
        return tuple(t if m else None for t, m in zip(grads, mask))
    if not splits:
        return func(*args, **kwargs)
    wide = widen(x, splits, windows, values=mask[1])
    if wide is None:
        grads = [None, w.new_zeros(w.shape), g.new_zeros(g.shape[1])]
    else:
        largs = conv.local_args(args, wide, 1, splits)
        full = aten.convolution(wide.to("meta"), w.to("meta"), None, *largs[4:10]).shape
        largs[0] = pad_back(g, splits, windows, full)
        grads = list(func(*largs, **kwargs))
    if mask[0]:
        grads[0] = narrow_back(grads[0], x, splits, windows)
    return tuple(t if m else None for t, m in zip(grads, mask))
