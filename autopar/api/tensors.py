"""Creating, resharding and dissolving distributed tensors (all differentiable)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .. import comm
from ..comm import get_rank, get_world_size
from ..comm.backend import value_read
from ..mesh import ProcessMesh
from ..placement import Partial, Placement, Replicate, normalize_placements
from ..redistribute import piece_of_full, redistribute_local
from ..spec import DistSpec, TensorMeta, global_shape_of_pieces
from ..tensor.convert import FromLocal, distributed_parameter, full_value, local_value, reshard_to
from ..tensor.dtensor import DistTensor


def _check_mesh(mesh: ProcessMesh, what: str) -> None:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{what}: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    world = get_world_size()
    beyond = [r for r in mesh.process_ids if r >= world]
    if beyond:
        raise ValueError(f"{what}: mesh {mesh} names ranks {beyond} but the world has {world} processes")


def _placements(placements, mesh: ProcessMesh, ndim: int, dtype: torch.dtype, what: str) -> tuple:
    """`normalize_placements`, refusing Partial("avg") on an integer or bool tensor: an
    average over ranks of integers is not an integer (it would fail, or truncate, only
    when reduced, far from where it was made)."""
    out = normalize_placements(placements, mesh.ndim, ndim, what)
    if not (dtype.is_floating_point or dtype.is_complex):
        for m, p in enumerate(out):
            if p == Partial("avg"):
                raise ValueError(
                    f"{what}: {p} on mesh dim {m} ('{mesh.dim_names[m]}') of {mesh} needs a floating dtype, the "
                    f"tensor is {dtype}: an average over ranks of integers is not an integer; use a floating "
                    f"dtype, or Partial('sum') and divide later"
                )
    return out


def _piece_from_source(full: torch.Tensor, spec: DistSpec, src: int | None) -> torch.Tensor:
    """This rank's piece of `spec` cut from rank `src`'s `full` (None: from this rank's own
    copy, no communication).  Ranks receive only their pieces, point to point (a broadcast
    when every rank needs the whole); a Partial is then made locally from the value."""
    if src is None or spec.mesh.size == 1:
        return piece_of_full(full, spec)
    flat = spec.without_partial()
    rank = get_rank()
    if flat.is_replicated():
        if rank not in spec.mesh:
            return full.new_empty(0)
        out = full if rank == src else torch.empty(flat.shape, dtype=full.dtype, device=full.device)
        out = comm.broadcast(out, src, tuple(spec.mesh.process_ids))
    else:
        source = DistSpec(ProcessMesh([src]), [Replicate()], flat.meta)
        out = redistribute_local(full if rank == src else full.new_empty(0), source, flat)
    return out if flat is spec else redistribute_local(out, flat, spec)


class _FromFull(torch.autograd.Function):
    """Dense -> distributed, cut from rank `src`'s value; the gradient comes back dense."""

    @staticmethod
    def forward(ctx, full, spec, src):
        return DistTensor(_piece_from_source(full.detach(), spec, src), spec)

    @staticmethod
    def backward(ctx, grad):
        return full_value(grad), None, None


# -- public API ----------------------------------------------------------------------------
def shard_tensor(
    data,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    dtype: torch.dtype | None = None,
    stop_gradient: bool | None = None,
    *,
    src_data_rank: int | None = 0,
) -> torch.Tensor:
    """Distribute `data` over `mesh` with `placements`.

    The value is the data of the mesh's rank `src_data_rank` (an index into
    `mesh.process_ids`, the first rank by default): it sends every other rank of the mesh
    its piece, so data that differs between ranks (a model initialised under per-rank
    seeds, a batch read differently) still gives one consistent tensor.  With
    `src_data_rank=None` every rank cuts its piece from its own `data` without
    communication, which is right only when all ranks hold the same value.
    A Parameter stays a Parameter (trainable, registrable in a Module); a tensor that is part
    of an autograd graph stays differentiable; a DistTensor is resharded.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["x"])
    >>> t = dist.shard_tensor(torch.arange(6.).reshape(2, 3), mesh, [dist.Shard(0)])
    >>> t.placements, tuple(t.shape)
    ([Shard(0)], (2, 3))
    """
    _check_mesh(mesh, "shard_tensor")
    is_param = isinstance(data, torch.nn.Parameter)
    if isinstance(data, DistTensor):
        out = reshard(data, mesh, placements)
        return distributed_parameter(out.detach(), data.requires_grad) if is_param else out
    if not isinstance(data, torch.Tensor):
        if isinstance(data, (np.ndarray, list, tuple, int, float, bool)):
            data = torch.as_tensor(data)
        else:
            raise TypeError(f"shard_tensor needs a tensor, ndarray or list, got {type(data).__name__}")
    _refuse_sparse(data, "shard_tensor")
    if dtype is not None and data.dtype != dtype:
        data = data.to(dtype)
    placements = _placements(placements, mesh, data.dim(), data.dtype, f"shard_tensor of shape {list(data.shape)}")
    spec = DistSpec(mesh, placements, TensorMeta.contiguous(data.shape, data.dtype))
    src = _source_rank(mesh, src_data_rank)
    requires_grad = data.requires_grad if stop_gradient is None else not stop_gradient
    if data.requires_grad and not data.is_leaf:
        return _FromFull.apply(data, spec, src)
    out = DistTensor(_piece_from_source(data.detach(), spec, src), spec, requires_grad=requires_grad and not is_param)
    if is_param:
        return distributed_parameter(out, requires_grad)
    return out


