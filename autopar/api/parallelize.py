"""parallelize: Paddle's one-call API (`paddle.distributed.parallelize`).

One config turns a single-device model and optimizer into a distributed pair, in place:
- `pp_config` gives every layer a mesh: its pipeline stage's slice of the mesh along "pp"
  (a layer spanning several stages has none; a `global_spec` layer has the whole mesh).
  Layers entered from another stage move their distributed inputs onto their own mesh in a
  forward pre-hook (`reshard` across meshes, so gradients travel back in backward);
- `mp_config` applies the plans of `plans.py` to the layers and parameters its keys name;
- every parameter becomes a distributed Parameter on its layer's mesh, in place (the same
  Parameter objects): split over "mp" where a plan says, Replicate elsewhere;
- `dp_config` splits the model's plain tensor inputs on their batch dim over "dp" (from rank
  0's batch, from each rank's own copy of it, or each rank's input as its piece: `input_source`)
  and picks the optimizer's ZeRO stage;
- the optimizer (holding those same Parameters) is wrapped with `shard_optimizer`.
"""
from __future__ import annotations

import difflib
import math
import re
import warnings
from typing import Any, Callable, Optional, Protocol, Union

import torch
from torch.utils._pytree import tree_map_only

from ..comm import get_rank
from ..runtime import local_region
from ..runtime.precision import MixedPrecisionPolicy, amp_level, autocast_forward
from ..tensor.dtensor import DistTensor
from ..mesh import ProcessMesh
from ..placement import Placement, Shard, StridedShard
from ..spec import split_range
from .global_mesh import get_mesh
from .layer import convert_in_place, register_model, replicate_params, weak_refs_released
from .optimizer import SHARDING_STAGES, shard_optimizer
from .plans import PlanBase, SplitPoint, _SplitWeights, forward_takes, placements_on
from .prediction_check import PredictionCheck
from .tensors import dtensor_from_local, reshard, shard_tensor

class PlannedLayout(Protocol):
    """What `config=` takes besides a dict and "auto": a layout the planner chose (`dist.plan`'s
    result): its config, its name and its estimate (`step_time`, `time` by category)."""

    config: dict
    name: str
    estimate: Any

    def mesh(self, ranks: Optional[list] = None) -> ProcessMesh: ...

    def apply_recompute(self, model: torch.nn.Module) -> None: ...


_CONFIG_DIMS = {"dp_config": "dp", "mp_config": "mp", "pp_config": "pp"}
_PARAM_KEYS = ("weight", "bias")  # a plan key naming a parameter ends in one of these (Paddle's rule)
_GLOBAL = -1  # the stage mark of a global_spec layer: on every stage


# -- names -------------------------------------------------------------------------------
_DOTTED = re.compile(r"[\w.*]+")


def match_names(key: str, names: list[str]) -> list[str]:
    """The names `key` matches: the name itself, or a regular expression matching the whole
    name (so `layers.*.mlp` matches every layer's mlp, as in Paddle).  In a key made of name
    characters, dots and `.*` only, a dot not starting `.*` is a literal dot: `h.*.attn`
    names each block's `attn`, not also its `c_attn` (a regex dot would match the `_`).

    >>> match_names("layers.*.mlp", ["layers", "layers.0", "layers.0.mlp", "layers.1.mlp"])
    ['layers.0.mlp', 'layers.1.mlp']
    >>> match_names("h.*.attn", ["h.0.attn", "h.0.attn.c_attn"])
    ['h.0.attn']
    """
    if key in names:
        return [key]
    regex = re.sub(r"\.(?!\*)", r"\\.", key) if _DOTTED.fullmatch(key) else key
    try:
        pattern = re.compile(regex)
    except re.error as err:
        raise ValueError(
            f"parallelize: {key!r} is neither a layer/parameter name nor a valid regular expression: {err}"
        ) from None
    return [n for n in names if pattern.fullmatch(n)]


def _parent(name: str) -> Optional[str]:
    return None if name == "" else name.rpartition(".")[0]


def _within(name: str, root: str) -> bool:
    """`name` is the layer `root` or one of its sub-layers."""
    return root == "" or name == root or name.startswith(root + ".")


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts))]


