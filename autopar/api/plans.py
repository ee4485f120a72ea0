"""The plans of `parallelize`: what a tensor-parallel plan does to one layer, and SplitPoint.

A plan is applied to a layer on the layer's mesh (its pipeline stage's mesh, or the whole
mesh) and acts along the mesh dim named "mp".  `ColWiseParallel` / `RowWiseParallel` say
which dim of the layer's weights is split over "mp" (the rules then propagate the split);
the sequence-parallel plans and `PrepareLayerInput/Output` hook the layer's input and output.

Sequence-dim convention (Megatron's, as Paddle's): a sequence-parallel region carries
activations split over "mp" on their sequence dim.  `need_transpose=True` means the layers
outside the region work on [b, s, h] and the region on [s, b, h]: entering transposes dims
0 and 1, leaving transposes back.  Which dim is the sequence is read off the batch dim's
split over "dp" (batch split on dim 0: [b, s, h], sequence dim 1; on dim 1: [s, b, h],
sequence dim 0); a tensor whose batch is not split is [s, b, h] right after a transpose
and [b, s, h] otherwise.  The sequence plans act on a layer's first input (positional or
passed by keyword, as HF passes it) / its output (the first element of a tuple output), as
Paddle's do.
"""
from __future__ import annotations

import enum
import inspect
import sys
from typing import Callable, Optional

import torch

from ..tensor.dtensor import DistTensor
from ..mesh import ProcessMesh
from ..placement import Placement, Replicate, Shard, StridedShard
from .tensors import reshard


class SplitPoint(enum.Enum):
    """Where a `pp_config` split_spec dict cuts the model at a named layer: BEGINNING starts a
    new stage at the layer, END starts one right after it.

    >>> import autopar as dist
    >>> {"layers.1": dist.SplitPoint.END}
    {'layers.1': <SplitPoint.END: 1>}
    """

    BEGINNING = 0
    END = 1


def placements_on(t: torch.Tensor, mesh: ProcessMesh, **override: Placement) -> list[Placement]:
    """`t`'s placements carried onto `mesh` by dim name (Replicate where `t` has none, for a
    plain tensor or a dim its mesh lacks), with `override` ({dim name: placement}) on top."""
    have = dict(zip(t._spec.mesh.dim_names, t._spec.placements)) if isinstance(t, DistTensor) else {}
    return [override.get(name, have.get(name, Replicate())) for name in mesh.dim_names]


def _on_mp(t: torch.Tensor, mesh: ProcessMesh, placement: Placement) -> torch.Tensor:
    """`t` on `mesh` with `placement` on "mp", every other mesh dim as it was."""
    return reshard(t, mesh, placements_on(t, mesh, mp=placement))


def _mp_split_dim(t: torch.Tensor, mesh: ProcessMesh) -> Optional[int]:
    """The tensor dim `t` is split on over "mp" (None if it is not split there)."""
    p = placements_on(t, mesh)[mesh.dim_index("mp")]
    return p.dim if isinstance(p, Shard) else None


def sequence_dim(t: torch.Tensor, mesh: ProcessMesh, transposed: bool) -> int:
    """The sequence dim of activation `t` (see the module docstring)."""
    if "dp" in mesh.dim_names and t.dim() >= 2:
        batch = placements_on(t, mesh)[mesh.dim_index("dp")]
        if batch in (Shard(0), Shard(1)):
            return 1 - batch.dim
    return 0 if transposed else 1


def forward_takes(layer: torch.nn.Module, name: str) -> bool:
    """Whether `layer`'s forward has a parameter called `name`."""
    try:
        return name in inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):
        return False