def _refuse_sparse(t: torch.Tensor, what: str) -> None:
    """A sparse or otherwise non-strided tensor has no rows to cut: refused on every rank before
    anything moves (rank 0 sending its pieces while the others failed to receive them left the
    job out of step)."""
    if t.layout != torch.strided:
        raise TypeError(f"{what}: a {t.layout} tensor of shape {list(t.shape)} cannot be split into pieces; "
                        f"pass t.to_dense()")


def _source_rank(mesh: ProcessMesh, index: int | None) -> int | None:
    if index is None:
        return None
    if not isinstance(index, int) or not 0 <= index < mesh.size:
        raise ValueError(f"shard_tensor: src_data_rank={index!r} is not an index into the {mesh.size} ranks of {mesh}")
    return mesh.process_ids[index]


def _gathered_shape(local: torch.Tensor, mesh: ProcessMesh, placements) -> tuple[int, ...]:
    """The global shape the pieces of the mesh's ranks form (a small all-gather over the job:
    every rank, on the mesh or not, needs the global meta)."""
    width = 2 + 32
    if local.dim() > 32:
        raise ValueError(f"dtensor_from_local: a {local.dim()}-D piece needs shape= (32 dims at most inferred)")
    mine = torch.zeros(width, dtype=torch.int64, device=local.device)
    mine[0], mine[1] = int(get_rank() in mesh), local.dim()
    mine[2:2 + local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
    world = tuple(range(get_world_size()))
    rows = comm.all_gather(mine, world) if len(world) > 1 else [mine]
    pieces = {r: tuple(row[2:2 + int(row[1])].tolist()) for r, row in zip(world, rows) if int(row[0])}
    return global_shape_of_pieces(mesh, placements, pieces)


def dtensor_from_local(
    local: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement], shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Wrap each rank's own piece (for Partial: its term) as one distributed tensor.

    The global shape is `shape` when given; otherwise, when some mesh dim shards the tensor,
    it is found from every rank's piece (a small all-gather of their shapes over the job),
    so uneven pieces that follow the split rule work, and pieces that do not fit together
    raise the same error on every rank.  Without sharding, the local shape is the global one.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0])
    >>> dist.dtensor_from_local(torch.ones(2, 2), mesh, [dist.Shard(0)]).shape
    torch.Size([2, 2])
    """
    _check_mesh(mesh, "dtensor_from_local")
    _refuse_sparse(local, "dtensor_from_local")
    placements = _placements(placements, mesh, local.dim(), local.dtype,
                             f"dtensor_from_local of a piece of shape {list(local.shape)}")
    if shape is not None:
        global_shape = list(shape)
    elif any(p.is_shard() and k > 1 for p, k in zip(placements, mesh.shape)):
        global_shape = list(_gathered_shape(local, mesh, placements))
    else:
        global_shape = list(local.shape)
    spec = DistSpec(mesh, placements, TensorMeta.contiguous(global_shape, local.dtype))
    rank = get_rank()
    if rank in mesh and tuple(local.shape) != spec.local_shape(mesh.coordinate(rank)):
        raise ValueError(
            f"dtensor_from_local: rank {rank} holds a piece of shape {list(local.shape)} but {list(placements)} "
            f"on {mesh} of a {global_shape} tensor gives it {list(spec.local_shape(mesh.coordinate(rank)))}"
        )
    if local.requires_grad:
        return FromLocal.apply(local, spec)
    return DistTensor(local, spec)


def dtensor_from_fn(fn: Callable, mesh: ProcessMesh, placements: Sequence[Placement], *args, **kwargs) -> torch.Tensor:
    """Build a distributed tensor by calling a factory `fn` (torch.ones, torch.zeros, ...) for the
    local piece only, so no rank ever holds the full tensor.

    >>> import torch, autopar as dist
    >>> t = dist.dtensor_from_fn(torch.ones, dist.ProcessMesh([0]), [dist.Shard(0)], [4, 2])
    >>> t.local_value().shape
    torch.Size([4, 2])
    """
    _check_mesh(mesh, "dtensor_from_fn")
    probe = _probe(fn, args, kwargs)
    placements = _placements(placements, mesh, probe.dim(), probe.dtype, f"dtensor_from_fn({_name(fn)}) result")
    spec = DistSpec(mesh, placements, TensorMeta.contiguous(probe.shape, probe.dtype))
    rank = get_rank()
    if rank not in mesh:
        return DistTensor(torch.empty(0, dtype=probe.dtype), spec)
    local_shape = list(spec.local_shape(mesh.coordinate(rank)))
    if "size" in kwargs or "shape" in kwargs:
        key = "size" if "size" in kwargs else "shape"
        local = fn(*args, **{**kwargs, key: local_shape})
    elif args and isinstance(args[0], (list, tuple, torch.Size)):
        local = fn(local_shape, *args[1:], **kwargs)
    else:
        local = fn(*local_shape, *args[probe.dim():], **kwargs)
    if spec.partial_dims():
        local = piece_of_full(local, spec.with_placements([p if type(p) is Partial else Replicate() for p in placements]))
    return DistTensor(local, spec, requires_grad=bool(kwargs.get("requires_grad", False)))


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _probe(fn: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """`fn`'s result on the meta device: the global shape and dtype, allocating nothing."""
    need = (f"dtensor_from_fn needs a torch factory like torch.ones, torch.zeros, torch.full or torch.randn, "
            f"taking the shape plus dtype/device keywords (it is called with device='meta' for the global shape, "
            f"then with this rank's shape); {_name(fn)}")
    try:
        probe = fn(*args, **{**kwargs, "device": "meta"})
    except TypeError as err:
        raise TypeError(f"{need} failed with device='meta': {err}") from err
    if not isinstance(probe, torch.Tensor):
        raise TypeError(f"{need} returned {type(probe).__name__}, not a tensor")
    if probe.device.type != "meta":
        raise TypeError(f"{need} ignored device='meta' (it made a whole {list(probe.shape)} tensor on {probe.device})")
    return probe


