"""shard_optimizer and ZeRO stages 1/2/3 over one mesh dim.

The returned optimizer is the torch optimizer itself, stepping the user's Parameters (so
`opt.state[p]`, `state_dict()` and `load_state_dict()` are torch's), with step hooks:
- any stage: every gradient is brought to where its parameter is stepped before the update
  (Partial ones reduced once, in buckets: `grad_reduce.py`) unless backward already did; an
  elementwise optimizer (Adam, SGD, ...) then steps the local pieces as plain tensors
  (`local_step.py`): as fast as on one device;
- no stage: data-parallel gradients are all-reduced during backward, as DDP does;
- stage 1: each rank steps its shard of every parameter (the parameter's placements with the
  sharding mesh dim cutting one tensor dim): gradients are reduce-scattered to the shards
  during backward, one collective per bucket, so `.grad` holds the shard (a distributed
  tensor); the states are the shard's size, and the updated shards are all-gathered back
  into the parameters, one collective per bucket.  Under gradient accumulation the
  gradients stay whole (Partial) until the step, which reduce-scatters their sum once;
- stage 2: as stage 1, but gradients are reduce-scattered in every backward (they add up as
  shards): no whole gradient outlives its backward;
- stage 3: the parameters themselves are sharded over the mesh dim, in place (the model, the
  optimizer and the user keep the same Parameter objects); each layer gathers its
  parameters just before it runs and frees them after, gathers them again for its backward
  and reduce-scatters their gradients (`zero3.py`).

A torch optimizer never given to shard_optimizer still steps distributed parameters, op by
op through the dispatch; a global step pre-hook places its states like their parameters
(at its first step and after each `load_state_dict`), as `place_states` does for ours.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm import all_gather_into, get_rank
from ..tensor.dispatch import storage_key
from ..tensor.observers import reduce_pending_on_read
from ..tensor.dtensor import DistTensor, new_dist, on_first_dist_tensor
from ..runtime.zero.flat_shards import FlatShards
from ..runtime import grad_reduce
from ..runtime.grad_reduce import grad_plan, reduce_grads, reduce_in_backward
from ..mesh import ProcessMesh
from ..placement import Replicate, Shard
from ..spec import DistSpec, TensorMeta
from ..runtime.zero import zero3
from .layer import convert_in_place, models
from ..runtime.zero.local_step import LocalStep, whole_piece
from ..redistribute import piece_of_full
from .tensors import reshard


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
    """`spec` with mesh dim `mesh_dim` sharding the first free tensor dim that is big enough
    (None when the mesh dim is not Replicate or no dim is free)."""
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


def _full_local(p: torch.Tensor) -> torch.Tensor:
    return p._local if type(p) is DistTensor else p.data


class _ShardStep:
    """A ZeRO-1/2 parameter: stepped at this rank's shard (`spec`), a view into the local piece
    of the whole parameter (`full`)."""

    __slots__ = ("param", "full", "spec", "mesh_dim", "view", "key")

    def __init__(self, param: torch.Tensor, full: DistSpec, spec: DistSpec, mesh_dim: int):
        self.param, self.full, self.spec, self.mesh_dim = param, full, spec, mesh_dim
        self.view, self.key = None, None

    def piece(self) -> tuple:
        """(spec, this rank's shard of the parameter's current local piece)."""
        local = _full_local(self.param)
        key = (storage_key(local, start=True), local.shape, local.stride())  # (the view keeps an old piece alive)
        if key != self.key:
            self.key, self.view = key, _piece_within(local, self.full, self.spec)
        return self.spec, self.view

    @property
    def cut_dim(self) -> int:
        return self.spec.placements[self.mesh_dim].dim


def _piece_within(local: torch.Tensor, outer: DistSpec, inner: DistSpec) -> torch.Tensor:
    """This rank's piece of `inner` as a view into its piece of `outer` (inner cuts finer)."""
    rank = get_rank()
    if rank not in outer.mesh:
        return local
    coord = outer.mesh.coordinate(rank)
    view = local
    for d, ((a, _), (b0, b1)) in enumerate(zip(outer.local_box(coord), inner.local_box(coord))):
        if b1 - b0 != view.shape[d]:
            view = view.narrow(d, b0 - a, b1 - b0)
    return view


