"""Shared facts of ops over images laid out (leading dims..., *spatial): conv, pooling, resampling.

The leading dims (batch, channels) of such ops are independent of each other, so they shard
freely.  A spatial dim is local where the op maps each input position to its own output
positions (a 1x1 convolution, non-overlapping pooling, nearest upsampling by a whole factor);
anywhere else a piece needs its neighbours' border rows, which its kernel receives (a halo:
`spmd.halo`), keeping the split.  Where no halo serves (windows that overlap unevenly or span
the whole dim), the `gathered` strategy gathers the input in its kernel, with a warning.
"""
from __future__ import annotations

import warnings

from ..placement import Replicate, Shard
from ..redistribute import redistribute_local
from .registry import register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy



def spatial_dims(shape, n_spatial: int) -> range:
    """The trailing `n_spatial` dims of a tensor of `shape`."""
    return range(len(shape) - n_spatial, len(shape))


def per_dim(v, n: int) -> list[int]:
    """An int-or-list argument (kernel_size=3, stride=[2, 2]) as one value per spatial dim."""
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def leading_dims(shape, n_spatial: int) -> list[int]:
    """The dims before the spatial ones that are worth sharding (not of size 1)."""
    return [d for d in range(len(shape) - n_spatial) if shape[d] != 1]


def schema_args(func, args, kwargs) -> list:
    """The op's arguments by position, its schema's defaults filled in (kernels read them by index)."""
    full = list(args)
    for a in func._schema.arguments[len(full):]:
        full.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return full


def split_alike(call: OpCall, dims, kernel: str, at: int = 0) -> list[OpStrategy]:
    """For each dim in `dims` (of input `at`, not of size 1): every tensor operand and output
    split on it, the local work done by `kernel` (a halo: see `spmd.halo`)."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    return [OpStrategy((Shard(d),) * n_out, (Shard(d),) * n_in, kernel=kernel)
            for d in dims if call.inputs[at].shape[d] != 1]


def gathered(call: OpCall, dims) -> list[OpStrategy]:
    """For each spatial dim in `dims` of input 0 (the image) whose windows no halo serves:
    keep a piece split there in place, and let the kernel gather it (with a warning) and run
    the op whole; the other operands are left as they are."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    return [
        OpStrategy((Replicate(),) * n_out, (Shard(d),) + (None,) * (n_in - 1), kernel="gather_spatial")
        for d in dims
        if call.inputs[0].shape[d] != 1
    ]


@register_kernel("gather_spatial")
def gather_spatial_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The input gathered along the split dims the output is whole on, then the op."""
    spec = in_specs[0]
    whole = spec.with_placements([Replicate() if type(p) is Shard and type(o) is Replicate else p
                                  for p, o in zip(spec.placements, out_specs[0].placements)])
    warnings.warn(  # the engine's words for an op without a rule: a split no rule keeps
        f"autopar: no sharding rule for {func}; its input of shape {list(spec.shape)} placed "
        f"{list(spec.placements)} on {spec.mesh} is gathered: no halo exchange serves its windows along the "
        f"split dim (adaptive pooling whose input size is not a multiple of its output size, antialiased "
        f"interpolation, unfold/fold) (correct, but it communicates)",
        stacklevel=2,
    )
    return func(redistribute_local(args[0], spec, whole), *args[1:], **kwargs)


def leading_strategies(call: OpCall, n_spatial: int, linear: bool = False, at: int = 0) -> list[OpStrategy]:
    """Every leading dim d of input `at` shards alike on every tensor operand and output (an op
    whose operands all share the image's leading dims: grad_output, self, indices); a linear
    op also passes Partial(sum/avg) through its first operand with the others whole."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    strategies = [OpStrategy((Shard(d),) * n_out, (Shard(d),) * n_in)
                  for d in leading_dims(call.inputs[at].shape, n_spatial)]
    if linear:
        strategies += [OpStrategy((p,) * n_out, (p,) + (Replicate(),) * (n_in - 1)) for p in LINEAR_PARTIALS]
    return strategies
