"""An optimizer's parameters and states sharded over one mesh dim: what `shard_optimizer` runs.

The optimizer stays the torch optimizer itself, stepping the user's Parameters (so
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
  into the whole parameters, one collective per bucket.  Under gradient accumulation the
  gradients stay whole (Partial) until the step, which reduce-scatters their sum once;
- stage 2: as stage 1, but gradients are reduce-scattered in every backward (they add up as
  shards): no whole gradient outlives its backward;
- stage 3: the parameters themselves are sharded over the mesh dim, in place (the model, the
  optimizer and the user keep the same Parameter objects); each layer gathers its
  parameters just before it runs and frees them after, gathers them again for its backward
  and reduce-scatters their gradients (`zero3.py`).

With a mixed-precision policy (`precision.py`) ZeRO-3's units gather and compute in its
`param_dtype` over float32 shards, and at the other levels every parameter is held in
`param_dtype` while the optimizer steps a float32 master copy of the piece each rank steps
(`ZeroParam.master`: its shard under ZeRO-1/2), copied back after the step.

`OptimizerSharding` is the optimizer's side (FSDP2's FSDPParamGroup, for all of its
parameters): the stage, one `ZeroParam` per parameter, the all-gather buckets of ZeRO-1/2,
the gradients ZeRO-2's backward left unreduced.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch

from ...comm import all_gather_into, get_rank
from ...tensor.dtensor import DistTensor, new_dist
from ...tensor.backward_end import AtBackwardEnd
from ...tensor.observers import reduce_pending_on_read
from .. import grad_reduce
from ..grad_reduce import grad_plan, reduce_grads, reduce_in_backward
from ...redistribute import piece_of_full
from . import zero3
from .flat_shards import FlatShards
from ..precision import MixedPrecisionPolicy, cast_model_io, spec_in
from .local_step import ELEMENTWISE, LocalStep
from .param import ZeroParam, full_local, param_spec, piece_within, sharded_spec
from .states import place_states, placed


def shard(optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable], models: list,
          convert_in_place: Callable, mp_policy: Optional[MixedPrecisionPolicy] = None) -> "OptimizerSharding":
    """Put `optimizer` under `shard_fn` (a ShardingStage, another state function, or None):
    its sharding is `optimizer._autopar_sharding`, run by the optimizer's step and
    load_state_dict hooks.  ZeRO-3 cuts the converted `models` into units and converts plain
    Parameters in place with `convert_in_place(old, new, name)`; `mp_policy` sets the dtypes
    (`precision.py`)."""
    if mp_policy is not None and mp_policy.param_dtype is not None and not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"mp_policy {mp_policy} steps float32 master weights, which needs an elementwise optimizer "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); got {type(optimizer).__name__}"
        )
    dispatch_foreach = []
    for group in optimizer.param_groups:
        # a step through the dispatch (a group the local step cannot take) runs foreach ops:
        # one dispatch per group of equally placed tensors instead of one per parameter
        distributed = any(isinstance(p, DistTensor) for p in group["params"])
        if distributed and "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True
            dispatch_foreach.append(group)
    sharding = OptimizerSharding(optimizer, shard_fn, tuple(dispatch_foreach), models, convert_in_place, mp_policy)
    optimizer._autopar_sharding = sharding
    optimizer.register_step_pre_hook(sharding.pre_step)
    optimizer.register_step_post_hook(sharding.post_step)
    if sharding.masters:
        optimizer.register_state_dict_post_hook(sharding.save_masters)
        optimizer.register_load_state_dict_pre_hook(sharding.load_masters)
        optimizer.register_load_state_dict_post_hook(lambda opt: sharding.keep_float32_states())
    optimizer.register_load_state_dict_post_hook(lambda opt: sharding.place_states())
    return sharding


def _grad_arrived(sharding: "weakref.ref[OptimizerSharding]", n: int, _param: torch.Tensor) -> None:
    """Parameter n's gradient arrived (a ZeRO-2 hook; an optimizer dropped leaves its hooks behind)."""
    live = sharding()
    if live is not None:
        live.grad_arrived(n)


