"""Strategy: the pass settings `to_static` applies to the captured step.

Four sections, each off until `enable` is set (Paddle's names):

- `sharding` (`stage` 1/2/3, `degree`, `mesh_dim`): ZeRO over a mesh dim: `to_static`
  gives the optimizer `shard_optimizer(optimizer, ShardingStage<stage>(mesh_dim))`;
- `gradient_merge` (`k_steps`, `avg`): each call runs one micro-batch (forward, backward);
  gradients add up over `k_steps` calls and the optimizer steps on the k-th, on their mean
  with `avg` (a batch k times as large, in k pieces) or their sum;
- `amp` (`dtype` "bfloat16", `level` "O1"): the forward and the loss are captured under
  autocast, so the program runs matmuls and other autocast ops in bfloat16 with float32
  parameters, gradients and optimizer states.  float16 would need loss scaling and O2
  low-precision parameters: both are refused, not emulated;
- `pipeline` (`schedule_mode` "FThenB", "1F1B", "VPP" or "ZBH1", `accumulate_steps`,
  `vpp_degree`): a model whose layers live on pipeline stages' meshes runs each train step as
  `accumulate_steps` micro-batches in that schedule's order (the captured step is cut into
  stages at its cross-mesh transfers; see `static/pipeline.py` and docs/pipeline.md).

Sections are set by attribute or from a dict: `Strategy({"gradient_merge": {"enable": True,
"k_steps": 4}})`.  An unknown section or key is an error, not a silent no-op.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class _Section:
    """One pass's settings: a fixed set of keys, validated on assignment."""

    def __init__(self, name: str, **defaults: Any):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", dict(defaults))

    def __getattr__(self, key: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if key in values:
            return values[key]
        raise AttributeError(f"Strategy.{self._name} has no setting {key!r}; it has {sorted(values)}")

    def __setattr__(self, key: str, value: Any) -> None:
        if key not in self._values:
            raise AttributeError(f"Strategy.{self._name} has no setting {key!r}; it has {sorted(self._values)}")
        self._values[key] = value

    def update(self, values: dict) -> None:
        for key, value in values.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class Strategy:
    """Pass settings for `to_static`: `sharding`, `gradient_merge`, `amp`, `pipeline`.

    >>> import autopar as dist
    >>> s = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    >>> s.amp.enable = True
    >>> s.gradient_merge.k_steps, s.amp.dtype, s.sharding.enable
    (2, 'bfloat16', False)
    """

    SECTIONS = ("sharding", "gradient_merge", "amp", "pipeline")

    def __init__(self, config: Optional[dict] = None):
        self.sharding = _Section("sharding", enable=False, stage=1, degree=None, mesh_dim="dp")
        self.gradient_merge = _Section("gradient_merge", enable=False, k_steps=1, avg=True)
        self.amp = _Section("amp", enable=False, dtype="bfloat16", level="O1")
        self.pipeline = _Section("pipeline", enable=False, schedule_mode="1F1B", accumulate_steps=1, vpp_degree=1)
        for name, values in (config or {}).items():
            if name not in self.SECTIONS:
                raise ValueError(f"Strategy has no section {name!r}; it has {list(self.SECTIONS)}")
            getattr(self, name).update(values)

    def __repr__(self) -> str:
        return f"Strategy({self.sharding}, {self.gradient_merge}, {self.amp}, {self.pipeline})"

    # -- what to_static reads ----------------------------------------------------------------
    def merge_steps(self) -> int:
        """Micro-batches per optimizer step (1: gradient merge off)."""
        if not self.gradient_merge.enable:
            return 1
        k = self.gradient_merge.k_steps
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Strategy.gradient_merge.k_steps must be an int >= 1, got {k!r}")
        return k

    def pipeline_settings(self, layer: torch.nn.Module) -> Optional[tuple]:
        """(schedule_mode, accumulate_steps, vpp_degree) of the pipeline the train step runs, or
        None: the pipeline section's when enabled, else what `parallelize`'s pp_config named."""
        if self.pipeline.enable:
            return self.pipeline.schedule_mode, self.pipeline.accumulate_steps, self.pipeline.vpp_degree
        named = getattr(layer, "_autopar_pipeline", {})
        if "schedule_mode" not in named and "accumulate_steps" not in named:
            return None
        return named.get("schedule_mode", "1F1B"), named.get("accumulate_steps", 1), named.get("vpp_degree", 1)

    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype the captured forward runs autocast ops in, or None (amp off)."""
        if not self.amp.enable:
            return None
        if self.amp.level != "O1":
            raise ValueError(
                f"Strategy.amp.level {self.amp.level!r} is not supported: only 'O1' (autocast, float32 parameters)"
            )
        if self.amp.dtype != "bfloat16":
            raise ValueError(
                f"Strategy.amp.dtype {self.amp.dtype!r} is not supported: only 'bfloat16' "
                f"(float16 needs loss scaling, which the static mode does not do)"
            )
        return torch.bfloat16

    def shard(self, layer: torch.nn.Module, optimizer):
        """`optimizer` under the sharding section's ZeRO stage (unchanged when it is off)."""
        if not self.sharding.enable:
            return optimizer
        from ..api.optimizer import SHARDING_STAGES, shard_optimizer
        from ..tensor.dtensor import DistTensor

        stage = SHARDING_STAGES.get(self.sharding.stage)
        if stage is None:
            raise ValueError(
                f"Strategy.sharding.stage must be one of {list(SHARDING_STAGES)}, got {self.sharding.stage!r}"
            )
        if optimizer is None:
            raise ValueError("Strategy.sharding shards the optimizer: give to_static an optimizer")
        existing = getattr(optimizer, "_autopar_sharding", None)
        if existing is not None:
            if existing.stage == self.sharding.stage:
                return optimizer
            raise ValueError(
                f"Strategy.sharding asks for stage {self.sharding.stage} but the optimizer was already given to "
                f"shard_optimizer with stage {existing.stage}: pass the plain torch optimizer instead"
            )
        mesh = next((p._spec.mesh for p in layer.parameters() if type(p) is DistTensor), None)
        if mesh is None:
            raise ValueError("Strategy.sharding needs distributed parameters: shard_layer the model first")
        dim = self.sharding.mesh_dim
        size = mesh.get_dim_size(dim)  # a name or number the mesh lacks raises, naming the mesh
        if self.sharding.degree is not None and self.sharding.degree != size:
            raise ValueError(
                f"Strategy.sharding.degree {self.sharding.degree} does not match mesh dim {dim!r} of size {size} "
                f"in {mesh}"
            )
        return shard_optimizer(optimizer, stage(dim, mesh))
