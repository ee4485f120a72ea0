"""Mixture-of-experts: the `ExpertParallel` plan, and Paddle's sub-mesh tensors.

`ExpertParallel()` keyed by a MoE block's name (HF's `model.layers.*.mlp` in Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) splits the block's experts over the mesh dim "ep" (over
"dp" when the mesh has no "ep": the data-parallel ranks then each hold some experts, dp2ep):
the experts' grouped [experts, ...] weights become Shard(0) there, the router stays
replicated, and each call sends every token to the rank holding its expert and back
(`runtime.experts`).  The experts module is the block's child holding 3-D weights and a
`num_experts`, called as `experts(hidden [tokens, hidden], top_k_index, top_k_weights)`; a
block without one (a dense MLP matched by the same wildcard) is left as it is.

`moe_sub_mesh_tensors` / `moe_global_mesh_tensor` cut a tensor split over one mesh dim into
one tensor per sub-mesh along that dim, and join them back (Paddle's names).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..comm import get_rank
from ..comm.observers import active_captures
from ..mesh import ProcessMesh
from ..placement import Placement, Replicate, Shard
from ..redistribute import piece_of_full, redistribute_local
from ..runtime.experts import block_grad_specs, check_experts, dispatch_combine, expert_parallel, on_pieces
from ..runtime.local_region import _saved_tensor_hooks, _Watch
from ..spec import DistSpec, TensorMeta
from ..spmd.registry import DRAWS_RANDOM
from ..tensor.dtensor import DistTensor, new_dist
from ..tensor.observers import watching
from .layer import convert_in_place
from .plans import PlanBase, placements_on
from .tensors import shard_tensor


def experts_of(block: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The experts module of a MoE block: itself or its first sub-module with a `num_experts`
    whose parameters are all [num_experts, ...], grouped weights (3-D) and their biases (None if
    there is none; a router's [num_experts, hidden] weight alone is no expert)."""
    for sub in block.modules():
        n = getattr(sub, "num_experts", None)
        params = list(sub.parameters(recurse=False))
        if isinstance(n, int) and any(p.dim() == 3 for p in params) and all(
                p.dim() >= 2 and p.shape[0] == n for p in params):
            return sub
    return None


def _top_k(block: torch.nn.Module) -> Optional[int]:
    """The block's top-k: a `top_k` on it or a sub-module (HF's router), else its config's."""
    for sub in block.modules():
        k = getattr(sub, "top_k", None)
        if isinstance(k, int):
            return k
    config = getattr(block, "config", None)
    return getattr(config, "num_experts_per_tok", None)


def expert_dim(mesh: ProcessMesh) -> str:
    """The mesh dim experts are split over: "ep", or "dp" on a mesh without one."""
    for name in ("ep", "dp"):
        if name in mesh.dim_names:
            return name
    raise ValueError(f"ExpertParallel needs a mesh dim named 'ep' (or 'dp'), but mesh {mesh} has {mesh.dim_names}")