# -- pipeline stages -------------------------------------------------------------------------
def _stage_starts(names: list[str], split_spec: Any, degree: int) -> set[str]:
    """The layers that begin a new stage (stage 0 begins with the model), for `degree` stages."""
    if isinstance(split_spec, str):
        if split_spec not in names:
            raise ValueError(f"pp_config split_spec {split_spec!r} names no layer of the model")
        children = [n for n in names if _parent(n) == split_spec]
        if len(children) < degree:
            raise ValueError(
                f"pp_config split_spec {split_spec!r} has {len(children)} layers, too few for {degree} pipeline stages"
            )
        return {children[split_range(len(children), degree, i)[0]] for i in range(1, degree)}
    if not isinstance(split_spec, dict):
        raise TypeError(
            f"pp_config split_spec must be a layer-name prefix (str) or a dict {{name: SplitPoint}}, got {split_spec!r}"
        )
    starts = set()
    for key, point in split_spec.items():
        if not isinstance(point, SplitPoint):
            raise TypeError(
                f"pp_config split_spec[{key!r}] must be SplitPoint.END or SplitPoint.BEGINNING, got {point!r}"
            )
        matched = match_names(key, names)
        if not matched:
            raise ValueError(f"pp_config split_spec key {key!r} matches no layer of the model")
        for name in matched:
            i = names.index(name)
            if point is SplitPoint.END:
                after = [n for n in names[i + 1:] if not _within(n, name)]
                if not after:
                    raise ValueError(
                        f"pp_config split_spec: SplitPoint.END at {name!r}, the model's last layer, "
                        f"leaves no next stage"
                    )
                starts.add(after[0])
            elif i == 0:
                raise ValueError(
                    f"pp_config split_spec: SplitPoint.BEGINNING at {name!r}, the model itself, leaves stage 0 empty"
                )
            else:
                starts.add(name)
    if len(starts) != degree - 1:
        raise ValueError(
            f"pp_config split_spec {split_spec!r} cuts the model into {len(starts) + 1} stages "
            f"(before {sorted(starts)}) but the pipeline has {degree} (the mesh's 'pp' dim times vpp_degree)"
        )
    return starts


def module_meshes(
    names: list[str], mesh: ProcessMesh, pp_config: Optional[dict], stateless: frozenset = frozenset()
) -> dict[str, Optional[ProcessMesh]]:
    """{layer name: the mesh its parameters live on} for the layers `names` (in
    `named_modules()` order): the whole mesh without pipeline parallel; else the stage's
    slice of the mesh along "pp", the whole mesh for a `global_spec` layer, and None for a
    layer spanning several stages.  Layers are cut into stages at `split_spec`: a prefix
    string splits the children of that layer as evenly as possible (earlier stages take
    the extra ones; layers before it are stage 0, after it the last stage), a dict cuts at
    exactly the named layers.  With `vpp_degree` v the model is cut into v times as many
    stages and stage k lives on slice k % (pp size): each slice holds v stages (a virtual
    pipeline, for the VPP schedule).  A layer in `stateless` (it holds no parameter) directly
    under a layer spanning stages belongs to no stage either (None): it runs wherever it is
    called on the inputs it is given, as HF Llama's rotary embedding, registered after the
    layers but called before the first, must.

    >>> mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"])
    >>> names = ["", "emb", "layers", "layers.0", "layers.1", "head"]
    >>> meshes = module_meshes(names, mesh, {"split_spec": "layers"})
    >>> {n: m.process_ids if m else None for n, m in meshes.items()}
    {'': None, 'emb': [0, 1], 'layers': None, 'layers.0': [0, 1], 'layers.1': [2, 3], 'head': [2, 3]}
    """
    if pp_config is None:
        return {n: mesh for n in names}
    pipeline_settings(pp_config)
    degree = mesh.get_dim_size("pp")
    starts = _stage_starts(names, pp_config["split_spec"], degree * pp_config.get("vpp_degree", 1))
    global_spec = pp_config.get("global_spec")
    roots = match_names(global_spec, names) if global_spec is not None else []
    if global_spec is not None and not roots:
        raise ValueError(f"pp_config global_spec {global_spec!r} matches no layer of the model")
    stage, marks = 0, {}
    for name in names:
        if any(_within(name, r) for r in roots):
            marks[name] = _GLOBAL
            continue
        if name in starts:
            stage += 1
        marks[name] = stage
    spans = {a for n in names for a in _ancestors(n) if marks[a] != marks[n]}
    free = [n for n in names if n in stateless and _parent(n) in spans]
    spans |= {n for n in names if any(_within(n, f) for f in free)}
    return {
        n: None if n in spans else mesh if marks[n] == _GLOBAL else mesh.get_mesh_with_dim("pp", marks[n] % degree)
        for n in names
    }