def reshard(t: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """Move `t` to `placements` on `mesh` (same mesh or another one), differentiably.

    Uses the cheapest collective for each transition (see `autopar.redistribute.plan`); across
    meshes the pieces travel point to point.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0])
    >>> t = dist.shard_tensor(torch.ones(2, 2), mesh, [dist.Shard(0)])
    >>> dist.reshard(t, mesh, [dist.Replicate()]).placements
    [Replicate()]
    """
    _check_mesh(mesh, "reshard")
    if not isinstance(t, DistTensor):
        return shard_tensor(t, mesh, placements)
    placements = _placements(placements, mesh, t.dim(), t.dtype, f"reshard of a tensor of shape {list(t.shape)}")
    return reshard_to(t, DistSpec(mesh, placements, t._spec.meta))


def unshard_dtensor(t: torch.Tensor) -> torch.Tensor:
    """The dense global tensor on every rank; a Parameter stays a Parameter.

    >>> import torch, autopar as dist
    >>> t = dist.shard_tensor(torch.ones(2), dist.ProcessMesh([0]), [dist.Shard(0)])
    >>> dist.unshard_dtensor(t)
    tensor([1., 1.])
    """
    if not isinstance(t, DistTensor):
        return t
    with value_read("unshard_dtensor"):  # a read: collective over the job, on the reads' groups
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(full_value(t.detach()), requires_grad=t.requires_grad)
        return full_value(t)


def is_dist_tensor(t) -> bool:
    """True for a distributed tensor."""
    return isinstance(t, DistTensor)


__all__ = [
    "dtensor_from_fn",
    "dtensor_from_local",
    "full_value",
    "is_dist_tensor",
    "local_value",
    "reshard",
    "shard_tensor",
    "unshard_dtensor",
]