class ExpertParallel(PlanBase):
    """Split a MoE block's experts over the mesh dim "ep" (or "dp"), tokens dispatched to their
    expert's rank and combined back by all-to-all.

    >>> import torch, autopar as dist
    >>> class Experts(torch.nn.Module):  # HF's experts interface: grouped [experts, ...] weights
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.num_experts, self.w = 4, torch.nn.Parameter(torch.randn(4, 8, 8))
    ...     def forward(self, x, index, weights):
    ...         out = torch.zeros_like(x)
    ...         for k in range(index.shape[1]):
    ...             out += weights[:, k:k + 1] * torch.bmm(x.unsqueeze(1), self.w[index[:, k]]).squeeze(1)
    ...         return out
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.top_k, self.gate, self.experts = 2, torch.nn.Linear(8, 4), Experts()
    ...     def forward(self, x):
    ...         weights, index = self.gate(x).softmax(-1).topk(self.top_k)
    ...         return self.experts(x, index, weights)
    >>> mesh = dist.ProcessMesh([0], dim_names=["ep"])
    >>> plan = {"moe": dist.ExpertParallel()}
    >>> model = torch.nn.ModuleDict({"moe": Block()})
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model["moe"].experts.w.placements
    [Shard(0)]
    >>> tuple(model["moe"](dist.shard_tensor(torch.randn(6, 8), mesh, [dist.Shard(0)])).shape)
    (6, 8)
    """

    mesh_dim = None  # "ep", or "dp" without it: `apply` checks the mesh (`expert_dim`)

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        experts = experts_of(layer)
        if experts is None:  # a dense layer the key's wildcard matched too (DeepSeek-V3's first layers)
            return
        ep = mesh.dim_index(expert_dim(mesh))
        check_experts(experts.num_experts, _top_k(layer), mesh, ep, f"ExpertParallel on '{name}'")
        for pname, p in list(experts.named_parameters(recurse=False)):
            convert_in_place(p, shard_tensor(p, mesh, placements_on(p, mesh, **{mesh.dim_names[ep]: Shard(0)})),
                             f"{name}.{pname}")
        experts.forward = _ExpertsForward(experts, ep, name)
        layer.forward = _BlockForward(layer, experts.forward, ep)