# -- plans -----------------------------------------------------------------------------------
def match_plans(model: torch.nn.Module, parallelize_plan: dict) -> list[tuple[str, Optional[str], PlanBase]]:
    """(layer name, parameter name or None, plan) for every key of `parallelize_plan`, in
    key order.  A key names layers (`named_modules()`) or parameters (`named_parameters()`,
    whose names must end in weight or bias); a key matching nothing is an error."""
    if not isinstance(parallelize_plan, dict):
        raise TypeError(
            f"mp_config parallelize_plan must be a dict {{name: plan}}, got {type(parallelize_plan).__name__}"
        )
    layers = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters(remove_duplicate=False) if n.rpartition(".")[2] in _PARAM_KEYS]
    out = []
    for key, plans in parallelize_plan.items():
        plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
        for plan in plans:
            if not isinstance(plan, PlanBase):
                raise TypeError(f"mp_config parallelize_plan[{key!r}]: {plan!r} is not a plan (ColWiseParallel(), ...)")
        matched_layers, matched_params = match_names(key, layers), match_names(key, params)
        if not matched_layers and not matched_params:
            raise ValueError(
                f"mp_config parallelize_plan key {key!r} matches no layer and no parameter of the model "
                f"(parameter keys must end in 'weight' or 'bias')"
            )
        out += [(name, None, plan) for name in matched_layers for plan in plans]
        for name in matched_params:
            owner, _, attr = name.rpartition(".")
            for plan in plans:
                if not isinstance(plan, _SplitWeights):
                    raise TypeError(f"{type(plan).__name__} acts on a layer, but {key!r} names the parameter {name!r}")
                out.append((owner, attr, plan))
    return out


def _split_dims(modules: dict, plans: list) -> dict[int, tuple[Optional[Placement], str]]:
    """{id(parameter): (its placement over "mp" (None: not split), the plan and layer that say so)}."""
    dims: dict[int, tuple[Optional[Placement], str]] = {}
    for layer_name, attr, plan in plans:
        if not isinstance(plan, _SplitWeights):
            continue
        layer = modules[layer_name]
        wanted = plan.param_dims(layer, layer_name) if attr is None else {attr: plan.param_dim(layer, attr)}
        for pname, dim in wanted.items():
            p = getattr(layer, pname)
            who = f"{type(plan).__name__} on '{layer_name}'"
            placement = None if dim is None else plan.placement(dim % max(p.dim(), 1))
            if type(placement) is StridedShard and p.shape[placement.dim] % placement.split_factor:
                raise ValueError(
                    f"parameter '{_join(layer_name, pname)}' of shape {list(p.shape)}: {who} reads dim "
                    f"{placement.dim} as {placement.split_factor} projections side by side, but "
                    f"{p.shape[placement.dim]} does not divide by {placement.split_factor}"
                )
            have = dims.setdefault(id(p), (placement, who))
            if have[0] != placement:
                raise ValueError(
                    f"parameter '{_join(layer_name, pname)}' of shape {list(p.shape)}: {who} places it "
                    f"{placement} over mp, {have[1]} {have[0]}"
                )
    return dims


def _join(layer: str, attr: str) -> str:
    return f"{layer}.{attr}" if layer else attr


