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
A spatial dim shards only for a 1x1, stride-1, unpadded kernel along it; other spatial splits
are refused (`spatial.halo_refusals`).
"""
from __future__ import annotations

import torch

from ..placement import Partial, ReduceType, Replicate, Shard
from .einsum import einsum_strategies
from .registry import register
from .spatial import halo_refusals, per_dim, spatial_dims
from .strategy import OpCall, Strategy

aten = torch.ops.aten


class _Conv:
    """The settings of one convolution call, from the forward's or the backward's arguments."""

    def __init__(self, x_shape, w_shape, stride, padding, output_padding, transposed: bool, groups: int):
        self.x_shape, self.w_shape = tuple(x_shape), tuple(w_shape)
        self.n_spatial = len(w_shape) - 2
        self.stride, self.padding = per_dim(stride, self.n_spatial), per_dim(padding, self.n_spatial)
        self.output_padding = per_dim(output_padding, self.n_spatial)
        self.transposed, self.groups = transposed, groups

    def letter_strategies(self, out_channels: int) -> list[tuple]:
        """(input, weight, bias, output) placements, one tuple per letter or Partial strategy."""
        found = []
        for s in einsum_strategies("ni,io->no" if self.transposed else "ni,oi->no", linear_in=(0, 1)):
            (x, w), out = s.inputs, s.outputs[0]
            if self.groups == 1 or out == Shard(0) or Partial in (type(x), type(w)):  # groups: no channel letter
                found.append((x, w, _bias_for(out), out, ()))
        if self.groups > 1 and self.groups in (self.x_shape[1], out_channels):  # even pieces hold whole groups
            found.append((Shard(1), Shard(0), Shard(0), Shard(1), ((0, 1), (-1, 1))))
        for j, d in enumerate(spatial_dims(self.x_shape, self.n_spatial)):
            if self.pointwise_along(j) and self.x_shape[d] != 1:
                found.append((Shard(d), Replicate(), Replicate(), Shard(d), ()))
        return found

    def pointwise_along(self, j: int) -> bool:
        """Spatial dim j maps each position to itself (1x1 kernel, stride 1, no padding)."""
        return (self.w_shape[2 + j] == 1 and self.stride[j] == 1 and self.padding[j] == 0
                and self.output_padding[j] == 0)

    def halo_dims(self) -> list[int]:
        return [d for j, d in enumerate(spatial_dims(self.x_shape, self.n_spatial)) if not self.pointwise_along(j)]


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


def _conv_of(call: OpCall, backward: bool) -> _Conv:
    a = 1 if backward else 0  # the backward's arguments are the forward's shifted by grad_output
    x, w = call.inputs[a], call.inputs[a + 1]
    return _Conv(x.shape, w.shape, call.arg(a + 3, "stride"), call.arg(a + 4, "padding"),
                 call.arg(a + 7, "output_padding"), call.arg(a + 6, "transposed"), call.arg(a + 8, "groups"))


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
def convolution_rule(call: OpCall) -> list[Strategy]:
    conv = _conv_of(call, backward=False)
    has_bias = call.arg(2, "bias") is not None
    strategies = [
        Strategy((out,), (x, w, b) if has_bias else (x, w), even=even)
        for x, w, b, out, even in conv.letter_strategies(call.outputs[0].shape[1])
    ]
    return strategies + halo_refusals(call, conv.halo_dims())


@register(aten.convolution_backward, local_args=_backward_local_args)
def convolution_backward_rule(call: OpCall) -> list[Strategy]:
    """Inputs (grad_output, input, weight); outputs the gradients that output_mask asks for."""
    conv = _conv_of(call, backward=True)
    wanted = [i for i, w in enumerate(call.arg(10, "output_mask")) if w]
    strategies = []
    for x, w, b, out, even in conv.letter_strategies(call.inputs[0].shape[1]):
        grads = (_dual(x), _dual(w), _dual(b))
        if None in grads or _dual(out) is None:
            continue  # Partial(avg) operands: no linear adjoint
        # `even` names the forward's output (-1): the backward's grad_output (input 0) has its shape
        even = tuple((0, d) if i == -1 else (i + 1, d) for i, d in even)
        strategies.append(Strategy(tuple(grads[i] for i in wanted), (_dual(out), x, w), even=even))
    rest = (Replicate(), Replicate())
    return strategies + [Strategy((p,) * len(wanted), (p,) + rest) for p in (Partial("sum"), Partial("avg"))]