def _map_first(value, fn: Callable, what: str):
    """`value` with `fn` applied to it (a tensor) or to its first element (a tuple/list)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return type(value)([fn(value[0]), *value[1:]])
    raise TypeError(f"{what}: expected a tensor or a tuple/list starting with one, got {type(value).__name__}")


def _first_input_name(layer: torch.nn.Module) -> Optional[str]:
    """The name of the first parameter of `layer.forward` (None if it takes *args first)."""
    try:
        params = list(inspect.signature(layer.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return params[0].name
    return None


def _hook_first_input(layer: torch.nn.Module, fn: Callable, what: str) -> None:
    """Register a pre-hook applying `fn` to the layer's first input, passed positionally or
    by keyword (HF calls `self_attn(hidden_states=..., ...)` with no positional argument)."""
    first = _first_input_name(layer)

    def hook(_m, args, kwargs):
        if args:
            return _map_first(args, fn, what), kwargs
        if first in kwargs:
            return args, {**kwargs, first: _map_first(kwargs[first], fn, what)}
        named = f"'{first}'" if first else "a positional input"
        raise TypeError(
            f"{what}: the layer was called without its first input ({named}, positional or by keyword); "
            f"got only the keywords {sorted(kwargs)}"
        )

    layer.register_forward_pre_hook(hook, with_kwargs=True)


def _swap_01(t: torch.Tensor) -> torch.Tensor:
    """[b, s, h] <-> [s, b, h], laid out contiguously as the layers after it expect (a `view`
    in them needs it; Paddle's transpose copies too)."""
    return t.transpose(0, 1).contiguous()


class PlanBase:
    """A tensor-parallel plan for one layer; `parallelize` calls `apply` on every layer
    whose name matches the plan's key, and `prepare_model` once on the whole model."""

    mesh_dim: Optional[str] = "mp"  # the mesh dim the plan acts along (None: the plan checks its mesh itself)

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        """Register the plan's hooks on `layer`, which lives on `mesh` (none by default)."""

    def prepare_model(self, model: torch.nn.Module, mesh: ProcessMesh) -> None:
        """Register what the plan needs at the model's own inputs (nothing by default)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def is_hf_conv1d(layer: torch.nn.Module) -> bool:
    """HF transformers' Conv1D (GPT-2's projections): a linear layer computing x @ w + b with
    its weight laid out [in, out], the transpose of nn.Linear's.  Looked up only once
    transformers is loaded: autopar does not depend on it."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(layer, getattr(utils, "Conv1D", ()))


class _SplitWeights(PlanBase):
    """Col/RowWiseParallel: the tensor dim of each weight split over "mp" (None: replicated),
    for nn.Linear ([out, in]), nn.Embedding ([vocab, hidden]) and a weight used as `x @ w`
    ([in, out], Paddle's layout): a raw parameter, or HF's Conv1D layer."""

    LINEAR: dict[str, Optional[int]]
    EMBEDDING: dict[str, Optional[int]]
    RAW: dict[str, Optional[int]]

    def param_dims(self, layer: torch.nn.Module, name: str) -> dict[str, Optional[int]]:
        """{parameter name: split dim} for the parameters of `layer` this plan places."""
        if isinstance(layer, torch.nn.Linear):
            layout = self.LINEAR
        elif isinstance(layer, torch.nn.Embedding):
            layout = self.EMBEDDING
        elif is_hf_conv1d(layer):
            layout = self.RAW
        else:
            raise TypeError(
                f"{type(self).__name__} on layer '{name}': needs an nn.Linear or nn.Embedding, got "
                f"{type(layer).__name__}; to split a weight used as x @ w, key the plan by the "
                f"parameter's name ('{name}.weight')"
            )
        return {p: d for p, d in layout.items() if getattr(layer, p, None) is not None}

    def placement(self, dim: int) -> Placement:
        """How a parameter split on `dim` is cut over "mp"."""
        return Shard(dim)

    def param_dim(self, owner: torch.nn.Module, param_name: str) -> Optional[int]:
        """The split dim of one parameter named by the plan's key: the owner's layout when it
        is an nn.Linear / nn.Embedding (so the plan means the same on the layer or its
        weight), else the [in, out] layout of a weight used as x @ w."""
        if isinstance(owner, (torch.nn.Linear, torch.nn.Embedding)):
            return self.param_dims(owner, "")[param_name]
        return self.RAW[param_name]


