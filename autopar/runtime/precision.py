"""Mixed precision for sharded training: which dtype parameters are gathered and computed in,
which dtype gradients are reduced in, and Paddle's amp levels mapped onto it.

`MixedPrecisionPolicy` has FSDP2's names and meaning.  A sharded optimizer given one
(`shard_optimizer(opt, shard_fn, mp_policy=...)`) runs it:

- ZeRO-3: the sharded parameters stay float32 (they are the master weights the optimizer
  steps); each unit casts its shards to `param_dtype` before the all-gather (a bfloat16
  gather moves half the bytes), its layers compute in `param_dtype`, and the gradients are
  cast to `reduce_dtype` before the reduce-scatter and land, cast back, in the float32 `.grad`;
- ZeRO-0/1/2 (Paddle's O2): the model's parameters are held in `param_dtype`; the optimizer
  steps float32 master copies of the pieces each rank steps (its shard under ZeRO-1/2) and
  copies the result back into the low-precision parameters; gradients are reduced in
  `reduce_dtype` and land in the parameters' dtype (torch keeps `.grad` in its parameter's).

Either way the models holding the parameters get their floating-point inputs cast to
`param_dtype` and, with `output_dtype`, their floating-point outputs cast to it.
Paddle's O1 is autocast alone (float32 parameters): `amp_level` tells the two apart.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..spec import DistSpec, TensorMeta
from ..tensor.dtensor import DistTensor, local_piece, new_dist
from .forward_context import forward_within

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of sharded training (FSDP2's names): `param_dtype` for gathered parameters and
    the compute, `reduce_dtype` for the gradient reduction (None: `param_dtype`),
    `output_dtype` for the model's floating-point outputs (None: left as computed).  The
    optimizer steps float32 master weights.  Give it to `shard_optimizer(..., mp_policy=)`.

    >>> import torch, autopar as dist
    >>> policy = dist.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> policy.reduction_dtype
    torch.float32
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field.name} must be a floating-point torch dtype "
                    f"({', '.join(map(str, _FLOATS))}) or None, got {value!r}"
                )

    @property
    def reduction_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in (None: their own)."""
        return self.reduce_dtype or self.param_dtype


def amp_level(level: str, dtype: str, where: str) -> tuple:
    """Paddle's amp `level` and `dtype` as (autocast dtype or None, MixedPrecisionPolicy or
    None): "O0" neither, "O1" autocast with float32 parameters, "O2" the policy (parameters
    in `dtype`, float32 master weights).  `where` names the setting in errors.

    >>> amp_level("O2", "bfloat16", "amp_config")
    (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None))
    """
    if dtype not in AMP_DTYPES:
        raise ValueError(f"{where} dtype must be one of {list(AMP_DTYPES)}, got {dtype!r}")
    if level == "O0":
        return None, None
    if level == "O1":
        return AMP_DTYPES[dtype], None
    if level == "O2":
        return None, MixedPrecisionPolicy(param_dtype=AMP_DTYPES[dtype])
    raise ValueError(f"{where} level must be 'O0', 'O1' (autocast) or 'O2' (low-precision parameters, float32 "
                     f"master weights), got {level!r}")


def spec_in(spec: DistSpec, dtype: torch.dtype) -> DistSpec:
    """`spec` for a tensor of `dtype`."""
    if spec.meta.dtype == dtype:
        return spec
    return DistSpec(spec.mesh, spec.placements, TensorMeta(spec.meta.shape, spec.meta.stride, dtype))


def cast_dist(t: DistTensor, dtype: Optional[torch.dtype]) -> DistTensor:
    """`t` in `dtype`, placed alike (its local piece cast; `t` itself when it already is)."""
    if dtype is None or t.dtype == dtype:
        return t
    return new_dist(t._local.to(dtype), spec_in(t._spec, dtype))


def _cast_floats(value, dtype: torch.dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

    return tree_map(cast, value)


def cast_model_io(model: torch.nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Cast `model`'s floating-point inputs to the policy's `param_dtype` and its outputs to
    its `output_dtype` (FSDP2 does it at the root module), once per model."""
    if getattr(model, "_autopar_mp_policy", None) is not None:
        if model._autopar_mp_policy != policy:
            raise ValueError(f"{type(model).__name__} already runs under {model._autopar_mp_policy}; "
                             f"one model takes one mixed-precision policy, not also {policy}")
        return
    model._autopar_mp_policy = policy
    if policy.param_dtype is not None:
        model.register_forward_pre_hook(
            lambda _m, args, kwargs: _cast_floats((args, kwargs), policy.param_dtype), with_kwargs=True)
    if policy.output_dtype is not None:
        model.register_forward_hook(lambda _m, _args, out: _cast_floats(out, policy.output_dtype))


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run `model`'s forward under `torch.autocast` in `dtype` (Paddle's O1, parameters kept
    float32): what wrapping each call in the context does, for a model handed to
    `parallelize`."""
    device = device_type(model)
    forward_within(model, lambda: torch.autocast(device, dtype=dtype))


def device_type(module: torch.nn.Module) -> str:
    """The device type `module`'s parameters (their local pieces) are on: what autocast and
    loss scaling are set up for ("cpu" without parameters)."""
    return next((local_piece(p).device.type for p in module.parameters()), "cpu")
