"""Elementwise ops with broadcasting: shard any output dim on the operands that have it.

Linear ops also pass Partial values through (Paddle's auto-parallel rule: a non-linear op
turns a Partial input into Replicate, a linear one keeps it Partial):
  identity-like (clone, detach, dtype casts): every Partial kind;
  additive (add, sub, neg, where on its values): Partial sum/avg on all value operands;
  multiplicative (mul, div by a replicated factor; deg2rad, conj): Partial sum/avg on one operand.
Some are pointwise along every dim but one (glu, cross): that dim stays whole.
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from .registry import register
from .strategy import AFFINE_PARTIALS, ALL_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten



def shard_strategies(call: OpCall, n_out: int | None = None) -> list[OpStrategy]:
    """Shard output dim d on every input whose aligned dim has the same (non-broadcast) size."""
    out_shape = call.outputs[0].shape
    n_out = len(call.outputs) if n_out is None else n_out
    strategies = []
    for d in range(len(out_shape)):
        ins = []
        for meta in call.inputs:
            offset = len(out_shape) - len(meta.shape)
            dd = d - offset
            if dd >= 0 and meta.shape[dd] == out_shape[d] and out_shape[d] != 1:
                ins.append(Shard(dd))
            else:
                ins.append(Replicate())
        if any(type(p) is Shard for p in ins):
            strategies.append(OpStrategy((Shard(d),) * n_out, tuple(ins)))
    return strategies


def _partial(call: OpCall, kinds, which) -> list[OpStrategy]:
    """Partial strategies: operands in `which` Partial, the rest Replicate."""
    n = len(call.inputs)
    return [
        OpStrategy((p,) * len(call.outputs), tuple(p if i in which else Replicate() for i in range(n)))
        for p in kinds
    ]


UNARY = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "exp2", "expm1", "floor",
    "frac", "gelu", "hardsigmoid", "hardswish", "hardtanh", "isfinite", "isinf", "isnan", "leaky_relu",
    "log", "log10", "log1p", "log2", "logical_not", "logit", "mish", "nan_to_num", "reciprocal", "relu",
    "round", "rsqrt", "sigmoid", "sign", "silu", "sin", "sinh", "sqrt", "square", "tan", "tanh", "trunc",
    "elu", "softplus", "bitwise_not", "clamp", "fill", "sgn", "signbit",
    "relu6", "celu", "selu", "xlogy", "acosh", "asinh", "atanh", "angle", "digamma", "erfinv", "i0", "lgamma",
    "sinc", "isneginf", "isposinf", "hardshrink", "softshrink", "mvlgamma", "polygamma", "frexp", "threshold",
    "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0", "special_bessel_y1",
    "special_entr", "special_erfcx", "special_i0e", "special_i1", "special_i1e", "special_log_ndtr",
    "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_ndtri", "special_scaled_modified_bessel_k0",
    "special_scaled_modified_bessel_k1", "special_spherical_bessel_j0",
]
BINARY = [
    "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "eq", "ne", "lt", "le", "gt", "ge", "fmod",
    "remainder", "logical_and", "logical_or", "logical_xor", "maximum", "minimum", "fmax", "fmin",
    "floor_divide", "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward",
    "tanh_backward", "hardswish_backward", "hardsigmoid_backward", "leaky_relu_backward", "elu_backward",
    "softplus_backward", "mish_backward", "hardtanh_backward", "masked_fill", "lerp", "addcmul", "addcdiv",
    "copysign", "clamp_min", "clamp_max", "pow", "rsub", "logaddexp", "hypot", "heaviside", "isclose",
    "igamma", "igammac", "logaddexp2", "nextafter", "ldexp", "complex", "polar", "logit_backward",
    "hardshrink_backward", "softshrink_backward", "log_sigmoid_backward", "special_xlog1py", "special_zeta",
    "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_v",
    "special_chebyshev_polynomial_w", "special_hermite_polynomial_h", "special_hermite_polynomial_he",
    "special_laguerre_polynomial_l", "special_legendre_polynomial_p", "special_shifted_chebyshev_polynomial_t",
    "special_shifted_chebyshev_polynomial_u", "special_shifted_chebyshev_polynomial_v",
    "special_shifted_chebyshev_polynomial_w", "_prelu_kernel", "_prelu_kernel_backward",
]
IDENTITY = ["clone", "detach", "alias", "alias_copy", "_to_copy", "lift_fresh", "lift_fresh_copy", "contiguous",
            "_conj", "positive", "zero", "copy"]
ADDITIVE = ["add", "sub", "neg"]
MULTIPLICATIVE = ["mul", "div"]
SCALED = ["deg2rad", "rad2deg", "_conj_physical", "conj_physical"]  # linear in their one operand


def _ops(names):
    found = []
    for name in names:
        for n in (name, name + "_"):
            op = getattr(aten, n, None)
            if op is not None:
                found.append(op)
    return found


@register(_ops(UNARY + BINARY) + [aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar])
def pointwise_rule(call: OpCall) -> list[OpStrategy]:
    return shard_strategies(call)


@register(_ops(IDENTITY))
def identity_rule(call: OpCall) -> list[OpStrategy]:
    return shard_strategies(call) + _partial(call, ALL_PARTIALS, set(range(len(call.inputs))))


@register(_ops(ADDITIVE))
def additive_rule(call: OpCall) -> list[OpStrategy]:
    """Adding a Python number to a Partial(sum) would add it once per rank; Partial(avg)
    stays right (the mean of x_i + c is mean(x) + c)."""
    n = len(call.inputs)
    with_number = call.func._schema.name != "aten::neg" and n < 2
    return shard_strategies(call) + _partial(call, AFFINE_PARTIALS if with_number else LINEAR_PARTIALS, set(range(n)))


@register(_ops(MULTIPLICATIVE + SCALED))
def multiplicative_rule(call: OpCall) -> list[OpStrategy]:
    strategies = shard_strategies(call) + _partial(call, LINEAR_PARTIALS, {0})
    if call.func._schema.name == "aten::mul" and len(call.inputs) == 2:
        strategies += _partial(call, LINEAR_PARTIALS, {1})
    return strategies


@register([aten.log_sigmoid_forward.default])
def log_sigmoid_rule(call: OpCall) -> list[OpStrategy]:
    """(output, buffer): the buffer is shaped like the input on CPU, empty (Replicate) on GPUs."""
    alike = call.outputs[1].shape == call.outputs[0].shape
    return [OpStrategy((s.outputs[0], s.outputs[0] if alike else Replicate()), s.inputs)
            for s in shard_strategies(call, 1)]


@register([aten.glu.default, aten.glu_backward.default, aten.linalg_cross.default])
def along_dim_rule(call: OpCall) -> list[OpStrategy]:
    """Pointwise but along one dim: glu halves it into values and gates (glu_backward: its
    grad_output and self), cross takes 3-vectors along it.  That dim stays whole."""
    nd = len(call.outputs[0].shape)
    at = {aten.glu.default: 1, aten.glu_backward.default: 2}.get(call.func)
    dim = (call.kwargs.get("dim", -1) if at is None else call.arg(at, "dim", -1)) % nd
    return [s for s in shard_strategies(call) if s.outputs[0].dim != dim]


@register([aten.where.self, aten.where.self_out])
def where_rule(call: OpCall) -> list[OpStrategy]:
    """where(cond, a, b) is linear in (a, b) together; the condition stays Replicate."""
    return shard_strategies(call) + _partial(call, LINEAR_PARTIALS, {1, 2})


def _like_local_args(args, kwargs, out_shapes):
    """new_* ops take the global size (and stride); the local op needs this rank's."""
    shape = list(out_shapes[0])
    if len(args) > 1 and isinstance(args[1], (list, tuple)):
        args = [args[0], shape] + list(args[2:])
    elif "size" in kwargs:
        kwargs = {**kwargs, "size": shape}
    if len(args) > 2 and isinstance(args[2], (list, tuple)):  # new_empty_strided: same dim order
        args[2] = _strides_like(args[2], shape)
    return args, kwargs