class ColWiseParallel(_SplitWeights):
    """Split a layer's output features over "mp": nn.Linear weight and bias on dim 0 (torch's
    [out, in]), nn.Embedding weight on dim 1 (hidden), a raw `x @ w` weight or HF Conv1D's
    [in, out] weight on its last dim (and Conv1D's bias).
    The output comes out split on its last dim; `gather_output=True` makes it Replicate
    (one all-gather) for layers that need it whole.

    `fused=k`: the layer computes k projections side by side (GPT-2's c_attn: q, k, v; a
    gate_up_proj: gate, up), and each is split alike (Megatron's stride), so every rank holds
    its heads of q, of k and of v and splitting the output into them moves nothing (a plain
    column split would hand rank 0 all of q and part of k).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> plan = {"0": dist.ColWiseParallel(), "1": dist.RowWiseParallel()}
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model[0].weight.placements, model[0].bias.placements, model[1].weight.placements
    ([Shard(0)], [Shard(0)], [Shard(1)])
    """

    LINEAR = {"weight": 0, "bias": 0}
    EMBEDDING = {"weight": 1}
    RAW = {"weight": -1, "bias": -1}

    def __init__(self, gather_output: bool = False, fused: int = 1) -> None:
        if not isinstance(fused, int) or fused < 1:
            raise ValueError(f"ColWiseParallel(fused={fused!r}): the number of projections side by side, an int >= 1")
        self.gather_output = gather_output
        self.fused = fused

    def placement(self, dim: int) -> Placement:
        return StridedShard(dim, self.fused) if self.fused > 1 else Shard(dim)

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        if self.gather_output:
            what = f"ColWiseParallel(gather_output=True) on '{name}'"
            layer.register_forward_hook(
                lambda _m, _args, out: _map_first(out, lambda t: _on_mp(t, mesh, Replicate()), what)
            )


class RowWiseParallel(_SplitWeights):
    """Split a layer's input features over "mp": nn.Linear weight on dim 1 (its bias stays
    Replicate: it is added once, after the reduction), nn.Embedding weight on dim 0 (the
    vocabulary), a raw `x @ w` weight or HF Conv1D's [in, out] weight on its first dim (the
    Conv1D's bias stays Replicate).  The output comes out Partial over "mp" and is reduced
    where it is next needed.  `is_input_parallel=False` first splits the layer's input on its
    last dim.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    >>> plan = {"0": dist.RowWiseParallel(is_input_parallel=False)}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model[0].weight.placements, model[0].bias.placements
    ([Shard(1)], [Replicate()])
    """

    LINEAR = {"weight": 1, "bias": None}
    EMBEDDING = {"weight": 0}
    RAW = {"weight": 0, "bias": None}

    def __init__(self, is_input_parallel: bool = True) -> None:
        self.is_input_parallel = is_input_parallel

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        if not self.is_input_parallel:
            what = f"RowWiseParallel(is_input_parallel=False) on '{name}'"
            _hook_first_input(layer, lambda t: _on_mp(t, mesh, Shard(-1)), what)


