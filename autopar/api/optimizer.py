"""shard_optimizer and ZeRO stages 1/2/3 over one mesh dim.

The returned optimizer is the torch optimizer itself, with step hooks:
- any stage: a gradient that arrived Partial is reduced once, to its parameter's placements,
  before the update (so an update op never reduces the same gradient twice); without a stage,
  local regions reduce data-parallel gradients during backward already (`grad_reduce.py`).
  Then an elementwise optimizer (Adam, SGD, ...) steps the local pieces as plain tensors
  (`local_step.py`): as fast as on one device;
- stage 1: the optimizer steps a *shard* of each parameter (a view into this rank's slice)
  so its states are sharded over the mesh dim; gradients are reduce-scattered before the
  step and the updated slices all-gathered after it;
- stage 2: as stage 1, but each gradient is reduce-scattered as soon as backward produced
  it, so full gradients never stay alive;
- stage 3: the parameters themselves become sharded over the mesh dim (in place: the model
  and the optimizer keep the same Parameter objects); ops gather them when they need them
  and free them after; gradients are reduce-scattered as they are produced.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..dtensor import DistTensor
from ..grad_reduce import grad_plan, reduce_grads, reduce_in_backward
from ..mesh import ProcessMesh
from ..placement import Replicate, Shard
from ..reshard import redistribute_local
from ..spec import DistSpec, TensorMeta
from .local_step import LocalStep
from .tensor import reshard


class ShardingStage:
    """Shard optimizer state (and more, by stage) over mesh dim `sharding_mesh_dim`.

    `mesh` is needed only for plain (non-distributed) parameters, which are treated as
    Replicate on it.  Pass an instance as `shard_fn` of `shard_optimizer`.
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
    """ZeRO-2: optimizer states and gradients sharded (gradients reduce-scattered in backward)."""

    stage = 2


class ShardingStage3(ShardingStage):
    """ZeRO-3: optimizer states, gradients and parameters sharded."""

    stage = 3


def _param_spec(p: torch.Tensor, fallback_mesh: Optional[ProcessMesh]) -> DistSpec:
    if isinstance(p, DistTensor):
        return p._spec
    if fallback_mesh is None:
        raise ValueError(
            f"a plain parameter of shape {list(p.shape)} cannot be sharded without a mesh: "
            f"give the ShardingStage a mesh or shard_layer the model first"
        )
    return DistSpec(fallback_mesh, [Replicate()] * fallback_mesh.ndim, TensorMeta.contiguous(p.shape, p.dtype))


def sharded_spec(spec: DistSpec, mesh_dim: int) -> Optional[DistSpec]:
    """`spec` with mesh dim `mesh_dim` sharding the first free tensor dim that is big enough."""
    if type(spec.placements[mesh_dim]) is not Replicate:
        return None
    k = spec.mesh.shape[mesh_dim]
    taken = {p.dim for p in spec.placements if type(p) is Shard}
    free = [d for d in range(spec.ndim) if d not in taken and spec.shape[d] >= k]
    if not free:
        return None
    even = [d for d in free if spec.shape[d] % k == 0]
    d = (even or free)[0]
    placements = list(spec.placements)
    placements[mesh_dim] = Shard(d)
    return spec.with_placements(placements)


class _Zero12:
    """Stage 1/2 bookkeeping for one parameter: the shard the optimizer steps."""

    def __init__(self, param: torch.Tensor, spec: DistSpec, shard_spec: DistSpec, rank: int):
        self.param, self.spec = param, spec
        full = param._local if isinstance(param, DistTensor) else param.data
        if rank in spec.mesh:
            coord = spec.mesh.coordinate(rank)
            view = full
            for d, ((a, _), (b0, b1)) in enumerate(zip(spec.local_box(coord), shard_spec.local_box(coord))):
                if b1 - b0 != view.shape[d]:
                    view = view.narrow(d, b0 - a, b1 - b0)
        else:
            view = full.new_empty(0)
        self.shard = torch.nn.Parameter(DistTensor(view, shard_spec), requires_grad=True)

    def take_grad(self) -> None:
        """Move the parameter's gradient onto the shard (reduce-scatter a Partial one)."""
        g = self.param.grad
        if g is None:
            return
        if not isinstance(g, DistTensor):
            g = DistTensor(_cut(g, self.spec), self.spec)
        g = reshard(g.detach(), self.shard._spec.mesh, self.shard._spec.placements)
        self.shard.grad = g if self.shard.grad is None else self.shard.grad + g
        self.param.grad = None

    def publish(self) -> None:
        """All-gather the updated slices back into the full parameter."""
        full = redistribute_local(self.shard._local, self.shard._spec, self.spec)
        with torch.no_grad():
            target = self.param._local if isinstance(self.param, DistTensor) else self.param.data
            if target.numel():
                target.copy_(full)