def _grad_coming(sharding: "weakref.ref[OptimizerSharding]", n: int, _grad: torch.Tensor) -> None:
    """Parameter n's gradient is about to be accumulated (a ZeRO-2 hook, as `_grad_arrived`)."""
    live = sharding()
    if live is not None:
        live.grad_coming(n)


class OptimizerSharding:
    """An optimizer's parameters under `shard` (see the module doc); `params`: one ZeroParam
    per parameter, in the order of the optimizer's groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn: Optional[Callable], dispatch_foreach: tuple,
                 models: list, convert_in_place: Callable, policy: Optional[MixedPrecisionPolicy] = None):
        self.optimizer = optimizer
        self.shard_fn = shard_fn
        self.stage = getattr(shard_fn, "stage", None)
        self.policy = policy
        self.gathers: Optional[list] = None  # ZeRO-1/2: the all-gathers after the step, planned once
        self.states_sharded = False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.stage == 3:
            self.params = self._shard_parameters(params, models, convert_in_place)
        elif self.stage in (1, 2):
            self.params = [self._stepped_at_shard(p) for p in params]
        else:
            self.params = [ZeroParam(p) for p in params]
        if policy is not None:
            self._apply_policy(models, convert_in_place)
        # the parameters stepped through float32 masters (set once, above): the step's own work
        self.masters = [zp for zp in self.params if zp.master is not None]
        self._groups: list = []  # (param group, its params list, their ZeroParams), as last seen
        start = 0
        for group in optimizer.param_groups:
            end = start + len(group["params"])
            self._groups.append((group, group["params"], self.params[start:end]))
            start = end
        # gradients go to where they are stepped: reduce them during backward (stage 3: its layers do)
        targets = [(zp, zp.step_spec()) for zp in self.params if type(zp.param) is DistTensor]
        reduce_in_backward([(zp.param, s) for zp, s in targets if s is not None and not zero3.gathers(zp.param)],
                           reduce_dtype=self._reduce_dtype())
        self.local_step = LocalStep(optimizer, dispatch_foreach)
        self.place_states()
        reduce_pending_on_read(self)  # (held weakly: it goes with the optimizer)
        # ZeRO-2: the gradients a backward left unreduced, reduced where it ends
        self.backward_end = AtBackwardEnd(self.prepare_grads)
        self.carried: list = []  # ZeRO-2: (ZeroParam, its reduced gradient) set aside for a backward's to add to
        self.loading: dict = {}  # a state dict's states of parameters with masters, while it loads
        if self.stage == 2:
            # weakly: the garbage collector does not see a distributed Parameter's
            # post-accumulate-grad hooks, so a hook holding the sharding (or the ZeroParam,
            # which holds the parameter) would keep them all for good
            sharding = weakref.ref(self)
            for n, zp in enumerate(self.params):
                if type(zp.param) is DistTensor and zp.step_spec() is not None and zp.param.requires_grad:
                    zp.param.register_hook(functools.partial(_grad_coming, sharding, n))
                    zp.param.register_post_accumulate_grad_hook(functools.partial(_grad_arrived, sharding, n))

    def _apply_policy(self, models: list, convert_in_place: Callable) -> None:
        """Every parameter not gathered by ZeRO-3 units held in the policy's `param_dtype`, the
        optimizer stepping a float32 master copy of the piece this rank steps; the models
        holding them cast their inputs and outputs."""
        dtype = self.policy.param_dtype
        low = [(n, zp) for n, zp in enumerate(self.params) if dtype is not None and not zp.in_place
               and zp.param.is_floating_point() and zp.param.dtype != dtype]
        for n, zp in low:  # (refused before anything changes)
            if type(zp.param) is not DistTensor:
                raise ValueError(
                    f"mp_policy {self.policy}: parameter #{n} of the optimizer (shape {list(zp.param.shape)}) is not "
                    f"a distributed tensor: shard_layer or parallelize the model before shard_optimizer"
                )
        held = {id(zp.param) for zp in self.params}
        for model in models:
            if any(id(p) in held for p in model.parameters()):
                cast_model_io(model, self.policy)
        for n, zp in low:
            p = zp.param
            with torch.no_grad():
                zp.master = zp.piece()[1].clone()  # (ZeRO-1/2: only the shard this rank steps)
                held_low = torch.nn.Parameter(new_dist(p._local.to(dtype), spec_in(p._spec, dtype)), p.requires_grad)
            convert_in_place(p, held_low, f"#{n} of the optimizer")
            if zp.sharded is not None:
                zp.unsharded, zp.sharded = spec_in(zp.unsharded, dtype), spec_in(zp.sharded, dtype)
            zp.master_matched()

    def _reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in (the policy's; None: their own)."""
        return self.policy.reduction_dtype if self.policy is not None else None

    def _cut(self, p: torch.Tensor) -> tuple:
        """(p's placements, the sharding mesh dim's index, p's placements sharded over it or
        None when it has no tensor dim to cut)."""
        spec = param_spec(p, self.shard_fn.mesh)
        dim = spec.mesh.dim_index(self.shard_fn.sharding_mesh_dim)
        return spec, dim, sharded_spec(spec, dim)

    def _stepped_at_shard(self, p: torch.Tensor) -> ZeroParam:
        """ZeRO-1/2: p stepped at this rank's shard over the sharding mesh dim."""
        spec, dim, target = self._cut(p)
        return ZeroParam(p) if target is None else ZeroParam(p, spec, target, dim)

    def _shard_parameters(self, params: list, models: list, convert_in_place: Callable) -> list:
        """ZeRO-3: every parameter sharded over the mesh dim in place; the layers holding them
        gather them around their use."""
        zero_params, sharded = [], []
        for n, p in enumerate(params):
            spec, dim, target = self._cut(p)
            if target is None:
                zero_params.append(ZeroParam(p))
                continue
            if type(p) is DistTensor:
                with torch.no_grad():
                    p._local = piece_within(p._local, spec, target).clone()
                p._spec = target
            else:
                new = torch.nn.Parameter(DistTensor(piece_of_full(p.detach(), target), target), p.requires_grad)
                convert_in_place(p, new, f"#{n} of the optimizer")
            zero_params.append(ZeroParam(p, spec, target, dim, in_place=True))
            sharded.append(zero_params[-1])
        zero3.install(sharded, self.shard_fn.sharding_mesh_dim, models, self.policy)
        return zero_params

    def groups(self) -> list:
        """(param group, its ZeroParams) for every group of the optimizer; parameters given to
        it since `shard_optimizer` (`add_param_group`, a group's list edited) are stepped whole."""
        current = self.optimizer.param_groups
        if len(current) != len(self._groups) or any(
            group is not seen or group["params"] is not params or len(params) != len(zps)
            or any(zp.param is not p for zp, p in zip(zps, params))
            for group, (seen, params, zps) in zip(current, self._groups)
        ):
            self._groups = [(group, group["params"], [self._zero_param(p) for p in group["params"]])
                            for group in current]
        return [(group, zps) for group, _, zps in self._groups]

    def _zero_param(self, p: torch.Tensor) -> ZeroParam:
        return next((zp for zp in self.params if zp.param is p), None) or ZeroParam(p)

    def reduce_if_pending(self, t: DistTensor) -> None:
        """Before one Partial gradient of this optimizer's parameters is reduced for a read,
        reduce all of them, in the pre-step's buckets."""
        if any(p.grad is t for group in self.optimizer.param_groups for p in group["params"]):
            self.prepare_grads()

    def grad_arrived(self, n: int) -> None:
        """ZeRO-2 keeps no whole gradient past its backward: gradients that backward left
        unreduced (local regions leave them Partial, as at ZeRO-1; a first call of a region
        runs op by op; a model outside regions) are reduced where the backward ends, all in
        one bucket (one collective, where reducing them region by region would wait for one
        per region within backward)."""
        zp = self.params[n]
        g = zp.param.grad
        if type(g) is not DistTensor or grad_plan(g._spec, zp.step_spec())[0]:
            self.backward_end.queue()

    def grad_coming(self, n: int) -> None:
        """A gradient of parameter n is on its way while it holds a reduced one (gradient
        accumulation): that one is set aside and added back once the new one is reduced where
        the backward ends, so that the new one is reduced alone (not added to the shard
        first, which would reshard each parameter's on its own)."""
        zp = self.params[n]
        g = zp.param.grad
        if type(g) is DistTensor and not grad_plan(g._spec, zp.step_spec())[0]:
            self.backward_end.queue()
            self.carried.append((zp, g))
            zp.param.grad = None

    # -- float32 masters in the optimizer's state dict (Paddle's "master_weights") -------------
    def _indexed(self) -> list:
        """(index in the optimizer's state dict, ZeroParam) of every parameter with a master."""
        params = [zp for _, zps in self.groups() for zp in zps]
        return [(i, zp) for i, zp in enumerate(params) if zp.master is not None]

    def save_masters(self, optimizer, state_dict: dict) -> dict:
        """`state_dict["master_weights"]`: {parameter index: its float32 master}, placed like
        the piece each rank steps (its shard under ZeRO-1/2), so that a checkpoint resumes
        from the exact masters."""
        state_dict["master_weights"] = {i: new_dist(zp.master, zp.step_piece()[0]) for i, zp in self._indexed()}
        return state_dict

    def load_masters(self, optimizer, state_dict: dict) -> dict:
        """Take the masters out of a state dict (resharded to this run's pieces if saved with
        others), before torch loads the rest; note the float32 states of their parameters,
        which torch casts to the parameter's dtype (`keep_float32_states`)."""
        states = state_dict.get("state", {})
        self.loading = {i: dict(states[i]) for i, _ in self._indexed() if i in states}
        masters = state_dict.get("master_weights")
        if masters is None:
            return state_dict
        with torch.no_grad():
            for i, zp in self._indexed():
                if i in masters:
                    zp.master.copy_(placed(masters[i], zp.step_piece()[0])._local)
                    zp.master_matched()
        return {k: v for k, v in state_dict.items() if k != "master_weights"}

    def keep_float32_states(self) -> None:
        """The states of parameters stepped through masters, as they were in the state dict
        (torch's load casts them to the low-precision parameter's dtype)."""
        loading, self.loading = self.loading, {}
        for i, zp in self._indexed():
            state = self.optimizer.state.get(zp.param)
            for key, value in loading.get(i, {}).items():
                if state is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value

    def place_states(self) -> None:
        self.local_step.forget()
        place_states(self.optimizer, ((zp.param, zp.step_spec()) for _, zps in self.groups() for zp in zps))

    # -- the step ---------------------------------------------------------------------------
    def pre_step(self, optimizer, args, kwargs) -> None:
        self.local_step.restore(stepped=False)  # a step that raised left its swap behind: the groups hold stand-ins
        if self.stage == 3:
            zero3.settle_raised_backwards(self.params)
        self.prepare_grads()
        for zp in self.masters:
            zp.refresh_master()
        groups = self.groups()
        self.local_step.swap(groups)
        if self.masters:
            self._refuse_unswapped_masters(groups)

    def _refuse_unswapped_masters(self, groups: list) -> None:
        """A group holding float32 masters that the local step could not take would step the
        low-precision parameters instead: refused, naming its first such parameter."""
        swapped = {id(group) for group, *_ in self.local_step.swapped}
        for group, zps in groups:
            mastered = [zp for zp in zps if zp.master is not None]
            if id(group) not in swapped and mastered:
                self.local_step.restore(stepped=False)
                p, spec = mastered[0].param, mastered[0].step_spec()
                grad = p.grad.placements if type(p.grad) is DistTensor else ("none" if p.grad is None else "plain")
                raise RuntimeError(
                    f"mp_policy {self.policy}: a param group of {len(zps)} parameters cannot step its float32 master "
                    f"weights: a gradient or state is not placed like the piece this rank steps (its first such "
                    f"parameter, shape {list(p.shape)}, is stepped at {list(spec.placements)} on {spec.mesh}; its "
                    f"gradient: {grad})"
                )

    def prepare_grads(self) -> None:
        """Bring every gradient to where its parameter is stepped (Partial ones reduced, in
        buckets).  Idempotent: the static mode runs it inside the captured program, then the
        step's own call finds nothing to do."""
        pending = []
        for _, zps in self.groups():
            for zp in zps:
                p = zp.param
                g, spec = p.grad, zp.step_spec()
                if g is None or spec is None:
                    continue
                if type(g) is not DistTensor:  # a plain gradient is the global value
                    g = p.grad = placed(g, spec)
                plan = grad_plan(g._spec, spec)
                if plan[0]:
                    pending.append((p, plan))
        # ZeRO-1/2 reduce here what backward left, all ready at once: no small first bucket
        reduce_grads(pending, self._reduce_dtype(), grad_reduce.BUCKET_BYTES if self.stage in (1, 2) else None)
        carried, self.carried = self.carried, []
        with torch.no_grad():
            for zp, g in carried:  # (ZeRO-2: the earlier backwards' sum, in place, as torch accumulates)
                if zp.param.grad is not None:
                    g.add_(zp.param.grad)
                zp.param.grad = g

    def post_step(self, optimizer, args, kwargs) -> None:
        self.local_step.restore()
        with torch.no_grad():
            for zp in self.masters:  # the stepped master, into the low-precision parameter
                zp.piece()[1].copy_(zp.master)
        self._publish()
        for zp in self.masters:
            zp.master_matched()
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
                gathered = all_gather_into(layout.pack_pieces([zp.piece()[1] for zp in bucket], me), ranks)
                layout.unpack(gathered, [full_local(zp.param) for zp in bucket])

    def _gather_buckets(self) -> list:
        """(ranks, this rank's index, ZeroParams, their chunk layout) per bucket of shards on
        the same ranks and dtype, at most BUCKET_BYTES gathered."""
        rank = get_rank()
        buckets: dict = {}  # (ranks, dtype) -> [[bytes, ZeroParams...], ...]
        for zp in self.params:
            if not zp.steps_a_shard:
                continue
            if rank not in zp.unsharded.mesh or zp.unsharded.mesh.shape[zp.mesh_dim] == 1:
                continue  # (a mesh dim of one rank: the shard is the whole piece, updated in place)
            ranks = zp.unsharded.mesh.group_of(rank, (zp.mesh_dim,))
            filling = buckets.setdefault((ranks, zp.sharded.meta.dtype), [[0]])
            full = full_local(zp.param)
            nbytes = full.numel() * full.element_size()
            if len(filling[-1]) > 1 and filling[-1][0] + nbytes > grad_reduce.BUCKET_BYTES:
                filling.append([0])
            filling[-1][0] += nbytes
            filling[-1].append(zp)
        out = []
        for (ranks, _), bucket_list in buckets.items():
            for _, *bucket in bucket_list:
                shapes = tuple(tuple(full_local(zp.param).shape) for zp in bucket)
                layout = FlatShards.of(shapes, tuple(zp.cut_dim for zp in bucket), len(ranks))
                out.append((ranks, ranks.index(rank), bucket, layout))
        return out
