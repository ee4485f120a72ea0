"""Layer norm, RMS norm and group norm: statistics per row (per sample and group), so the rows shard.

Layer and RMS norm normalize over the trailing dims and shard the leading (batch, sequence) dims.

The statistics are per row, so a row-sharded input needs no communication; weight and bias stay
Replicate and their gradients come out Partial(sum) (each rank holds its rows' share of the sum).
Normalized dims must be whole.  The backward is linear in grad_out, so a Partial grad_out passes
through to every gradient.  On CPU F.rms_norm is composite (pow, mean, rsqrt, mul: their own
rules, which also handle a sharded hidden dim); on GPU it reaches _fused_rms_norm.
Group norm's statistics are per (sample, group): a split batch, or whole groups of channels, is
local (the local op gets the piece's N, C and group count).  Instance norm reaches batch norm
through a (1, N*C, ...) view: a split batch is a split of those channels, local there too.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import register
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten



def _row_dims(x_shape: tuple, normalized_shape) -> list[int]:
    """Leading dims worth sharding (not normalized, not of size 1)."""
    return [d for d in range(len(x_shape) - len(normalized_shape)) if x_shape[d] != 1]


@register([aten.native_layer_norm.default, aten._fused_rms_norm.default])
def norm_forward_rule(call: OpCall) -> list[OpStrategy]:
    """(x, weight?, bias?) -> (out, mean?, rstd): all row-shaped, all sharded alike."""
    params = (Replicate(),) * (len(call.inputs) - 1)
    return [
        OpStrategy((Shard(d),) * len(call.outputs), (Shard(d),) + params)
        for d in _row_dims(call.inputs[0].shape, call.arg(1, "normalized_shape"))
    ]


# backward op -> (number of leading row-shaped inputs, position of output_mask)
_BACKWARD = {
    aten.native_layer_norm_backward.default: (4, 7),  # grad_out, input, mean, rstd | weight?, bias?
    aten._fused_rms_norm_backward.default: (3, 5),  # grad_out, input, rstd | weight?
}


@register(list(_BACKWARD))
def norm_backward_rule(call: OpCall) -> list[OpStrategy]:
    """Rows sharded: grad_input sharded, parameter grads Partial(sum).  Partial grad_out: all Partial."""
    n_rows, mask_at = _BACKWARD[call.func]
    grads = [i for i, wanted in enumerate(call.arg(mask_at, "output_mask")) if wanted]
    n_params = len(call.inputs) - n_rows
    strategies = [
        OpStrategy(tuple(Shard(d) if i == 0 else Partial() for i in grads),
                   (Shard(d),) * n_rows + (Replicate(),) * n_params)
        for d in _row_dims(call.inputs[1].shape, call.arg(2, "normalized_shape"))
    ]
    rest = (Replicate(),) * (len(call.inputs) - 1)
    return strategies + [OpStrategy((p,) * len(grads), (p,) + rest) for p in LINEAR_PARTIALS]


# -- group norm (and instance norm, which reaches batch norm through a (1, N*C, ...) view) ----------
def _group_norm_local_args(args, kwargs, out_shapes):
    """N, C and group of the local piece: (out: (N, C, ...), mean: (N, group))."""
    args = list(args)
    args[3], args[4], args[6] = out_shapes[0][0], out_shapes[0][1], out_shapes[1][1]
    return args, kwargs


def _group_norm_backward_local_args(args, kwargs, out_shapes):
    """(grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask): N, C, group from the pieces."""
    args = list(args)
    args[5], args[6], args[8] = args[0].shape[0], args[0].shape[1], args[2].shape[1]
    return args, kwargs


@register(aten.native_group_norm.default, local_args=_group_norm_local_args)
def group_norm_rule(call: OpCall) -> list[OpStrategy]:
    """(x, weight?, bias?) -> (out, mean, rstd): statistics per (sample, group), so a split batch or
    whole groups of channels (even pieces: mean's group dim) are local."""
    n_params = len(call.inputs) - 1
    x = call.inputs[0].shape
    strategies = []
    if x[0] != 1:
        strategies.append(OpStrategy((Shard(0),) * 3, (Shard(0),) + (Replicate(),) * n_params))
    if call.outputs[1].shape[1] != 1:
        strategies.append(OpStrategy((Shard(1),) * 3, (Shard(1),) + (Shard(0),) * n_params, even=((0, 1), (-2, 1))))
    return strategies


@register(aten.native_group_norm_backward.default, local_args=_group_norm_backward_local_args)
def group_norm_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(grad_out, x, mean, rstd, weight?) -> masked (grad_input, grad_weight, grad_bias)."""
    grads = [i for i, wanted in enumerate(call.arg(9, "output_mask")) if wanted]
    has_weight = len(call.inputs) == 5
    strategies = []
    if call.inputs[1].shape[0] != 1:
        strategies.append(OpStrategy(tuple(Shard(0) if i == 0 else Partial() for i in grads),
                                     (Shard(0),) * 4 + (Replicate(),) * has_weight))
    if call.inputs[2].shape[1] != 1:
        strategies.append(OpStrategy(tuple(Shard(1) if i == 0 else Shard(0) for i in grads),
                                     (Shard(1),) * 4 + (Shard(0),) * has_weight, even=((1, 1), (2, 1))))
    rest = (Replicate(),) * (len(call.inputs) - 1)
    return strategies + [OpStrategy((p,) * len(grads), (p,) + rest) for p in LINEAR_PARTIALS]
