"""Shared facts of ops over images laid out (leading dims..., *spatial): conv, pooling, resampling.

The leading dims (batch, channels) of such ops are independent of each other, so they shard
freely.  A spatial dim is local only where the op maps each input position to its own output
positions (a 1x1 convolution, non-overlapping pooling, nearest upsampling by a whole factor);
anywhere else a piece needs its neighbours' border rows (a halo), which autopar does not
exchange: the `needs_halo` strategy keeps such an input where it is and its kernel refuses
with an error naming the op, the dim and the placement, instead of silently gathering the
whole image on every rank.
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .registry import register_kernel
from .strategy import OpCall, Strategy

_SUM_AVG = (Partial("sum"), Partial("avg"))


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


def halo_refusals(call: OpCall, dims) -> list[Strategy]:
    """For each spatial dim in `dims` of input 0 (the image): keep a piece sharded there in place
    and refuse it at run time (the other operands are left as they are)."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    return [
        Strategy((Replicate(),) * n_out, (Shard(d),) + (None,) * (n_in - 1), kernel="needs_halo")
        for d in dims
        if call.inputs[0].shape[d] != 1
    ]


@register_kernel("needs_halo")
def needs_halo_kernel(func, args, kwargs, in_specs, out_specs, coord):
    spec = in_specs[0]
    raise ValueError(
        f"autopar: {func} needs a halo exchange for its input of shape {list(spec.shape)} placed "
        f"{list(spec.placements)} on {spec.mesh} (a spatial dim is split), and autopar does not exchange "
        f"halos: shard the batch (Shard(0)) or the channels instead, or reshard the input to Replicate "
        f"on that mesh dim before this op"
    )


def leading_strategies(call: OpCall, n_spatial: int, linear: bool = False, at: int = 0) -> list[Strategy]:
    """Every leading dim d of input `at` shards alike on every tensor operand and output (an op
    whose operands all share the image's leading dims: grad_output, self, indices); a linear
    op also passes Partial(sum/avg) through its first operand with the others whole."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    strategies = [Strategy((Shard(d),) * n_out, (Shard(d),) * n_in)
                  for d in leading_dims(call.inputs[at].shape, n_spatial)]
    if linear:
        strategies += [Strategy((p,) * n_out, (p,) + (Replicate(),) * (n_in - 1)) for p in _SUM_AVG]
    return strategies