class _OptimizerSharding:
    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable], dispatch_foreach: tuple = ()):
        self.optimizer = optimizer
        self.shard_fn = shard_fn
        self.stage = getattr(shard_fn, "stage", None)
        self.shard_steps: dict = {}  # id(parameter) -> _ShardStep (ZeRO-1/2)
        self.gathers: Optional[list] = None  # ZeRO-1/2: the all-gathers after the step, planned once
        self.states_sharded = False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.stage == 3:
            self._shard_parameters(params)
        elif self.stage in (1, 2):
            for p in params:
                spec = _param_spec(p, shard_fn.mesh)
                dim = spec.mesh.dim_index(shard_fn.sharding_mesh_dim)
                target = sharded_spec(spec, dim)
                if target is not None:
                    self.shard_steps[id(p)] = _ShardStep(p, spec, target, dim)
        # gradients go to where they are stepped: reduce them during backward (stage 3: its layers do)
        targets = [(p, self.step_spec(p)) for p in params if type(p) is DistTensor]
        reduce_in_backward([(p, s) for p, s in targets if s is not None and not zero3.gathers(p)],
                           every_backward=self.stage == 2)
        self.local_step = LocalStep(optimizer, dispatch_foreach, self.piece_of)
        self.place_states()
        reduce_pending_on_read(self)  # (held weakly: it goes with the optimizer)
        self.arrived: list = []  # ZeRO-2: parameters whose gradients backward left unreduced
        if self.stage == 2:
            for p, spec in targets:
                if spec is not None and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_arrived)

    def reduce_if_pending(self, t: DistTensor) -> None:
        """Before one Partial gradient of this optimizer's parameters is reduced for a read,
        reduce all of them, in the pre-step's buckets."""
        if any(p.grad is t for group in self.optimizer.param_groups for p in group["params"]):
            self.prepare_grads()

    def _grad_arrived(self, p: torch.Tensor) -> None:
        """ZeRO-2 keeps no whole gradient past its backward: gradients that backward left
        unreduced (a first call of a local region runs op by op; a model outside regions) are
        reduced in buckets where the backward ends."""
        g = p.grad
        if type(g) is DistTensor and not grad_plan(g._spec, self.step_spec(p))[0]:
            return
        if not self.arrived:
            torch.autograd.Variable._execution_engine.queue_callback(self.prepare_grads)
        self.arrived.append(p)

    def _shard_parameters(self, params: list) -> None:
        """ZeRO-3: every parameter sharded over the mesh dim in place; the layers holding them
        gather them around their use."""
        sharded = []
        for n, p in enumerate(params):
            spec = _param_spec(p, self.shard_fn.mesh)
            target = sharded_spec(spec, spec.mesh.dim_index(self.shard_fn.sharding_mesh_dim))
            if target is None:
                continue
            if type(p) is DistTensor:
                with torch.no_grad():
                    p._local = _piece_within(p._local, spec, target).clone()
                p._spec = target
            else:
                new = torch.nn.Parameter(DistTensor(piece_of_full(p.detach(), target), target), p.requires_grad)
                convert_in_place(p, new, f"#{n} of the optimizer")
            sharded.append(p)
        zero3.install(sharded, self.shard_fn.sharding_mesh_dim, models())

    # -- where each parameter is stepped ----------------------------------------------------
    def step_spec(self, p: torch.Tensor) -> Optional[DistSpec]:
        """The placements p's gradient and states have at the step (None: a plain parameter
        stepped whole)."""
        shard = self.shard_steps.get(id(p))
        if shard is not None:
            return shard.spec
        return p._spec if type(p) is DistTensor else None

    def piece_of(self, p: torch.Tensor):
        shard = self.shard_steps.get(id(p))
        return shard.piece() if shard is not None else whole_piece(p)

    def place_states(self) -> None:
        place_states(self.optimizer, self.step_spec)

    # -- the step ---------------------------------------------------------------------------
    def pre_step(self, optimizer, args, kwargs) -> None:
        self.prepare_grads()
        self.local_step.swap()

    def prepare_grads(self) -> None:
        """Bring every gradient to where its parameter is stepped (Partial ones reduced, in
        buckets).  Idempotent: the static mode runs it inside the captured program, then the
        step's own call finds nothing to do."""
        self.arrived = []
        pending = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g, spec = p.grad, self.step_spec(p)
                if g is None or spec is None:
                    continue
                if type(g) is not DistTensor:  # a plain gradient is the global value
                    g = p.grad = _placed(g, spec)
                plan = grad_plan(g._spec, spec)
                if plan[0]:
                    pending.append((p, plan))
        reduce_grads(pending)

    def post_step(self, optimizer, args, kwargs) -> None:
        self.local_step.restore()
        self._publish()
        if self.shard_fn is not None and self.stage is None and not self.states_sharded:
            self.states_sharded = True
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            state[key] = self.shard_fn(key, p, value)

    def _publish(self) -> None:
        """ZeRO-1/2: all-gather the updated shards into the whole parameters, one collective
        per bucket."""
        if self.gathers is None:
            self.gathers = self._gather_buckets()
        with torch.no_grad():
            for ranks, me, bucket, layout in self.gathers:
                gathered = all_gather_into(layout.pack_pieces([s.piece()[1] for s in bucket], me), ranks)
                layout.unpack(gathered, [_full_local(s.param) for s in bucket])

    def _gather_buckets(self) -> list:
        """(ranks, this rank's index, shards, their chunk layout) per bucket of shards on the
        same ranks and dtype, at most BUCKET_BYTES gathered."""
        rank = get_rank()
        buckets: dict = {}  # (ranks, dtype) -> [[bytes, shards...], ...]
        for shard in self.shard_steps.values():
            if rank not in shard.full.mesh or shard.full.mesh.shape[shard.mesh_dim] == 1:
                continue  # (a mesh dim of one rank: the shard is the whole piece, updated in place)
            ranks = shard.full.mesh.group_of(rank, (shard.mesh_dim,))
            filling = buckets.setdefault((ranks, shard.spec.meta.dtype), [[0]])
            full = _full_local(shard.param)
            nbytes = full.numel() * full.element_size()
            if len(filling[-1]) > 1 and filling[-1][0] + nbytes > grad_reduce.BUCKET_BYTES:
                filling.append([0])
            filling[-1][0] += nbytes
            filling[-1].append(shard)
        out = []
        for (ranks, _), bucket_list in buckets.items():
            for _, *bucket in bucket_list:
                shapes = tuple(tuple(_full_local(s.param).shape) for s in bucket)
                layout = FlatShards.of(shapes, tuple(s.cut_dim for s in bucket), len(ranks))
                out.append((ranks, ranks.index(rank), bucket, layout))
        return out


