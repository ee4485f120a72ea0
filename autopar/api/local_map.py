"""Computation on local pieces with declared placements: `local_map` and `LocalLayer`
(Paddle's names).

Some computations are easiest to write for one rank's piece: a routing step, a masked
statistic, a kernel with no rule.  `local_map(fn, out_placements, ...)` runs `fn` on the local
pieces of its distributed arguments and declares what its outputs are: each rank's output is
its piece of a distributed tensor with the given placements (a Partial placement: its term of
a sum).  Nothing is checked or moved: the declaration is the caller's word.  Gradients flow
through: an input's gradient arrives placed as the input was.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..mesh import ProcessMesh
from ..placement import Placement, Shard
from ..spec import DistSpec, TensorMeta
from ..tensor.convert import FromLocal, local_value
from ..tensor.dtensor import DistTensor
from .tensors import dtensor_from_local, reshard


def _mesh_of(tensors: list, process_mesh: Optional[ProcessMesh], what: str) -> Optional[ProcessMesh]:
    meshes = {t._spec.mesh for t in tensors if type(t) is DistTensor}
    if process_mesh is not None:
        meshes.add(process_mesh)
    if len(meshes) > 1:
        raise ValueError(f"{what}: the distributed inputs live on several meshes {sorted(map(str, meshes))}; "
                         f"reshard them onto one")
    return meshes.pop() if meshes else None


def _to_local(args: list, in_placements, mesh, reshard_inputs: bool, what: str) -> list:
    """Each distributed argument's local piece (differentiably), after checking (or, with
    `reshard_inputs`, making) its placements those `in_placements` asks for."""
    if in_placements is not None and len(in_placements) != len(args):
        raise ValueError(f"{what}: {len(in_placements)} in_placements for {len(args)} inputs")
    out = []
    for i, a in enumerate(args):
        want = None if in_placements is None else in_placements[i]
        if type(a) is DistTensor:
            if want is not None and list(a.placements) != list(want):
                if not reshard_inputs:
                    raise ValueError(f"{what}: input {i} is placed {a.placements} on {a.process_mesh}, but "
                                     f"in_placements asks for {list(want)} (pass reshard_inputs=True to move it)")
                a = reshard(a, mesh, want)
            a = local_value(a)
        elif isinstance(a, torch.Tensor) and want is not None:
            raise ValueError(f"{what}: input {i} is a plain tensor, but in_placements asks for {list(want)}; "
                             f"pass a distributed tensor or None")
        out.append(a)
    return out


def _global_shape(local: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> list[int]:
    """The global shape if every piece is as large as this one (as Paddle assumes)."""
    shape = list(local.shape)
    for k, p in enumerate(placements):
        if type(p) is Shard:
            shape[p.dim] *= mesh.shape[k]
    return shape


def _wrap_outputs(out: Any, out_placements: Sequence, mesh: Optional[ProcessMesh], what: str,
                  even: bool) -> Any:
    """`out`'s tensors (flattened) as distributed tensors placed by `out_placements`."""
    flat, tree = tree_flatten(out)
    if len(flat) != len(out_placements):
        raise ValueError(f"{what}: the function returned {len(flat)} outputs, out_placements has {len(out_placements)}")
    wrapped = []
    for i, (o, p) in enumerate(zip(flat, out_placements)):
        if p is None or not isinstance(o, torch.Tensor):
            if p is not None:
                raise ValueError(f"{what}: output {i} is a {type(o).__name__}, not a tensor; its placements must be None")
            wrapped.append(o)
            continue
        if mesh is None:
            raise ValueError(f"{what}: no distributed input to take a mesh from; pass process_mesh")
        if even:
            spec = DistSpec(mesh, tuple(p), TensorMeta.contiguous(_global_shape(o, mesh, p), o.dtype))
            wrapped.append(FromLocal.apply(o, spec))
        else:
            wrapped.append(dtensor_from_local(o, mesh, p))
    return tree_unflatten(wrapped, tree)