def _parameter_targets(model: torch.nn.Module, meshes: dict, plans: list) -> list[tuple[list, ProcessMesh, list]]:
    """(holders, mesh, placements) for every parameter: on its layer's mesh, split over "mp"
    where a plan says, Replicate elsewhere; `holders` lists every (layer, name) holding it,
    so a parameter shared by several layers is placed once.  Raises before anything changes."""
    modules = dict(model.named_modules())
    dims = _split_dims(modules, plans)
    slots: dict[int, list] = {}
    for layer_name, layer in modules.items():
        for pname, p in layer._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((layer, layer_name, pname))
    targets = []
    for pid, holders in slots.items():
        names = [_join(ln, pn) for _, ln, pn in holders]
        where = {meshes[ln] for _, ln, _ in holders}
        if None in where:
            raise ValueError(
                f"parameter {names[0]!r} belongs to a layer that spans several pipeline stages; move it into "
                f"a sub-layer, or name its layer in pp_config global_spec"
            )
        if len(where) > 1:
            raise ValueError(
                f"parameter shared by {names} would live on several pipeline stages "
                f"{sorted(m.process_ids for m in where)}; untie it or keep its layers on one stage"
            )
        mesh = where.pop()
        split = dims.get(pid, (None,))[0]
        p = getattr(holders[0][0], holders[0][2])
        targets.append((holders, mesh, placements_on(p, mesh, **({"mp": split} if split is not None else {}))))
    return targets


def _place_parameters(model: torch.nn.Module, meshes: dict, targets: list) -> None:
    """Make every parameter distributed as `targets` says, in place (the optimizer and every
    holder keep the Parameter object), and every buffer Replicate on its layer's mesh."""
    with weak_refs_released(model):
        for holders, mesh, placements in targets:
            layer, layer_name, pname = holders[0]
            p = getattr(layer, pname)
            try:
                new = shard_tensor(p, mesh, placements)
            except ValueError as err:
                raise ValueError(
                    f"parameter {_join(layer_name, pname)!r} of shape {list(p.shape)} on mesh {mesh} as {placements}: {err}"
                ) from err
            convert_in_place(p, new, _join(layer_name, pname))
    for layer_name, layer in model.named_modules():
        if meshes[layer_name] is not None:
            replicate_params(layer, meshes[layer_name])  # the buffers (parameters are placed already)


# -- hooks -----------------------------------------------------------------------------------
def _move_inputs(mesh: ProcessMesh):
    """A forward pre-hook bringing distributed inputs from other meshes onto `mesh`."""

    def hook(_layer, args, kwargs):
        def move(t: DistTensor) -> DistTensor:
            return t if t._spec.mesh == mesh else reshard(t, mesh, placements_on(t, mesh))

        return tree_map_only(DistTensor, move, (args, kwargs))

    return hook


def _hook_stage_entries(modules: dict, meshes: dict) -> None:
    """Hook the layers where the forward enters a stage (or a global_spec layer): those whose
    parent spans stages or lives elsewhere.  Inside a stage every tensor is on its mesh."""
    for name, layer in modules.items():
        parent = _parent(name)
        if meshes[name] is not None and (parent is None or meshes[parent] != meshes[name]):
            layer.register_forward_pre_hook(_move_inputs(meshes[name]), with_kwargs=True)


# where a data-parallel batch comes from (dp_config "input_source"), see `_shard_batch`
INPUT_SOURCES = ("rank0", "replicated", "local")


def _shard_batch(mesh: ProcessMesh, source: str = "rank0"):
    """A forward pre-hook making plain tensor inputs (not scalars) split on dim 0 (the batch)
    over "dp" (and "ep": expert-parallel ranks route their own tokens, as data-parallel ranks), from
    where `source` says the batch is:
    - "rank0": every rank passes the whole batch and rank 0's is the one used (its pieces are
      sent: the single-process value even when the ranks' batches differ);
    - "replicated": every rank passes the same whole batch and cuts its own piece (no
      transfer; `shard_tensor(..., src_data_rank=None)`);
    - "local": each rank passes its own piece, as a per-rank loader yields it; the global
      batch is the pieces in "dp" order, every piece the same size (no transfer;
      `dtensor_from_local` with the global shape given, as torch's `from_local` assumes).
    """
    ranks = math.prod(mesh.get_dim_size(d) for d in ("dp", "ep") if d in mesh.dim_names)

    def split(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DistTensor) or t.dim() == 0:
            return t
        placements = placements_on(t, mesh, dp=Shard(0), ep=Shard(0))
        if source == "local":
            piece = t if get_rank() in mesh else t.new_empty(0)  # off the mesh: no piece
            return dtensor_from_local(piece, mesh, placements, shape=(t.shape[0] * ranks, *t.shape[1:]))
        return shard_tensor(t, mesh, placements, src_data_rank=0 if source == "rank0" else None)

    return lambda _layer, args, kwargs: tree_map_only(torch.Tensor, split, (args, kwargs))


