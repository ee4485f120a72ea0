"""Random ops: the same numbers as the single-process run with the same seed.

A sharded result is drawn by running the op on a stand-in of the FULL global shape and
strides with the current generator (so the generator advances exactly as in the single
process), then keeping this rank's piece.  Every rank of the mesh draws the whole tensor:
the price of matching the single-process stream on any device.  A Replicate result is the
plain op (every rank draws the same full tensor).

Ranks outside an op's mesh draw (and discard) the same full-shape numbers, so every rank's
generator stays on the single-process stream: a pipeline stage that drops out after another
stage did draws the same mask as the single process.

Ops covered:
  in-place fills (uniform_, normal_, bernoulli_ with a float p, random_, exponential_, ...):
    self keeps its placement; a Partial(sum) self gets the value on one rank, zeros elsewhere;
  *_like factories and bernoulli(self, p: float): only self's shape is read; output sharded
    like self (a Partial self gives a Replicate output);
  native_dropout: the mask is drawn on the full shape, output = input * mask * scale, so a
    Partial input stays Partial (the op is linear in the input) with a Replicate mask;
  native_dropout_backward: pointwise, linear in the gradient;
  bernoulli(p: Tensor) and normal(mean/std: Tensor): their draws depend on the values, so
    only all-Replicate (whole inputs on every rank) reproduces them.
"""
from __future__ import annotations

import torch

from ..redistribute import piece_of_full
from ..placement import Replicate, Shard
from .pointwise import shard_strategies
from .registry import DRAWS_RANDOM, register, register_kernel
from .strategy import ALL_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten

FILLS = [
    aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.random_.default,
    aten.random_.to, getattr(aten.random_, "from"), aten.exponential_.default, aten.cauchy_.default,
    aten.log_normal_.default, aten.geometric_.default,
]
LIKE = [
    aten.rand_like.default, aten.rand_like.generator, aten.randn_like.default, aten.randn_like.generator,
    aten.randint_like.default, aten.randint_like.Tensor, aten.randint_like.low_dtype,
    aten.randint_like.generator, aten.randint_like.Tensor_generator, aten.randint_like.low_generator_dtype,
    aten.bernoulli.p,
]
VALUE_DRAWS = [
    aten.bernoulli.default, aten.bernoulli.Tensor, aten.bernoulli_.Tensor, aten.normal.Tensor_float,
    aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
]


DRAWS_RANDOM.update(FILLS + LIKE + VALUE_DRAWS + [aten.native_dropout.default])


def _rest(call: OpCall) -> tuple:
    """Tensor inputs after self (randint_like's high): whole."""
    return (Replicate(),) * (len(call.inputs) - 1)


@register(FILLS)
def fill_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    kinds = [Shard(d) for d in range(nd)] + list(ALL_PARTIALS)
    return [OpStrategy((p,), (p,), kernel="random_full") for p in kinds]


@register(LIKE)
def like_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    return [OpStrategy((Shard(d),), (Shard(d),) + _rest(call), kernel="random_full") for d in range(nd)] + [
        OpStrategy((Replicate(),), (None,) + _rest(call))
    ]


@register(VALUE_DRAWS)
def value_draw_rule(call: OpCall) -> list[OpStrategy]:
    """Only the all-Replicate strategy the engine always offers reproduces these draws."""
    return []


_FILL_SET = frozenset(FILLS)


@register_kernel("random_full")
def random_full(func, args, kwargs, in_specs, out_specs, coord):
    """Run the op on a full-size stand-in for self, keep this rank's piece (for a fill,
    written into self)."""
    meta = in_specs[0].meta
    full = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=args[0].device)
    piece = piece_of_full(func(full, *args[1:], **kwargs), out_specs[0])
    return args[0].copy_(piece) if func in _FILL_SET else piece


@register(aten.native_dropout.default)
def native_dropout_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[0].shape)
    return [OpStrategy((Shard(d), Shard(d)), (Shard(d),), kernel="native_dropout") for d in range(nd)] + [
        OpStrategy((p, Replicate()), (p,), kernel="native_dropout") for p in LINEAR_PARTIALS
    ]


@register_kernel("native_dropout")
def native_dropout_kernel(func, args, kwargs, in_specs, out_specs, coord):
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    if train is False:
        return func(x, p, train)
    meta = in_specs[0].meta
    full = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=x.device).fill_(1)
    mask = piece_of_full(func(full, p, train)[1], out_specs[1])
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask


@register(aten.native_dropout_backward.default)
def native_dropout_backward_rule(call: OpCall) -> list[OpStrategy]:
    """grad * mask * scale: pointwise, and linear in grad (the mask whole)."""
    return shard_strategies(call) + [OpStrategy((p,), (p, Replicate())) for p in LINEAR_PARTIALS]