class _ExpertsForward:
    """Stands in for an experts module's forward: dispatch, the module's own forward on its
    local experts, combine.  On the distributed tokens, or on this rank's tokens as plain
    tensors while the block runs whole on them (`_BlockForward`: `ranks` set)."""

    def __init__(self, experts: torch.nn.Module, ep: int, name: str):
        self.experts, self.ep, self.name = experts, ep, name
        self.own = type(experts).forward.__get__(experts)
        self.__wrapped__ = self.own
        self.ranks: Optional[tuple] = None  # (this rank's expert group, the mesh) while the block runs whole

    def __call__(self, hidden, top_k_index, top_k_weights):
        experts = self.experts
        if self.ranks is not None and type(hidden) is not DistTensor:  # its parameters are the local pieces now
            check_experts(experts.num_experts, top_k_index.shape[-1], self.ranks[1], self.ep,
                          f"ExpertParallel on '{self.name}'")
            ranks = self.ranks[0]
            return dispatch_combine(hidden, top_k_index, top_k_weights, experts.num_experts, ranks,
                                    lambda rows, local_expert: self._run_local(None, rows, local_expert))
        params = list(experts.parameters(recurse=False))
        if type(hidden) is not DistTensor:
            raise TypeError(f"ExpertParallel on '{self.name}': the tokens must be a distributed tensor on the experts' "
                            f"mesh {params[0].process_mesh}, got a plain {type(hidden).__name__}")
        mesh = params[0]._spec.mesh
        ep = self.ep
        index, weights = (t if type(t) is DistTensor else shard_tensor(t, mesh, hidden.placements, src_data_rank=None)
                          for t in (top_k_index, top_k_weights))
        if hidden._spec.mesh != mesh:
            raise ValueError(f"ExpertParallel on '{self.name}': the tokens live on {hidden._spec.mesh}, the experts on "
                             f"{mesh}")
        check_experts(experts.num_experts, index.shape[-1], mesh, ep, f"ExpertParallel on '{self.name}'")
        return expert_parallel(hidden, index, weights, params, ep, experts.num_experts, self._run_local)

    def _run_local(self, local_params: Optional[list], rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """The experts module's own forward on this rank's experts (its weights' local pieces,
        put in place here unless `local_params` is None: they are there already; `num_experts`
        the local count), each row through one expert at weight 1."""
        experts = self.experts
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        saved = ({n: experts._parameters[n] for n in names}, experts.num_experts)
        if local_params is not None:
            experts._parameters.update(zip(names, local_params))
        experts.num_experts = experts._parameters[names[0]].shape[0]
        try:
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return self.own(rows, local_expert.unsqueeze(-1), ones)
        finally:
            experts._parameters.update(saved[0])
            experts.num_experts = saved[1]


class _BlockForward:
    """Stands in for a MoE block's forward: the whole block runs as plain torch on this rank's
    tokens, its parameters' local pieces in place, the experts call dispatching and combining
    them (one boundary in and out, as a dispatch written by hand), where that gives the
    single process's numbers; elsewhere the block's own forward on the distributed tensors.

    The block is taken to be token-wise: each token's output depends on its own hidden state
    alone, as in HF's MoE blocks (router, experts, shared experts).  It runs whole when
    `block_grad_specs` allows (tokens split over the expert dim, parameters whole but the
    experts), no hook is set on a sub-module or globally (a hook would see the local pieces:
    HF's recorded router logits for the load-balancing loss), no activation checkpointing or
    capture (to_static's) is running, and its first call for these tokens' spec, run op by op,
    drew no random number (Mixtral's jitter noise while training: the draws must be the global
    ones)."""

    def __init__(self, block: torch.nn.Module, experts_forward: _ExpertsForward, ep: int):
        self.block, self.experts_forward, self.ep = block, experts_forward, ep
        self.own = block.__dict__.get("forward") or type(block).forward.__get__(block)
        self.__wrapped__ = self.own
        # (tokens' spec, training, the parameters' specs) -> (gradient specs, expert group, mesh),
        # or None where the block runs on the distributed tensors
        self.plans: dict = {}

    def __call__(self, *args, **kwargs):
        hidden = args[0] if len(args) == 1 and not kwargs else None
        if type(hidden) is not DistTensor or _capturing() or _saved_tensor_hooks() is not None or _global_hooks():
            return self.own(*args, **kwargs)
        modules = list(self.block.modules())
        if any(sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
               for sub in modules[1:]):
            return self.own(hidden)
        slots = [(sub._parameters, n, p) for sub in modules for n, p in sub._parameters.items() if p is not None]
        key = (hidden._spec, self.block.training, *(getattr(p, "_spec", None) for _, _, p in slots))
        plan = self.plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            return self._first_call(hidden, key, slots)
        if plan is None:
            return self.own(hidden)
        buffers = [(sub._buffers, n, b) for sub in modules for n, b in sub._buffers.items() if type(b) is DistTensor]
        return on_pieces(hidden, [p for _, _, p in slots], plan[0],
                         lambda x, local: self._run(x, local, slots, buffers, plan[1]))

    def _first_call(self, hidden: DistTensor, key: tuple, slots: list):
        """The block op by op, and whether later calls with these specs may run it whole."""
        mesh, params = hidden._spec.mesh, [p for _, _, p in slots]
        specs = None
        if get_rank() in mesh and all(type(p) is DistTensor for p in params):
            experts = frozenset(map(id, self.experts_forward.experts.parameters(recurse=False)))
            specs = block_grad_specs(hidden._spec, params, experts, self.ep)
        if specs is None:
            self.plans[key] = None
            return self.own(hidden)
        watch = _RandomDraws()
        with watching(watch):
            out = self.own(hidden)
        self.plans[key] = None if watch.drew else (specs, (mesh.dim_group_of(get_rank(), self.ep), mesh))
        return out

    def _run(self, x, local_params, slots, buffers, ranks):
        pieces = list(zip(slots, local_params)) + [(slot, slot[2]._local) for slot in buffers]
        for (holder, name, _), piece in pieces:
            holder[name] = piece
        self.experts_forward.ranks = ranks
        try:
            return self.own(x)
        finally:
            self.experts_forward.ranks = None
            for holder, name, t in slots + buffers:
                holder[name] = t


_UNSEEN = object()


class _RandomDraws:
    """An op watcher: did a dispatched op draw random numbers?"""

    def __init__(self):
        self.drew = False

    def see(self, func, decision, flat) -> None:
        self.drew = self.drew or func in DRAWS_RANDOM


def _capturing() -> bool:
    """Whether a capture (to_static's) is attached: an ancestor's local-region verification
    does not count (it sees the block's all-to-alls and declines the region)."""
    return any(type(c) is not _Watch for c in active_captures())


def _global_hooks() -> bool:
    """Whether a forward or backward hook is set on every module (torch.nn.modules.module's)."""
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


# -- Paddle's sub-mesh tensors -------------------------------------------------------------------
def _sub_meshes(mesh: ProcessMesh, dim: int) -> list[ProcessMesh]:
    """The slices of `mesh` along `dim`, each keeping every dim name (that one of size 1)."""
    ids = np.array(mesh.process_ids).reshape(mesh.shape)
    return [ProcessMesh(part, mesh.dim_names) for part in np.split(ids, mesh.shape[dim], axis=dim)]


def _sub_placements(placements: Sequence[Placement], dim: int) -> list[Placement]:
    return [Replicate() if k == dim else p for k, p in enumerate(placements)]


def _cut_dim(placements: Sequence[Placement], dim: int, what: str) -> Optional[int]:
    """The tensor dim mesh dim `dim` splits (None: it does not)."""
    p = placements[dim]
    if type(p) is Shard:
        return p.dim
    if type(p) is Replicate:
        return None
    raise ValueError(f"{what}: placement {p} on mesh dim {dim}: only Shard or Replicate can be cut into sub-meshes")


class _SubMeshTensors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, specs, mine):
        ctx.spec, ctx.part_spec, ctx.mine = t._spec, specs[mine], mine
        return tuple(new_dist(t._local.view_as(t._local) if i == mine else t._local.new_empty(0), s)
                     for i, s in enumerate(specs))

    @staticmethod
    def backward(ctx, *grads):
        g = grads[ctx.mine]
        if g is None:
            return None, None, None
        return new_dist(_piece(g, ctx.part_spec), ctx.spec.without_partial()), None, None