def _strides_like(global_stride, shape) -> list[int]:
    """Dense strides for `shape` that keep the dim order of `global_stride`."""
    order = sorted(range(len(shape)), key=lambda d: -global_stride[d])
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return stride


# Uninitialised and zero tensors are a valid Partial of every kind (garbage is overwritten,
# zeros reduce to zeros), so new_* can follow a Partial input: AccumulateGrad allocates the
# gradient buffer with new_empty_strided and must not force a reduction.  *_like stay
# Replicate for a Partial input: optimizers fill such buffers in place next to a sharded
# parameter, and a Partial buffer would be "reduced" there for nothing.
_ANY_PARTIAL_OK = {"aten::new_empty", "aten::new_empty_strided", "aten::new_zeros"}


def _follow(call: OpCall) -> list[OpStrategy]:
    nd = len(call.outputs[0].shape)
    strategies = [OpStrategy((Shard(d),), (Shard(d),)) for d in range(nd)]
    if call.func._schema.name in _ANY_PARTIAL_OK:
        strategies += [OpStrategy((p,), (p,)) for p in ALL_PARTIALS]
    return strategies


@register(_ops(["ones_like", "zeros_like", "empty_like", "full_like"]))
def like_rule(call: OpCall) -> list[OpStrategy]:
    """Output has the input's shape and sharding; only the shape is read, never a Partial value."""
    return _follow(call) + [OpStrategy((Replicate(),), (None,))]


@register(_ops(["new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"]), local_args=_like_local_args)
def new_rule(call: OpCall) -> list[OpStrategy]:
    """A fresh tensor of a given size: Replicate, or laid out like an input of the same shape (of
    the same rank: split where the sizes agree, as the backward of rfft pads its gradient)."""
    src, dst = tuple(call.inputs[0].shape), tuple(call.outputs[0].shape)
    if src == dst:
        return _follow(call) + [OpStrategy((Replicate(),), (None,))]
    same = [d for d in range(len(dst)) if len(src) == len(dst) and src[d] == dst[d] != 1]
    return [OpStrategy((Shard(d),), (Shard(d),)) for d in same] + [OpStrategy((Replicate(),), (None,))]


@register([aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor])
def isin_rule(call: OpCall) -> list[OpStrategy]:
    """isin(elements, test_elements) asks of each element whether it is anywhere in
    test_elements: the result follows the elements' shards, test_elements stays whole
    (a scalar `elements` leaves nothing to shard)."""
    if call.func is aten.isin.Scalar_Tensor:
        return []
    rest = (Replicate(),) * (len(call.inputs) - 1)
    return [OpStrategy((Shard(d),), (Shard(d),) + rest) for d, n in enumerate(call.inputs[0].shape) if n != 1]
