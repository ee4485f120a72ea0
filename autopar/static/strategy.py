"""Strategy: the pass settings `to_static` applies to the captured step.

Four sections, each off until `enable` is set (Paddle's names):

- `sharding` (`stage` 1/2/3, `degree`, `mesh_dim`): ZeRO over a mesh dim: `to_static`
  gives the optimizer `shard_optimizer(optimizer, ShardingStage<stage>(mesh_dim))`;
- `gradient_merge` (`k_steps`, `avg`): each call runs one micro-batch (forward, backward);
  gradients add up over `k_steps` calls and the optimizer steps on the k-th, on their mean
  with `avg` (a batch k times as large, in k pieces) or their sum;
- `amp` (`dtype` "bfloat16" or "float16", `level` "O1" or "O2", `init_loss_scaling`,
  `incr_every_n_steps`): O1 captures the forward and the loss under autocast (float32
  parameters, gradients and optimizer states); O2 gives the optimizer
  `MixedPrecisionPolicy(param_dtype=dtype)` (low-precision parameters, float32 master
  weights, see docs/mixed_precision.md).  float16 scales the loss: the captured backward
  starts from the loss times the scale (a program input), and the step runs through a
  `shard_scaler` (dynamic scaling: halved on an inf, doubled every `incr_every_n_steps`
  clean steps);
- `pipeline` (`schedule_mode` "FThenB", "1F1B", "VPP", "ZBH1" or "ZBVPP", `accumulate_steps`,
  `vpp_degree`): a model whose layers live on pipeline stages' meshes runs each train step as
  `accumulate_steps` micro-batches in that schedule's order (the captured step is cut into
  stages at its cross-mesh transfers; see `static/pipeline.py` and docs/pipeline.md).

Sections are set by attribute or from a dict: `Strategy({"gradient_merge": {"enable": True,
"k_steps": 4}})`.  An unknown section or key is an error, not a silent no-op.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..runtime.precision import MixedPrecisionPolicy, amp_level
from ..runtime.scaler import shard_scaler


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
        self.amp = _Section("amp", enable=False, dtype="bfloat16", level="O1", init_loss_scaling=32768.0,
                            incr_every_n_steps=1000)
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

    def _amp(self) -> tuple:
        """(autocast dtype, MixedPrecisionPolicy), each or None."""
        if not self.amp.enable:
            return None, None
        return amp_level(self.amp.level, self.amp.dtype, "Strategy.amp")

    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype the captured forward runs autocast ops in (O1), or None."""
        return self._amp()[0]

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        """The optimizer's mixed-precision policy (O2), or None."""
        return self._amp()[1]

    def loss_scaler(self, device: str) -> Optional[torch.amp.GradScaler]:
        """The GradScaler a float16 step runs through (a `shard_scaler`), or None."""
        if self._amp() == (None, None) or self.amp.dtype != "float16":
            return None
        return shard_scaler(torch.amp.GradScaler(device, init_scale=float(self.amp.init_loss_scaling),
                                                 growth_interval=int(self.amp.incr_every_n_steps)))

    def shard(self, layer: torch.nn.Module, optimizer):
        """`optimizer` under the sharding section's ZeRO stage and amp's O2 policy (unchanged
        when both are off)."""
        from ..api.optimizer import SHARDING_STAGES, shard_optimizer
        from ..tensor.dtensor import DistTensor

        policy = self.mp_policy()
        if not self.sharding.enable:
            if policy is None or optimizer is None:
                return optimizer
            existing = getattr(optimizer, "_autopar_sharding", None)
            if existing is None:
                return shard_optimizer(optimizer, mp_policy=policy)
            if existing.policy != policy:
                raise ValueError(
                    f"Strategy.amp level O2 asks for {policy} but the optimizer was given to shard_optimizer with "
                    f"mp_policy {existing.policy}: pass the plain torch optimizer, or that policy to shard_optimizer"
                )
            return optimizer

        stage = SHARDING_STAGES.get(self.sharding.stage)
        if stage is None:
            raise ValueError(
                f"Strategy.sharding.stage must be one of {list(SHARDING_STAGES)}, got {self.sharding.stage!r}"
            )
        if optimizer is None:
            raise ValueError("Strategy.sharding shards the optimizer: give to_static an optimizer")
        existing = getattr(optimizer, "_autopar_sharding", None)
        if existing is not None:
            if existing.stage == self.sharding.stage and existing.policy == policy:
                return optimizer
            raise ValueError(
                f"Strategy.sharding asks for stage {self.sharding.stage} (mp_policy {policy}) but the optimizer was "
                f"already given to shard_optimizer with stage {existing.stage} (mp_policy {existing.policy}): pass the "
                f"plain torch optimizer instead"
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
        return shard_optimizer(optimizer, stage(dim, mesh), mp_policy=policy)