class SequenceParallelBegin(PlanBase):
    """Put on the last layer before a sequence-parallel region: its output (transposed from
    [b, s, h] to [s, b, h] if `need_transpose`) is split over "mp" on the sequence dim (a
    Partial output is reduce-scattered).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> plan = {"0": dist.SequenceParallelBegin()}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> y = model(torch.ones(2, 3, 4))  # [b, s, h] in, [s, b, h] out, split on s
    >>> tuple(y.shape), y.placements
    ((3, 2, 4), [Shard(0)])
    """

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def _split(self, t: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
        if self.need_transpose:
            t = _swap_01(t)
        return _on_mp(t, mesh, Shard(sequence_dim(t, mesh, self.need_transpose)))

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        what = f"SequenceParallelBegin on '{name}'"
        layer.register_forward_hook(lambda _m, _args, out: _map_first(out, lambda t: self._split(t, mesh), what))


class SequenceParallelEnd(PlanBase):
    """Put on the first layer after a sequence-parallel region: its input is gathered
    (Replicate over "mp") and, if `need_transpose`, transposed back to [b, s, h].

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 4))
    >>> plan = {"0": dist.SequenceParallelBegin(), "1": dist.SequenceParallelEnd()}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> y = model(torch.ones(2, 3, 4))
    >>> tuple(y.shape), y.placements
    ((2, 3, 4), [Replicate()])
    """

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def _gather(self, t: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
        t = _on_mp(t, mesh, Replicate())
        return _swap_01(t) if self.need_transpose else t

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        what = f"SequenceParallelEnd on '{name}'"
        _hook_first_input(layer, lambda t: self._gather(t, mesh), what)


class SequenceParallelEnable(PlanBase):
    """Run a layer sequence-parallel (a norm, a dropout: any layer that works token by
    token): its parameters stay Replicate and its input, unless already split over "mp" on
    dim 0 or 1, is split on the sequence dim.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> model = torch.nn.Sequential(torch.nn.LayerNorm(4))
    >>> plan = {"0": dist.SequenceParallelEnable()}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model(torch.ones(2, 3, 4)).placements  # [b, s, h], split on s
    [Shard(1)]
    """

    def _split(self, t: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
        if _mp_split_dim(t, mesh) in (0, 1):
            return t
        return _on_mp(t, mesh, Shard(sequence_dim(t, mesh, transposed=False)))

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        what = f"SequenceParallelEnable on '{name}'"
        _hook_first_input(layer, lambda t: self._split(t, mesh), what)


class SequenceParallelDisable(PlanBase):
    """Run a layer inside a sequence-parallel region on whole sequences (attention, an MLP
    with tensor-parallel weights): its input is gathered over "mp" (and transposed to
    [b, s, h] if `need_transpose`), its output transposed back and split again on the
    sequence dim its input had (a Partial output is reduce-scattered, never all-reduced).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 4))
    >>> plan = {"0": dist.SequenceParallelBegin(), "1": dist.SequenceParallelDisable()}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> y = model(torch.ones(2, 3, 4))  # still [s, b, h], split on s
    >>> tuple(y.shape), y.placements
    ((3, 2, 4), [Shard(0)])
    """

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        what = f"SequenceParallelDisable on '{name}'"
        seq: dict[str, Optional[int]] = {"dim": None}  # per layer: the split its input had

        def gather(t: torch.Tensor) -> torch.Tensor:
            seq["dim"] = _mp_split_dim(t, mesh)
            t = _on_mp(t, mesh, Replicate())
            return _swap_01(t) if self.need_transpose else t

        def split(t: torch.Tensor) -> torch.Tensor:
            if self.need_transpose:
                t = _swap_01(t)
            dim = seq["dim"] if seq["dim"] in (0, 1) else sequence_dim(t, mesh, self.need_transpose)
            return _on_mp(t, mesh, Shard(dim))

        _hook_first_input(layer, gather, what)
        layer.register_forward_hook(lambda _m, _args, out: _map_first(out, split, what))


class _UserHook(PlanBase):
    """A plan made of the user's `fn(process_mesh)`, which returns a hook for the layer."""

    def __init__(self, fn: Callable[[ProcessMesh], Callable]) -> None:
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} needs a callable fn(process_mesh) -> hook, got {fn!r}")
        self.fn = fn

    @staticmethod
    def sees_kwargs(hook: Callable, plain: int) -> bool:
        """Whether `hook` takes the layer's keyword inputs too: one positional parameter more
        than the `plain` form (torch's `with_kwargs` hooks)."""
        try:
            params = inspect.signature(hook).parameters.values()
        except (TypeError, ValueError):
            return False
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return len(positional) == plain + 1


class PrepareLayerInput(_UserHook):
    """Your own input preparation: `fn(process_mesh)` returns a forward pre-hook
    `hook(layer, args)` (returning new args or None), registered on the layer; for a layer
    called with keyword arguments (as HF calls its attention), `hook(layer, args, kwargs)`
    sees them too and returns `(args, kwargs)` or None.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> def replicate_input(process_mesh):
    ...     return lambda layer, args: tuple(dist.shard_tensor(a, process_mesh, [dist.Replicate()]) for a in args)
    >>> model = torch.nn.Sequential(torch.nn.ReLU())
    >>> plan = {"0": dist.PrepareLayerInput(replicate_input)}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model(torch.ones(2)).placements
    [Replicate()]
    """

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        hook = self.fn(mesh)
        layer.register_forward_pre_hook(hook, with_kwargs=self.sees_kwargs(hook, 2))


class PrepareLayerOutput(_UserHook):
    """Your own output preparation: `fn(process_mesh)` returns a forward hook
    `hook(layer, args, output)` (returning a new output or None), registered on the layer;
    `hook(layer, args, kwargs, output)` also sees the layer's keyword inputs.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["mp"])
    >>> def double(process_mesh):
    ...     return lambda layer, args, out: out * 2
    >>> model = torch.nn.Sequential(torch.nn.ReLU())
    >>> plan = {"0": dist.PrepareLayerOutput(double)}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model(torch.ones(2))
    tensor([2., 2.])
    """

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        hook = self.fn(mesh)
        layer.register_forward_hook(hook, with_kwargs=self.sees_kwargs(hook, 3))


__all__ = [
    "ColWiseParallel",
    "PlanBase",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
    "SplitPoint",
    "placements_on",
    "sequence_dim",
]