def local_map(func: Callable, out_placements: Sequence[Optional[Sequence[Placement]]],
              in_placements: Optional[Sequence[Optional[Sequence[Placement]]]] = None,
              process_mesh: Optional[ProcessMesh] = None, reshard_inputs: bool = False) -> Callable:
    """`func` made to take distributed tensors: it runs on their local pieces, and its outputs
    (flattened, in order) become distributed tensors with `out_placements` (None for an output
    that is not a tensor) on `process_mesh` or the inputs' mesh.  `in_placements` (one list
    or None per positional input) are checked, or with `reshard_inputs` the inputs moved
    there.  Uneven pieces are fine (a sharded output's global shape is found from every
    rank's piece).  Paddle's `dist.local_map`.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["x"])
    >>> def masked_mean(x):  # on this rank's rows: a sum and a count, Partial over "x"
    ...     keep = x > 0
    ...     return (x * keep).sum(), keep.sum()
    >>> f = dist.local_map(masked_mean, [[dist.Partial()], [dist.Partial()]], [[dist.Shard(0)]])
    >>> total, count = f(dist.shard_tensor(torch.tensor([1., -2., 3., 4.]), mesh, [dist.Shard(0)]))
    >>> (total / count).item()
    2.6666667461395264
    """
    what = f"local_map({getattr(func, '__name__', func)!r})"

    def wrapped(*args, **kwargs):
        mesh = _mesh_of(list(args) + list(kwargs.values()), process_mesh, what)
        largs = _to_local(list(args), in_placements, mesh, reshard_inputs, what)
        lkwargs = {k: local_value(v) for k, v in kwargs.items()}
        return _wrap_outputs(func(*largs, **lkwargs), out_placements, mesh, what, even=False)

    wrapped.__name__ = getattr(func, "__name__", "local_map")
    wrapped.__doc__ = getattr(func, "__doc__", None)
    return wrapped


class LocalLayer(torch.nn.Module):
    """A layer whose forward runs on local pieces: calling it hands its forward the local
    piece of every distributed input, and its outputs (flattened, in order) come out as
    distributed tensors, output i with `out_dist_attrs[i]` = (mesh, placements) (every piece
    as large as this rank's; uneven pieces: use `local_map`).  Paddle's `dist.LocalLayer`.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["x"])
    >>> class RowNorms(dist.LocalLayer):
    ...     def forward(self, x):
    ...         return x.norm(dim=-1)
    >>> layer = RowNorms([(mesh, [dist.Shard(0)])])
    >>> y = layer(dist.shard_tensor(torch.ones(4, 9), mesh, [dist.Shard(0)]))
    >>> y.placements, y.tolist()
    ([Shard(0)], [3.0, 3.0, 3.0, 3.0])
    """

    def __init__(self, out_dist_attrs: Sequence[tuple[ProcessMesh, Sequence[Placement]]]):
        super().__init__()
        for i, attr in enumerate(out_dist_attrs):
            if attr is not None and not (len(attr) == 2 and isinstance(attr[0], ProcessMesh)):
                raise TypeError(f"{type(self).__name__}: out_dist_attrs[{i}] must be (ProcessMesh, placements), "
                                f"got {attr!r}")
        self.out_dist_attrs = list(out_dist_attrs)

    def __call__(self, *inputs, **kwargs):
        what = f"{type(self).__name__}"
        largs = [local_value(a) for a in inputs]
        lkwargs = {k: local_value(v) for k, v in kwargs.items()}
        out = super().__call__(*largs, **lkwargs)
        flat, tree = tree_flatten(out)
        if len(flat) != len(self.out_dist_attrs):
            raise ValueError(f"{what}: forward returned {len(flat)} outputs, out_dist_attrs has "
                             f"{len(self.out_dist_attrs)}")
        wrapped = [o if attr is None or not isinstance(o, torch.Tensor) else
                   _wrap_outputs([o], [attr[1]], attr[0], what, even=True)[0]
                   for o, attr in zip(flat, self.out_dist_attrs)]
        return tree_unflatten(wrapped, tree)


__all__ = ["LocalLayer", "local_map"]