def place_states(optimizer: torch.optim.Optimizer, step_spec: Callable) -> None:
    """Put every tensor state where its parameter is stepped (`step_spec(p)`, None: whole):
    states made for another placement (an optimizer that stepped before the model was
    converted; a checkpoint of a differently parallelized model, `opt.load_state_dict`) are
    resharded, plain ones cut."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            spec = step_spec(p)
            state = optimizer.state.get(p)
            if spec is None or not state:
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == spec.shape:
                    state[key] = _placed(value, spec)


def _spec_of(p: torch.Tensor) -> Optional[DistSpec]:
    return p._spec if type(p) is DistTensor else None


def _place_states_of_plain_optimizers(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """A global step pre-hook: an optimizer over distributed parameters that was never given
    to shard_optimizer steps through the op dispatch, and its states must be placed like
    their parameters too (loaded from a differently parallelized model's checkpoint, they
    come on the saved mesh).  Done at its first step and after each `load_state_dict`; an
    optimizer with no distributed parameter at its first step is left alone from then on."""
    if getattr(optimizer, "_autopar_sharding", None) is not None or getattr(optimizer, "_autopar_placed", False):
        return
    optimizer._autopar_placed = True
    if any(type(p) is DistTensor for group in optimizer.param_groups for p in group["params"]):
        place_states(optimizer, _spec_of)
        optimizer.register_load_state_dict_post_hook(_place_loaded_states)


def _place_loaded_states(optimizer: torch.optim.Optimizer) -> None:
    """(Given to shard_optimizer since, the optimizer places its states itself.)"""
    if getattr(optimizer, "_autopar_sharding", None) is None:
        place_states(optimizer, _spec_of)


# (a global hook on torch's optimizers: set once distributed parameters can exist, not on import)
on_first_dist_tensor(lambda: register_optimizer_step_pre_hook(_place_states_of_plain_optimizers))


def _placed(value: torch.Tensor, spec: DistSpec) -> DistTensor:
    """`value` (a distributed tensor, or a plain one holding the global value) placed like
    `spec`, in its own dtype."""
    target = DistSpec(spec.mesh, spec.placements, TensorMeta.contiguous(spec.shape, value.dtype))
    if type(value) is not DistTensor:
        return new_dist(piece_of_full(value.detach(), target), target)
    if value._spec.same_pieces(target):
        return value
    return reshard(value.detach(), target.mesh, target.placements)


def shard_optimizer(optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable] = None) -> torch.optim.Optimizer:
    """Make `optimizer` work over distributed parameters; with a ShardingStage, apply ZeRO.

    Returns the same torch optimizer (step, zero_grad, param_groups, state, state_dict all
    as usual, keyed by the model's Parameters).  Optimizer states are distributed tensors
    placed like the piece of their parameter each rank steps (its shard under ZeRO); states
    loaded or made for other placements are moved there.

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
    optimizer.register_load_state_dict_post_hook(lambda opt: sharding.place_states())
    return optimizer