def _piece(grad: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """This rank's piece of `grad` placed as `spec` (less Partial)."""
    target = spec.without_partial()
    if type(grad) is not DistTensor:
        return piece_of_full(grad, target)
    return redistribute_local(grad._local, grad._spec, target).contiguous()


def moe_sub_mesh_tensors(dist_tensor: torch.Tensor, global_mesh: Optional[ProcessMesh] = None,
                         local_mesh_dim: Optional[int] = None,
                         global_placements: Optional[Sequence[Placement]] = None) -> list[torch.Tensor]:
    """`dist_tensor` (on `global_mesh` with `global_placements`) as one tensor per slice of the
    mesh along `local_mesh_dim` (Paddle's `moe_sub_mesh_tensors`): slice i holds the part of the
    tensor its ranks hold, placed as before with that mesh dim Replicate.  A rank holds data
    only for its own slice.  No communication; differentiable.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([[0]], dim_names=["ep", "mp"])
    >>> t = dist.shard_tensor(torch.arange(8.).reshape(4, 2), mesh, [dist.Shard(0), dist.Replicate()])
    >>> parts = dist.moe_sub_mesh_tensors(t, mesh, 0, [dist.Shard(0), dist.Replicate()])
    >>> [(p.process_mesh.process_ids, p.placements, tuple(p.shape)) for p in parts]
    [([0], [Replicate(), Replicate()], (4, 2))]
    """
    if global_mesh is None or local_mesh_dim is None or global_placements is None:
        raise ValueError("moe_sub_mesh_tensors needs global_mesh, local_mesh_dim and global_placements")
    what = "moe_sub_mesh_tensors"
    if type(dist_tensor) is not DistTensor or dist_tensor._spec.mesh != global_mesh or \
            list(dist_tensor._spec.placements) != list(global_placements):
        have = (dist_tensor.process_mesh, dist_tensor.placements) if type(dist_tensor) is DistTensor else "a plain tensor"
        raise ValueError(f"{what}: the tensor must be on {global_mesh} with {list(global_placements)}, got {have}")
    dim = local_mesh_dim % global_mesh.ndim
    cut = _cut_dim(global_placements, dim, what)
    spec = dist_tensor._spec
    subs = _sub_meshes(global_mesh, dim)
    placements = _sub_placements(global_placements, dim)
    specs = []
    for i, sub in enumerate(subs):
        shape = list(spec.shape)
        if cut is not None:
            lo, hi = _span_along(spec, dim, i, cut)
            shape[cut] = hi - lo
        specs.append(DistSpec(sub, placements, TensorMeta.contiguous(shape, spec.meta.dtype)))
    coord = global_mesh.coordinate(get_rank())
    mine = coord[dim] if coord is not None else 0
    return list(_SubMeshTensors.apply(dist_tensor, tuple(specs), mine))


def _span_along(spec: DistSpec, dim: int, index: int, cut: int) -> tuple[int, int]:
    """[start, stop) of tensor dim `cut` held by slice `index` of mesh dim `dim`: the union of
    its ranks' pieces (mesh dims nested after `dim` cut within it)."""
    boxes = [spec.block_box(c) for c in np.ndindex(*spec.mesh.shape) if c[dim] == index]
    return min(b[cut][0] for b in boxes), max(b[cut][1] for b in boxes)


class _GlobalMeshTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, mine, count, *parts):
        ctx.spec, ctx.part_spec, ctx.mine, ctx.count = spec, parts[mine]._spec, mine, count
        return new_dist(parts[mine]._local.view_as(parts[mine]._local), spec)

    @staticmethod
    def backward(ctx, grad):
        out = [None] * ctx.count
        out[ctx.mine] = new_dist(_piece(grad, ctx.spec), ctx.part_spec.without_partial())
        return (None, None, None, *out)


