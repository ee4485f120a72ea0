"""Optimizer ops: the `_foreach_*` list ops and the `_fused_*` optimizer steps.

dispatch.py splits a list op into groups of indices whose tensors have the same mesh,
placements and rank, so a rule sees lists whose entries are placed alike: entry 0 of each
list stands for the whole list (shapes may differ; the strategies are the same).  A foreach op is the per-entry op applied to every entry, so its
strategies are the per-entry pointwise ones (broadcast scalars and 0-dim tensors whole),
repeated over the entries.  Linear ones pass Partial through:
  zero_/copy_/clone: every Partial kind;  neg, mul/div by a whole factor: sum/avg;
  add/sub of lists (or a tensor): sum/avg with every operand Partial; of a scalar: avg only
  (each term would add the scalar once);
  lerp(self, end, w) = (1-w) self + w end and addcmul/addcdiv(self, t1, t2): sum/avg with
  self and the linear operand Partial, the other whole.
Fused optimizer steps (_fused_adam_/adamw_/sgd_/adagrad_, and _fused_adam/adamw, which return
the new lists instead of writing them): every tensor list follows the
param's placement (Shard(d) or Replicate), 0-dim step/lr/scale tensors stay whole.  The
params are updated in place, so the engine keeps their placement; a Partial grad is reduced
to it (reduce-scatter to Shard, all-reduce to Replicate) and, being written by the op,
keeps the reduced placement afterwards.
GradScaler's unscale (_amp_foreach_non_finite_check_and_unscale_): each gradient is unscaled
where it is (Shard(d) or Replicate; a Partial one is reduced first: a term may overflow where
its sum would not) and found_inf, which each rank sets from its own pieces, is the largest
over the ranks holding the other pieces, so that every rank of the mesh skips the same steps.
_amp_update_scale_ works on whole scalars.
"""
from __future__ import annotations

import torch

from .. import comm
from ..placement import ReduceType, Replicate, Shard
from ..spec import TensorMeta
from .pointwise import shard_strategies
from .reduction import shard_group
from .registry import register, register_kernel
from .strategy import AFFINE_PARTIALS, ALL_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten

FOREACH = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
    "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "zero", "clone", "copy", "add", "sub", "mul", "div",
    "clamp_max", "clamp_min", "maximum", "minimum", "pow", "lerp", "addcmul", "addcdiv",
]


def _foreach_ops() -> list:
    ops = []
    for name in FOREACH:
        for n in ("_foreach_" + name, "_foreach_" + name + "_"):
            packet = getattr(aten, n, None)
            if packet is not None:
                ops += [getattr(packet, o) for o in packet.overloads() if not o.endswith("out")]
    return ops


def _roles(call: OpCall) -> tuple[list[int], list[TensorMeta]]:
    """Per flat tensor input, the index of the argument it comes from (a list or one tensor),
    and entry 0 of each such argument."""
    roles, reps = [], []
    for a in list(call.args) + list(call.kwargs.values()):
        if isinstance(a, TensorMeta):
            roles.append(len(reps))
            reps.append(a)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], TensorMeta):
            roles += [len(reps)] * len(a)
            reps.append(a[0])
    return roles, reps


def _partial_options(call: OpCall, n_roles: int) -> list[tuple[tuple, set]]:
    """(Partial kinds, arguments Partial together) valid for this foreach op."""
    base = call.func._schema.name[len("aten::_foreach_"):].rstrip("_")
    overload = call.func._overloadname
    if base in ("zero", "clone", "copy"):
        return [(ALL_PARTIALS, set(range(n_roles)))]
    if base in ("add", "sub"):
        if overload in ("Scalar", "ScalarList"):
            return [(AFFINE_PARTIALS, {0})]
        return [(LINEAR_PARTIALS, set(range(n_roles))), (AFFINE_PARTIALS, {0})]
    if base == "mul":
        return [(LINEAR_PARTIALS, {0})] + ([(LINEAR_PARTIALS, {1})] if n_roles > 1 else [])
    if base in ("neg", "div"):
        return [(LINEAR_PARTIALS, {0})]
    if base in ("lerp", "addcdiv"):
        return [(LINEAR_PARTIALS, {0, 1})]
    if base == "addcmul":
        return [(LINEAR_PARTIALS, {0, 1}), (LINEAR_PARTIALS, {0, 2})]
    return []


@register(_foreach_ops())
def foreach_rule(call: OpCall) -> list[OpStrategy]:
    roles, reps = _roles(call)
    entry = OpCall(call.func, (), {}, reps, [call.outputs[0] if call.outputs else reps[0]])
    per_entry = shard_strategies(entry, n_out=1)
    for kinds, together in _partial_options(call, len(reps)):
        per_entry += [OpStrategy((p,), tuple(p if r in together else Replicate() for r in range(len(reps))))
                      for p in kinds]
    n_out = len(call.outputs)
    return [OpStrategy((s.outputs[0],) * n_out, tuple(s.inputs[r] for r in roles)) for s in per_entry]


@register([aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_, aten._fused_adagrad_])
def fused_rule(call: OpCall) -> list[OpStrategy]:
    roles, reps = _roles(call)
    param = reps[0].shape
    return [
        OpStrategy((Shard(d),) * len(call.outputs), tuple(Shard(d) if reps[r].shape == param else Replicate()
                                                          for r in roles))
        for d in range(len(param))
    ]


# the functional steps (what a captured or compiled optimizer calls) return the new params,
# grads and states, each placed as its input
register([aten._fused_adam, aten._fused_adamw])(fused_rule)


@register(aten._amp_foreach_non_finite_check_and_unscale_)
def amp_unscale_rule(call: OpCall) -> list[OpStrategy]:
    roles, reps = _roles(call)  # the gradients, found_inf, inv_scale
    return [OpStrategy((), tuple(Shard(d) if r == 0 else Replicate() for r in roles), "amp_unscale")
            for d in range(len(reps[0].shape))]


@register_kernel("amp_unscale")
def amp_unscale_kernel(func, args, kwargs, in_specs, out_specs, coord):
    func(*args, **kwargs)
    group = shard_group(in_specs[0], range(len(in_specs[0].meta.shape)), coord)
    if len(group) > 1:  # a non-finite value in any piece skips the step on every rank
        found_inf = args[1]
        found_inf.copy_(comm.all_reduce(found_inf, group, ReduceType.MAX))


@register(aten._amp_update_scale_)
def amp_update_scale_rule(call: OpCall) -> list[OpStrategy]:
    return []  # the scale, its growth tracker and found_inf: whole on every rank
