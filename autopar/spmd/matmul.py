"""Matrix products: mm, bmm, addmm, baddbmm, dot/mv and their einsum letters.

`linear`/`matmul` are composite in aten and reach the dispatcher as view + mm/addmm.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .einsum import einsum_strategies
from .registry import register
from .strategy import OpCall, Strategy

aten = torch.ops.aten


@register(aten.mm)
def mm_rule(call: OpCall) -> list[Strategy]:
    return einsum_strategies("mk,kn->mn", linear_in=(0, 1))


@register(aten.bmm)
def bmm_rule(call: OpCall) -> list[Strategy]:
    return einsum_strategies("bmk,bkn->bmn", linear_in=(0, 1))


@register(aten.mv)
def mv_rule(call: OpCall) -> list[Strategy]:
    return einsum_strategies("mk,k->m", linear_in=(0, 1))


@register(aten.dot)
def dot_rule(call: OpCall) -> list[Strategy]:
    return einsum_strategies("k,k->", linear_in=(0, 1))


def _with_bias(core: list[Strategy], bias_shape: tuple, out_ndim: int) -> list[Strategy]:
    """bias + product: the bias follows the output (broadcast dims stay Replicate)."""
    out = []
    offset = out_ndim - len(bias_shape)
    for s in core:
        o = s.outputs[0]
        if type(o) is Shard:
            bd = o.dim - offset
            b = Shard(bd) if bd >= 0 and bias_shape[bd] != 1 else Replicate()
        elif type(o) is Partial:
            b = o  # bias joins the partial sum once (Replicate -> Partial keeps it on one rank)
        else:
            b = Replicate()
        out.append(Strategy(s.outputs, (b,) + s.inputs))
    return out


@register(aten.addmm)
def addmm_rule(call: OpCall) -> list[Strategy]:
    core = einsum_strategies("mk,kn->mn", linear_in=(0, 1))
    return _with_bias(core, call.inputs[0].shape, 2)


@register(aten.baddbmm)
def baddbmm_rule(call: OpCall) -> list[Strategy]:
    core = einsum_strategies("bmk,bkn->bmn", linear_in=(0, 1))
    return _with_bias(core, call.inputs[0].shape, 3)