def moe_global_mesh_tensor(local_tensor_list: Sequence[torch.Tensor], mesh: ProcessMesh,
                           placements: Sequence[Placement], local_mesh_dim: int = -1) -> torch.Tensor:
    """One tensor on `mesh` with `placements` from one tensor per slice of the mesh along
    `local_mesh_dim` (Paddle's `moe_global_mesh_tensor`, the inverse of `moe_sub_mesh_tensors`):
    each rank's piece is the one it holds in its slice's tensor.  No communication;
    differentiable.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([[0]], dim_names=["ep", "mp"])
    >>> part = dist.shard_tensor(torch.ones(4, 2), mesh, [dist.Replicate(), dist.Replicate()])
    >>> t = dist.moe_global_mesh_tensor([part], mesh, [dist.Shard(0), dist.Replicate()], 0)
    >>> t.placements, tuple(t.shape)
    ([Shard(0), Replicate()], (4, 2))
    """
    what = "moe_global_mesh_tensor"
    dim = local_mesh_dim % mesh.ndim
    subs = _sub_meshes(mesh, dim)
    if len(local_tensor_list) != len(subs):
        raise ValueError(f"{what}: {len(local_tensor_list)} tensors for the {len(subs)} slices of {mesh} along "
                         f"mesh dim {dim}")
    cut = _cut_dim(placements, dim, what)
    sub_placements = _sub_placements(placements, dim)
    parts = []
    for i, (t, sub) in enumerate(zip(local_tensor_list, subs)):
        if type(t) is not DistTensor or t._spec.mesh != sub or list(t._spec.placements) != sub_placements:
            have = (t.process_mesh, t.placements) if type(t) is DistTensor else "a plain tensor"
            raise ValueError(f"{what}: tensor {i} must be on {sub} with {sub_placements}, got {have}")
        parts.append(t)
    shape = list(parts[0].shape)
    if cut is not None:
        shape[cut] = sum(t.shape[cut] for t in parts)
    spec = DistSpec(mesh, tuple(placements), TensorMeta.contiguous(shape, parts[0].dtype))
    coord = mesh.coordinate(get_rank())
    mine = coord[dim] if coord is not None else 0
    return _GlobalMeshTensor.apply(spec, mine, len(parts), *parts)


__all__ = ["ExpertParallel", "expert_dim", "experts_of", "moe_global_mesh_tensor", "moe_sub_mesh_tensors"]
