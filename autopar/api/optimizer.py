"""shard_optimizer and the ZeRO stages 1/2/3 over one mesh dim.

The returned optimizer is the torch optimizer itself, stepping the user's Parameters (so
`opt.state[p]`, `state_dict()` and `load_state_dict()` are torch's); `runtime/zero/` runs it:
gradients reduced in buckets to where each parameter is stepped, the step on local pieces,
ZeRO-1/2's sharded steps and ZeRO-3's per-layer gathers (`runtime/zero/sharding.py` says how).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..mesh import ProcessMesh
from ..runtime.precision import MixedPrecisionPolicy
from ..runtime.zero import sharding
from .layer import convert_in_place, models


class ShardingStage:
    """Shard optimizer state (and more, by stage) over mesh dim `sharding_mesh_dim`.

    `mesh` is needed only for plain (non-distributed) parameters, which are treated as
    Replicate on it (stage 3 converts them in place).  Pass an instance as `shard_fn` of
    `shard_optimizer`.
    """

    stage = 0

    def __init__(self, sharding_mesh_dim: int | str, mesh: Optional[ProcessMesh] = None):
        self.sharding_mesh_dim = sharding_mesh_dim
        self.mesh = mesh

    def __call__(self, key: str, param: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        return accumulator  # states follow the sharded parameter they are created from

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sharding_mesh_dim!r})"


class ShardingStage1(ShardingStage):
    """ZeRO-1: optimizer states sharded.

    >>> import autopar as dist
    >>> dist.ShardingStage1("dp").stage
    1
    """

    stage = 1


class ShardingStage2(ShardingStage):
    """ZeRO-2: optimizer states and gradients sharded (gradients reduce-scattered in every backward)."""

    stage = 2


class ShardingStage3(ShardingStage):
    """ZeRO-3: optimizer states, gradients and parameters sharded."""

    stage = 3


# by stage number: dp_config's sharding_level and Strategy.sharding.stage
SHARDING_STAGES = {cls.stage: cls for cls in (ShardingStage1, ShardingStage2, ShardingStage3)}


def shard_optimizer(optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable] = None,
                    mp_policy: Optional[MixedPrecisionPolicy] = None) -> torch.optim.Optimizer:
    """Make `optimizer` work over distributed parameters; with a ShardingStage, apply ZeRO.

    Returns the same torch optimizer (step, zero_grad, param_groups, state, state_dict all
    as usual, keyed by the model's Parameters).  Optimizer states are distributed tensors
    placed like the piece of their parameter each rank steps (its shard under ZeRO); states
    loaded or made for other placements are moved there.  `mp_policy` (a
    `MixedPrecisionPolicy`) trains in low precision with float32 master weights: ZeRO-3
    gathers and computes in its `param_dtype`, lower levels hold the parameters in it (Paddle's
    O2); gradients are reduced in its `reduce_dtype` (docs/mixed_precision.md).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> w = dist.shard_tensor(torch.nn.Parameter(torch.ones(4, 2)), mesh, [dist.Replicate()])
    >>> opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1), dist.ShardingStage1("dp"))
    >>> w.sum().backward(); opt.step()
    >>> opt.state[w]["exp_avg"].placements   # keyed by the Parameter; its shard over "dp"
    [Shard(0)]
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_autopar_sharding", None) is not None:
        raise ValueError("shard_optimizer was already applied to this optimizer")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"shard_optimizer(mp_policy=...) needs an autopar.MixedPrecisionPolicy, got {mp_policy!r}")
    sharding.shard(optimizer, shard_fn, models(), convert_in_place, mp_policy)
    return optimizer