def _warn_of_a_key_cache_in_training(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """HF's models build a key/value cache in every forward unless told `use_cache=False`.
    Handed to every decoder layer as a Python object, it keeps each layer off the local-region
    path (every op dispatched on its own: about a third more host time on HF Llama).  autopar
    does not turn it off itself (the cache is part of the model's output, and without one HF
    reads the position ids' values to look for packed sequences), so it says so, once."""
    config = getattr(model, "config", None)
    if model.training and kwargs.get("use_cache") is None and getattr(config, "use_cache", False) \
            and not getattr(model, "_autopar_warned_key_cache", False):
        model._autopar_warned_key_cache = True
        warnings.warn(f"{type(model).__name__} builds a key/value cache in training (config.use_cache=True): it keeps "
                      f"the decoder layers from running as local regions. Set model.config.use_cache = False (or pass "
                      f"use_cache=False) for training", stacklevel=3)


# -- optimizer -------------------------------------------------------------------------------
def _check_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer that has stepped (before the model changes)."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"parallelize needs a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError(
            f"parallelize: the optimizer already has state for {len(optimizer.state)} parameters (it has stepped); "
            f"call parallelize before the first optimizer step"
        )


def _parallel_optimizer(optimizer: torch.optim.Optimizer, sharding_level: int, mesh: ProcessMesh,
                        mp_policy: Optional[MixedPrecisionPolicy] = None):
    """The optimizer sharded (it holds the model's Parameters, converted in place)."""
    shard_fn = SHARDING_STAGES[sharding_level]("dp", mesh) if sharding_level else None
    return shard_optimizer(optimizer, shard_fn, mp_policy=mp_policy)


def _precision(config: dict, optimizer: Optional[torch.optim.Optimizer]) -> tuple:
    """(autocast dtype, MixedPrecisionPolicy), each or None, from dp_config's `mp_policy` or
    Paddle's `amp_config` {"level": "O1"|"O2", "dtype": "bfloat16"|"float16"}."""
    policy = config.get("dp_config", {}).get("mp_policy")
    autocast = None
    if "amp_config" in config:
        amp = config["amp_config"]
        if not isinstance(amp, dict):
            raise ValueError(f"amp_config must be a dict like {{'level': 'O2', 'dtype': 'bfloat16'}}, got {amp!r}")
        _refuse_unknown_keys("amp_config", amp, AMP_CONFIG_KEYS)
        if policy is not None:
            raise ValueError("parallelize: give dp_config's mp_policy or amp_config, not both")
        autocast, policy = amp_level(amp.get("level", "O1"), amp.get("dtype", "bfloat16"), "amp_config")
    if policy is not None and optimizer is None:
        raise ValueError(f"parallelize: {policy} steps float32 master weights in the optimizer: give parallelize "
                         f"the optimizer")
    return autocast, policy


# -- the API ---------------------------------------------------------------------------------
def parallelize(
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    mesh: Optional[ProcessMesh] = None,
    config: Union[dict, str, "PlannedLayout", None] = None,
) -> tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]:
    """Make `model` and `optimizer` distributed with one config (in place; both are returned).

    `mesh` defaults to `get_mesh()`; its dims are found by the names "dp", "mp" and "pp".
    `config` is "auto" (the planner chooses, see `_auto_config`), a `dist.plan(...)` result
    (its config on its mesh, or on `mesh`'s ranks, its recomputed layers checkpointed), or
    holds any of
    - `"dp_config": {"sharding_level": 0|1|2|3, "input_source": "rank0"|"replicated"|"local",
      "mp_policy": MixedPrecisionPolicy}`: plain tensor inputs are split on dim 0 over "dp" (and
      "ep"): cut from rank 0's batch (the default, the single-process value whatever the other
      ranks pass), from each rank's own copy of the same batch, or taken as each rank's piece (a
      per-rank loader; no transfer in the last two, see `_shard_batch`); the optimizer gets ZeRO
      stage `sharding_level` over "dp" (0: none), under the mixed-precision policy if given;
    - `"amp_config": {"level": "O1"|"O2", "dtype": "bfloat16"|"float16"}`: Paddle's amp: O1
      runs the forward under autocast, O2 is `MixedPrecisionPolicy(param_dtype=dtype)`
      (docs/mixed_precision.md);
    - `"mp_config": {"parallelize_plan": {name: plan or [plans]}}`: names of layers or of
      parameters (ending in weight/bias), regular expressions allowed (`layers.*.mlp`);
      plans `ColWiseParallel`, `RowWiseParallel`, `SequenceParallelBegin/End/Enable/Disable`,
      `PrepareLayerInput/Output` (along the mesh dim "mp"), `PrepareContextParallel`,
      `ContextParallel` (along "sep"), and `ExpertParallel` (over "ep" or "dp", docs/moe.md);
    - `"pp_config": {"split_spec": prefix or {name: SplitPoint}, "global_spec": name}`:
      pipeline stages on the slices of the mesh along "pp" (see `module_meshes`); compute
      the loss from the model's output (on the last stage).  Its schedule keys
      `"schedule_mode"` ("FThenB", "1F1B", "VPP", "ZBH1", "ZBVPP"), `"accumulate_steps"`
      (micro-batches per step) and `"vpp_degree"` (stages per "pp" slice) are what
      `dist.pipelining.build_schedule(model, loss)` (dynamic) and `dist.to_static` (static)
      run the model with (docs/pipeline.md).
    Without a mesh or any of these keys, model and optimizer come back unchanged.  An
    optimizer must not have stepped yet; it keeps its Parameters, converted in place.

    >>> import torch, autopar as dist
    >>> dist.set_mesh(dist.ProcessMesh([[0]], dim_names=["dp", "mp"]))
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    >>> config = {"dp_config": {"sharding_level": 1},
    ...           "mp_config": {"parallelize_plan": {"0": dist.ColWiseParallel(), "2": dist.RowWiseParallel()}}}
    >>> model, opt = dist.parallelize(model, opt, config=config)
    >>> model[0].weight.placements, model[2].bias.placements
    ([Replicate(), Shard(0)], [Replicate(), Replicate()])
    >>> loss = model(torch.ones(6, 4)).sum()
    >>> loss.backward(); opt.step()
    >>> opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].placements  # ZeRO-1: states split over dp
    [Shard(1), Shard(0)]
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"parallelize needs a torch.nn.Module, got {type(model).__name__}")
    mesh = mesh if mesh is not None else get_mesh()
    planned = None
    if isinstance(config, str):
        mesh, config = _auto_config(model, mesh, config)
        planned = model._autopar_plan
    elif hasattr(config, "apply_recompute"):  # a Plan
        planned = config
        mesh, config = _planned(model, mesh, config)
    config = _checked_config(config, mesh)
    if mesh is None or not config:
        return model, optimizer
    _check_optimizer(optimizer)
    autocast, policy = _precision(config, optimizer)
    pp = "pp_config" in config
    stateless = frozenset(n for n, m in model.named_modules() if next(m.parameters(), None) is None)
    meshes = module_meshes([n for n, _ in model.named_modules()], mesh, config.get("pp_config"), stateless)
    plans = match_plans(model, config.get("mp_config", {}).get("parallelize_plan", {}))
    for name, attr, plan in plans:
        if attr is None and meshes[name] is None:
            raise ValueError(f"{type(plan).__name__} on '{name}': the layer spans several pipeline stages")
        if plan.mesh_dim is not None and plan.mesh_dim not in mesh.dim_names:
            raise ValueError(f"{type(plan).__name__} on '{name}' acts along a mesh dim named {plan.mesh_dim!r}, "
                             f"but mesh {mesh} has dims {mesh.dim_names}")
    _place_parameters(model, meshes, _parameter_targets(model, meshes, plans))
    modules = dict(model.named_modules())
    if pp:  # first: the plans' hooks then see inputs on their layer's mesh
        _hook_stage_entries(modules, meshes)
    for plan in dict.fromkeys(plan for _, _, plan in plans):
        plan.prepare_model(model, mesh)
    for name, plan in dict.fromkeys((name, plan) for name, _, plan in plans):  # a plan hooks its layer once
        plan.apply(modules[name], meshes[name], name)
    if pp:
        model._autopar_pipeline = pipeline_settings(config["pp_config"])
    if "dp_config" in config:
        first_stage = mesh.get_mesh_with_dim("pp", 0) if pp else mesh
        source = config["dp_config"].get("input_source", "rank0")
        model.register_forward_pre_hook(_shard_batch(first_stage, source), with_kwargs=True)
    if forward_takes(model, "use_cache"):
        model.register_forward_pre_hook(_warn_of_a_key_cache_in_training, with_kwargs=True)
    local_region.install(model)  # as shard_layer: layers that turn out not to communicate run as plain torch
    register_model(model)
    if autocast is not None:
        autocast_forward(model, autocast)
    if optimizer is not None:
        level = config["dp_config"].get("sharding_level", 0) if "dp_config" in config else 0
        optimizer = _parallel_optimizer(optimizer, level, mesh, policy)
        if planned is not None:  # the prediction now, the measured steps beside it later
            model._autopar_prediction = PredictionCheck(planned, optimizer)
    return model, optimizer


def _auto_config(model: torch.nn.Module, mesh: Optional[ProcessMesh], config: str) -> tuple[ProcessMesh, dict]:
    """config="auto": the planner's fastest layout of `model` on `mesh`'s ranks (the "cpu"
    profile, fp32, one sequence per rank).  A mesh naming dp/mp/pp dims keeps their sizes
    (a missing one is 1); any other mesh is reshaped to the plan's ["pp", "dp", "mp"].
    The layers the plan recomputes are checkpointed.  The plan is kept as
    `model._autopar_plan` (see its `why`)."""
    if config != "auto":
        raise ValueError(f"parallelize config must be a dict or 'auto', got {config!r}")
    if mesh is None:
        raise ValueError("parallelize(config='auto') needs a mesh (argument or set_mesh) to know the ranks")
    plan = _AUTO_PLANNER[0]
    if plan is None:
        raise RuntimeError("parallelize(config='auto') needs autopar.planner: import autopar (which imports it)")
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    fixed = {"vpp": 1}  # the dynamic schedules of an annotated model are 1F1B and FThenB
    named = any(dim in sizes for dim in _CONFIG_DIMS.values())
    if named:
        fixed.update({dim: sizes.get(dim, 1) for dim in _CONFIG_DIMS.values()})
    chosen = plan(model, world_size=len(mesh.process_ids), global_batch=len(mesh.process_ids), device="cpu",
                  precision="fp32", fixed=fixed)
    return _planned(model, mesh, chosen, keep_mesh=named)


# config="auto" asks the planner (`autopar.planner.plan`), which lies above this layer and names
# itself here when it is imported (`use_auto_planner`): this module may not import it
_AUTO_PLANNER: list = [None]


def use_auto_planner(plan: Callable) -> None:
    """Let `parallelize(..., config="auto")` ask `plan(model, world_size=, global_batch=, device=,
    precision=, fixed=)` for a layout (a `PlannedLayout`)."""
    _AUTO_PLANNER[0] = plan


def _planned(model: torch.nn.Module, mesh: Optional[ProcessMesh], plan, keep_mesh: bool = False):
    """(mesh, config) of a `dist.plan` result: its mesh over `mesh`'s ranks (or the job's
    first ranks; `keep_mesh`: `mesh` itself), its recomputed layers checkpointed."""
    model._autopar_plan = plan
    plan.apply_recompute(model)
    if keep_mesh:
        return mesh, plan.config
    return plan.mesh(None if mesh is None else list(mesh.process_ids)), plan.config


def _checked_config(config: Optional[dict], mesh: Optional[ProcessMesh]) -> dict:
    """`config` (or {}) after the checks that need no model: known keys, mesh dims, shapes."""
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise TypeError(f"parallelize config must be a dict, got {type(config).__name__}")
    _refuse_unknown_keys("parallelize config", config, (*_CONFIG_DIMS, "amp_config"))
    if mesh is None:
        return config
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"parallelize needs a ProcessMesh, got {type(mesh).__name__}")
    for key, dim in _CONFIG_DIMS.items():  # (mp_config's plans say which dim they need: "mp", "sep", ...)
        if key in config and key != "mp_config" and dim not in mesh.dim_names and not (
                key == "dp_config" and "ep" in mesh.dim_names):  # the expert-parallel ranks split the batch
            raise ValueError(
                f"parallelize: {key} needs a mesh dim named {dim!r}, but mesh {mesh} has dims {mesh.dim_names}"
            )
    dp_config = config.get("dp_config", {})
    if not isinstance(dp_config, dict) or dp_config.get("sharding_level", 0) not in (0, *SHARDING_STAGES):
        raise ValueError(f"dp_config must be a dict like {{'sharding_level': 0|1|2|3}}, got {dp_config!r}")
    _refuse_unknown_keys("dp_config", dp_config, DP_CONFIG_KEYS)
    if dp_config.get("input_source", "rank0") not in INPUT_SOURCES:
        raise ValueError(f"dp_config input_source must be one of {list(INPUT_SOURCES)}, "
                         f"got {dp_config['input_source']!r}")
    mp_config = config.get("mp_config", {"parallelize_plan": {}})
    if not isinstance(mp_config, dict) or "parallelize_plan" not in mp_config:
        raise ValueError(f"mp_config must be a dict with a 'parallelize_plan', got {mp_config!r}")
    _refuse_unknown_keys("mp_config", mp_config, MP_CONFIG_KEYS)
    if "pp_config" in config:
        pipeline_settings(config["pp_config"])
    return config


DP_CONFIG_KEYS = ("sharding_level", "input_source", "mp_policy")
AMP_CONFIG_KEYS = ("level", "dtype")
MP_CONFIG_KEYS = ("parallelize_plan",)
PP_CONFIG_KEYS = ("split_spec", "global_spec", "schedule_mode", "accumulate_steps", "vpp_degree")


def _refuse_unknown_keys(where: str, given: dict, known: tuple) -> None:
    """A misspelt key would otherwise be ignored and the job train with the default
    (`sharding_levle: 3` training at level 0): name it, and the known key it is closest to."""
    unknown = sorted(set(given) - set(known), key=str)
    if not unknown:
        return
    close = {k: difflib.get_close_matches(str(k), known, n=1) for k in unknown}
    hints = "".join(f"; did you mean {m[0]!r} for {k!r}?" for k, m in close.items() if m)
    raise ValueError(f"{where}: unknown keys {unknown} (known: {list(known)}){hints}")


# the pipeline schedules by name, in pp_config and Strategy.pipeline alike (pipelining.orders.schedule_orders)
SCHEDULE_MODES = ("FThenB", "1F1B", "VPP", "ZBH1", "ZBVPP")


def check_schedule(where: str, mode: Any, accumulate_steps: Any, vpp_degree: Any) -> None:
    """Refuse a schedule no pipeline runs, with the same words for pp_config and
    Strategy.pipeline (`where` prefixes the setting's name)."""
    if mode not in SCHEDULE_MODES:
        raise ValueError(f"{where}schedule_mode must be one of {list(SCHEDULE_MODES)}, got {mode!r}")
    for key, n in (("accumulate_steps", accumulate_steps), ("vpp_degree", vpp_degree)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{where}{key} must be an int >= 1, got {n!r}")


def pipeline_settings(pp_config: Any) -> dict:
    """pp_config's schedule settings, checked: {schedule_mode, accumulate_steps, vpp_degree}
    for the keys it has (what `build_schedule` and `to_static` run the model with).

    >>> pipeline_settings({"split_spec": "layers", "schedule_mode": "1F1B", "accumulate_steps": 8})
    {'schedule_mode': '1F1B', 'accumulate_steps': 8}
    """
    if not isinstance(pp_config, dict) or "split_spec" not in pp_config:
        raise ValueError(f"pp_config must be a dict with a 'split_spec', got {pp_config!r}")
    _refuse_unknown_keys("pp_config", pp_config, PP_CONFIG_KEYS)
    check_schedule("pp_config ", pp_config.get("schedule_mode", "1F1B"), pp_config.get("accumulate_steps", 1),
                   pp_config.get("vpp_degree", 1))
    return {k: pp_config[k] for k in ("schedule_mode", "accumulate_steps", "vpp_degree") if k in pp_config}


__all__ = ["match_names", "match_plans", "module_meshes", "parallelize", "pipeline_settings"]
