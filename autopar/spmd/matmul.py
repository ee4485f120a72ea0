"""Matrix products: mm, bmm, addmm, baddbmm, addbmm, dot/vdot/mv/addmv, addr, bilinear's
_trilinear and cdist, with their einsum letters; the scaled (fp8) product _scaled_mm and the
grouped product of mixture-of-experts layers, _grouped_mm.

`linear`/`matmul` are composite in aten and reach the dispatcher as view + mm/addmm.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .einsum import einsum_strategies
from .registry import META_OUTPUTS, register
from .strategy import OpCall, OpStrategy

aten = torch.ops.aten


@register(aten.mm)
def mm_rule(call: OpCall) -> list[OpStrategy]:
    return einsum_strategies("mk,kn->mn", linear_in=(0, 1))


@register(aten.bmm)
def bmm_rule(call: OpCall) -> list[OpStrategy]:
    return einsum_strategies("bmk,bkn->bmn", linear_in=(0, 1))


@register(aten.mv)
def mv_rule(call: OpCall) -> list[OpStrategy]:
    return einsum_strategies("mk,k->m", linear_in=(0, 1))


@register([aten.dot, aten.vdot])
def dot_rule(call: OpCall) -> list[OpStrategy]:
    return einsum_strategies("k,k->", linear_in=(0, 1))


def _letters(n: int, skip: str = "") -> str:
    return "".join(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in skip)[:n]


@register(aten._trilinear)
def trilinear_rule(call: OpCall) -> list[OpStrategy]:
    """i1, i2, i3 each lack the positions in their expand list; the output lacks `sumdim`:
    one einsum over the positions, linear in each operand."""
    expands = [set(call.arg(3 + k, f"expand{k + 1}")) for k in range(3)]
    n = len(call.inputs[0].shape) + len(expands[0])
    pos = _letters(n)
    operands = ["".join(c for j, c in enumerate(pos) if j not in e) for e in expands]
    summed = set(call.arg(6, "sumdim"))
    out = "".join(c for j, c in enumerate(pos) if j not in summed)
    sizes = {(i, c): m.shape[op.index(c)] for i, (op, m) in enumerate(zip(operands, call.inputs)) for c in op}
    return einsum_strategies(f"{','.join(operands)}->{out}", linear_in=(0, 1, 2), sizes=sizes)


def _batched_letters(call: OpCall, tails: list[str], out_tail: str) -> tuple[str, dict]:
    """An equation whose operands share broadcast batch dims before their `tails`."""
    nb = len(call.outputs[0].shape) - len(out_tail)
    batch = _letters(nb, skip="kmn")
    operands = [batch[nb - (len(m.shape) - len(t)):] + t for m, t in zip(call.inputs, tails)]
    sizes = {(i, c): m.shape[op.index(c)] for i, (op, m) in enumerate(zip(operands, call.inputs)) for c in op}
    return f"{','.join(operands)}->{batch + out_tail}", sizes


@register(aten._cdist_forward)
def cdist_rule(call: OpCall) -> list[OpStrategy]:
    """Distances between rows of x1 (m) and rows of x2 (n): batch, m and n shard; the features
    (k) are no sum of per-rank terms for a p-norm, they stay whole."""
    eq, sizes = _batched_letters(call, ["mk", "nk"], "mn")
    return [s for s in einsum_strategies(eq, sizes=sizes) if type(s.outputs[0]) is Shard]


@register(aten._cdist_backward)
def cdist_backward_rule(call: OpCall) -> list[OpStrategy]:
    """grad_x1[m, k] sums over n a term of feature k alone given the distances: n split gives
    Partial(sum) terms, k split its own features; linear in grad."""
    eq, sizes = _batched_letters(call, ["mn", "mk", "nk", "mn"], "mk")
    return einsum_strategies(eq, linear_in=(0,), sizes=sizes)


def _with_bias(core: list[OpStrategy], bias_shape: tuple, out_ndim: int) -> list[OpStrategy]:
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
        out.append(OpStrategy(s.outputs, (b,) + s.inputs))
    return out


@register(aten.addmm)
def addmm_rule(call: OpCall) -> list[OpStrategy]:
    core = einsum_strategies("mk,kn->mn", linear_in=(0, 1))
    return _with_bias(core, call.inputs[0].shape, 2)


@register(aten.baddbmm)
def baddbmm_rule(call: OpCall) -> list[OpStrategy]:
    core = einsum_strategies("bmk,bkn->bmn", linear_in=(0, 1))
    return _with_bias(core, call.inputs[0].shape, 3)


@register(aten.addbmm)
def addbmm_rule(call: OpCall) -> list[OpStrategy]:
    """The products of the batch summed into one matrix."""
    return _with_bias(einsum_strategies("bmk,bkn->mn", linear_in=(0, 1)), call.inputs[0].shape, 2)


@register(aten.addmv)
def addmv_rule(call: OpCall) -> list[OpStrategy]:
    return _with_bias(einsum_strategies("mk,k->m", linear_in=(0, 1)), call.inputs[0].shape, 1)


@register(aten.addr)
def addr_rule(call: OpCall) -> list[OpStrategy]:
    """self + the outer product of vec1 and vec2."""
    return _with_bias(einsum_strategies("m,n->mn", linear_in=(0, 1)), call.inputs[0].shape, 2)


def _trailing(strategies: list[OpStrategy], extra: tuple) -> list[OpStrategy]:
    """`strategies` with inputs appended, each placed by `extra[i](strategy)`."""
    return [OpStrategy(st.outputs, st.inputs + tuple(f(st) for f in extra)) for st in strategies]


@register(aten._scaled_mm)
def scaled_mm_rule(call: OpCall) -> list[OpStrategy]:
    """out = scale_a * scale_b * (a @ b) (+ bias), a (m, k), b (k, n) in fp8.  A scale is one
    number (whole) or one per row of a, (m, 1), and per column of b, (1, n), which split with
    their rows and columns; the bias (n) splits with n.  k splits into Partial sums only
    with per-tensor or per-row scales (each term is scaled alike), no bias (added once) and
    no scale_result (an fp8 output saturates before any sum)."""
    a, b, scale_a, scale_b = call.inputs[:4]
    m, n = a.shape[0], b.shape[1]
    bias = call.arg(4, "bias")
    scale_result = call.arg(5, "scale_result")
    row_a, col_b = tuple(scale_a.shape) == (m, 1), tuple(scale_b.shape) == (1, n)
    whole_a = all(d == 1 for d in scale_a.shape)
    whole_b = all(d == 1 for d in scale_b.shape)
    strategies = []
    if row_a or whole_a:
        strategies.append(OpStrategy((Shard(0),), (Shard(0), Replicate(), Shard(0) if row_a and m != 1 else Replicate(),
                                                   Replicate())))
    if col_b or whole_b:
        strategies.append(OpStrategy((Shard(1),), (Replicate(), Shard(1), Replicate(),
                                                   Shard(1) if col_b and n != 1 else Replicate())))
    if bias is None and scale_result is None and (row_a or whole_a) and (col_b or whole_b):
        strategies.append(OpStrategy((Partial(),), (Shard(1), Shard(0), Replicate(), Replicate())))
    extra = ()
    if bias is not None:
        extra += (lambda st: Shard(0) if st.outputs[0] == Shard(1) else Replicate(),)
    if scale_result is not None:
        extra += (lambda st: Replicate(),)
    return _trailing(strategies, extra)


@register(aten._grouped_mm)
def grouped_mm_rule(call: OpCall) -> list[OpStrategy]:
    """The products of several groups (experts) at once.  With `offs` the groups are runs of
    rows (a 2-D `self` against a 3-D stack of weights, g k n: the tokens routed to each
    expert) or of the contracted dim (two 2-D operands, out g m n: the weights' gradient);
    a run's bounds are global positions, so the dim they cut stays whole and the others
    split; without `offs` it is a batched product, "gmk,gkn->gmn".  The bias (g, n) follows
    n."""
    a, b = call.inputs[0], call.inputs[1]
    grouped = call.arg(2, "offs") is not None
    bias = call.arg(3, "bias") is not None
    linear = () if bias else (0, 1)
    if not grouped:
        eq = {(3, 3): "gmk,gkn->gmn", (2, 3): "mk,gkn->gmn", (3, 2): "gmk,kn->gmn"}.get((len(a.shape), len(b.shape)))
        strategies = einsum_strategies(eq, linear_in=linear) if eq else []
    elif (len(a.shape), len(b.shape)) == (2, 3):  # token runs: rows t stay whole
        strategies = [st for st in einsum_strategies("tk,gkn->tn", linear_in=linear)
                      if st.inputs[0] != Shard(0) and st.inputs[1] != Shard(0)]
    elif (len(a.shape), len(b.shape)) == (2, 2):  # runs of the contracted dim: k stays whole
        strategies = [st for st in einsum_strategies("mk,kn->gmn", linear_in=linear)
                      if st.inputs[0] != Shard(1) and st.inputs[1] != Shard(0)]
    else:
        strategies = []
    if bias:
        strategies = [st for st in strategies if type(st.outputs[0]) is Shard]
    n_dim = len(call.outputs[0].shape) - 1
    extra = (lambda st: Replicate(),) if grouped else ()
    if bias:
        extra += (lambda st: Shard(1) if st.outputs[0] == Shard(n_dim) else
                  Shard(0) if st.outputs[0] == Shard(0) and len(call.outputs[0].shape) == 3 else Replicate(),)
    return _trailing(strategies, extra)


def _grouped_mm_meta(a, b, offs=None, bias=None, out_dtype=None):
    """_grouped_mm's meta kernel takes bf16 only; its CPU kernel also takes fp32 (HF's experts
    call it so): the shapes from the meta kernel at bf16, the dtype the kernel gives."""
    bf = torch.bfloat16
    out = torch.ops.aten._grouped_mm.default(a.to(bf), b.to(bf), offs, None if bias is None else bias.to(bf))
    return out.to(out_dtype or a.dtype)


META_OUTPUTS[aten._grouped_mm.default] = _grouped_mm_meta
