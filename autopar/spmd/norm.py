"""Layer norm and RMS norm: normalize over the trailing dims, shard the leading (batch, sequence) dims.

The statistics are per row, so a row-sharded input needs no communication; weight and bias stay
Replicate and their gradients come out Partial(sum) (each rank holds its rows' share of the sum).
Normalized dims must be whole.  The backward is linear in grad_out, so a Partial grad_out passes
through to every gradient.  On CPU F.rms_norm is composite (pow, mean, rsqrt, mul: their own
rules, which also handle a sharded hidden dim); on GPU it reaches _fused_rms_norm.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import register
from .strategy import OpCall, Strategy

aten = torch.ops.aten

_SUM_AVG = (Partial("sum"), Partial("avg"))


def _row_dims(x_shape: tuple, normalized_shape) -> list[int]:
    """Leading dims worth sharding (not normalized, not of size 1)."""
    return [d for d in range(len(x_shape) - len(normalized_shape)) if x_shape[d] != 1]


@register([aten.native_layer_norm.default, aten._fused_rms_norm.default])
def norm_forward_rule(call: OpCall) -> list[Strategy]:
    """(x, weight?, bias?) -> (out, mean?, rstd): all row-shaped, all sharded alike."""
    params = (Replicate(),) * (len(call.inputs) - 1)
    return [
        Strategy((Shard(d),) * len(call.outputs), (Shard(d),) + params)
        for d in _row_dims(call.inputs[0].shape, call.arg(1, "normalized_shape"))
    ]


# backward op -> (number of leading row-shaped inputs, position of output_mask)
_BACKWARD = {
    aten.native_layer_norm_backward.default: (4, 7),  # grad_out, input, mean, rstd | weight?, bias?
    aten._fused_rms_norm_backward.default: (3, 5),  # grad_out, input, rstd | weight?
}


@register(list(_BACKWARD))
def norm_backward_rule(call: OpCall) -> list[Strategy]:
    """Rows sharded: grad_input sharded, parameter grads Partial(sum).  Partial grad_out: all Partial."""
    n_rows, mask_at = _BACKWARD[call.func]
    grads = [i for i, wanted in enumerate(call.arg(mask_at, "output_mask")) if wanted]
    n_params = len(call.inputs) - n_rows
    strategies = [
        Strategy(tuple(Shard(d) if i == 0 else Partial() for i in grads),
                 (Shard(d),) * n_rows + (Replicate(),) * n_params)
        for d in _row_dims(call.inputs[1].shape, call.arg(2, "normalized_shape"))
    ]
    rest = (Replicate(),) * (len(call.inputs) - 1)
    return strategies + [Strategy((p,) * len(grads), (p,) + rest) for p in _SUM_AVG]