def _cut(full: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    from .tensor import _piece_of_full

    return _piece_of_full(full, spec)


class _OptimizerSharding:
    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable], dispatch_foreach: tuple = ()):
        from ..comm import get_rank

        self.optimizer = optimizer
        self.shard_fn = shard_fn
        self.stage = getattr(shard_fn, "stage", None)
        self.zero12: list[_Zero12] = []
        self.local_step = LocalStep(optimizer, dispatch_foreach)
        self.states_sharded = False
        rank = get_rank()
        if self.stage is None:  # gradients go to the parameters' placements whole: reduce them in backward
            reduce_in_backward([p for group in optimizer.param_groups for p in group["params"]])
        if self.stage in (1, 2, 3):
            for group in optimizer.param_groups:
                for i, p in enumerate(group["params"]):
                    spec = _param_spec(p, shard_fn.mesh)
                    dim = spec.mesh.dim_index(shard_fn.sharding_mesh_dim)
                    target = sharded_spec(spec, dim)
                    if target is None:
                        continue
                    if self.stage == 3:
                        self._shard_in_place(p, target)
                    else:
                        z = _Zero12(p, spec, target, rank)
                        self.zero12.append(z)
                        group["params"][i] = z.shard
                        if self.stage == 2:
                            p.register_post_accumulate_grad_hook(lambda _p, z=z: z.take_grad())

    @staticmethod
    def _shard_in_place(p: torch.Tensor, target: DistSpec) -> None:
        if not isinstance(p, DistTensor):
            raise ValueError(
                f"ShardingStage3 shards parameters in place and needs distributed parameters; the parameter "
                f"of shape {list(p.shape)} is a plain tensor: shard_layer(model, mesh) first"
            )
        with torch.no_grad():
            p._local = redistribute_local(p._local, p._spec, target)
        p._spec = target

        def reduce_grad(param):
            g = param.grad
            if isinstance(g, DistTensor) and g._spec != param._spec:
                param.grad = reshard(g.detach(), param._spec.mesh, param._spec.placements)

        p.register_post_accumulate_grad_hook(reduce_grad)

    def pre_step(self, optimizer, args, kwargs) -> None:
        self.prepare_grads()
        self.local_step.swap()

    def prepare_grads(self) -> None:
        """Bring every gradient to where the step reads it (ZeRO-1/2: onto the shard;
        Partial ones reduced, data-parallel ones in buckets).  Idempotent: the static mode
        runs it inside the captured program, then the step's own call finds nothing to do."""
        for z in self.zero12:
            z.take_grad()
        pending = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if type(g) is DistTensor and type(p) is DistTensor and g._spec is not p._spec:
                    plan = grad_plan(g._spec, p._spec)
                    if plan[0]:
                        pending.append((p, plan))
        reduce_grads(pending)

    def post_step(self, optimizer, args, kwargs) -> None:
        self.local_step.restore()
        for z in self.zero12:
            z.publish()
        if self.shard_fn is not None and self.stage is None and not self.states_sharded:
            self.states_sharded = True
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            state[key] = self.shard_fn(key, p, value)


def _current(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The Parameter that took p's place in its module, when `shard_layer` or `parallelize`
    replaced p after the optimizer was built (`layer.record_replacement`): stepping the old
    plain tensor would train nothing."""
    while True:
        replaced = getattr(p, "_autopar_replaced_by", None)
        if replaced is None:
            return p
        name, ref = replaced
        new = ref()
        if p in optimizer.state or new is None:
            why = "it already has state for it" if p in optimizer.state else "that parameter no longer exists"
            raise ValueError(
                f"shard_optimizer: parameter '{name}' (shape {list(p.shape)}) of this optimizer was replaced by "
                f"shard_layer with a distributed tensor, and {why}; build the optimizer from model.parameters() "
                f"after shard_layer"
            )
        p = new


def shard_optimizer(optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable] = None) -> torch.optim.Optimizer:
    """Make `optimizer` work over distributed parameters; with a ShardingStage, apply ZeRO.

    Returns the same torch optimizer (step, zero_grad, param_groups, state, state_dict all
    as usual).  Optimizer states are distributed tensors with their parameter's placements.
    An optimizer built before `shard_layer` is pointed at the Parameters that replaced its
    own (as for the optimizer `parallelize` is given), as long as it has not stepped.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> w = dist.shard_tensor(torch.nn.Parameter(torch.ones(4, 2)), mesh, [dist.Replicate()])
    >>> opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1), dist.ShardingStage1("dp"))
    >>> w.sum().backward(); opt.step()
    >>> opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].placements
    [Shard(0)]
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_autopar_sharding", None) is not None:
        raise ValueError("shard_optimizer was already applied to this optimizer")
    for group in optimizer.param_groups:
        group["params"] = [_current(p, optimizer) for p in group["params"]]
    dispatch_foreach = []
    for group in optimizer.param_groups:
        # a step through the dispatch (a group the local step cannot take) runs foreach ops:
        # one dispatch per group of equally placed tensors instead of one per parameter
        distributed = any(isinstance(p, DistTensor) for p in group["params"])
        if distributed and "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True
            dispatch_foreach.append(group)
    sharding = _OptimizerSharding(optimizer, shard_fn, tuple(dispatch_foreach))
    optimizer._autopar_sharding = sharding
    optimizer.register_step_pre_hook(sharding.pre_step)
    optimizer.register_step_post_hook(sharding.post_step)
    return optimizer
