"""One parameter of a sharded optimizer, its facts held together (FSDP2's FSDPParam).

A `ZeroParam` says where its parameter lives and where the optimizer steps it: its placements
before and after ZeRO shards it over one mesh dim, the shard it is stepped at (ZeRO-1/2: a
view into the local piece of the whole parameter), the local step's stand-ins from the last
step, and under ZeRO-3 the unit that gathers it (with the full Parameter the unit's layers
use).  The optimizer's sharding holds one per parameter in its list, so no table keyed by a
tensor's `id()` can hand a dead parameter's facts to a new tensor that reuses the address.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...comm import get_rank
from ...mesh import ProcessMesh
from ...placement import Replicate, Shard
from ...spec import DistSpec, TensorMeta
from ...tensor.dispatch import storage_key
from ...tensor.dtensor import DistTensor
from ..precision import spec_in


class ZeroParam:
    """A parameter of a sharded optimizer.

    `unsharded` / `sharded`: its placements before and after ZeRO shards mesh dim `mesh_dim`
    (both None when ZeRO leaves it whole: no stage, or no tensor dim to cut); ZeRO-3 shards
    the parameter itself (`in_place`), ZeRO-1/2 step a shard of the whole parameter.  `pair`
    is the local step's (`local_step.py`); `unit`, `gathered`, `gathered_local` and
    `holders` are ZeRO-3's (`zero3.py`): the unit that gathers it, the full Parameter its
    layers use around the unit's run, that Parameter's local piece (storage only while
    gathered), and the (layer parameter dict, attribute) places that hold it.  `master`: under
    a mixed-precision policy, the float32 copy of the piece this rank steps while the
    parameter is held in low precision (`sharding.py`), else None; `master_of`: the
    parameter's local piece and the versions of both when the master last matched it (a
    write through the dispatch bumps the parameter's version, a plain write the piece's).
    """

    __slots__ = ("param", "unsharded", "sharded", "mesh_dim", "in_place", "_view", "_view_key", "pair",
                 "unit", "gathered", "gathered_local", "holders", "master", "master_of", "__weakref__")

    def __init__(self, param: torch.Tensor, unsharded: Optional[DistSpec] = None, sharded: Optional[DistSpec] = None,
                 mesh_dim: Optional[int] = None, in_place: bool = False):
        self.param, self.unsharded, self.sharded, self.mesh_dim, self.in_place = (
            param, unsharded, sharded, mesh_dim, in_place)
        self._view = self._view_key = self.pair = None
        self.unit = self.gathered = self.gathered_local = self.holders = self.master = self.master_of = None

    @property
    def steps_a_shard(self) -> bool:
        """ZeRO-1/2: stepped at this rank's shard of the whole parameter."""
        return self.sharded is not None and not self.in_place

    def step_spec(self) -> Optional[DistSpec]:
        """The placements the gradient and states have at the step (None: a plain parameter
        stepped whole)."""
        if self.steps_a_shard:
            return self.sharded
        p = self.param
        return p._spec if type(p) is DistTensor else None

    def piece(self) -> Optional[tuple]:
        """(step spec, the local tensor stepped), None for a plain parameter stepped whole."""
        if not self.steps_a_shard:
            return whole_piece(self.param)
        local = full_local(self.param)
        key = (storage_key(local, start=True), local.shape, local.stride())  # (the view keeps an old piece alive)
        if key != self._view_key:
            self._view_key, self._view = key, piece_within(local, self.unsharded, self.sharded)
        return self.sharded, self._view

    def step_piece(self) -> Optional[tuple]:
        """What the optimizer steps: `piece()`, or (its spec in float32, the master copy)."""
        piece = self.piece()
        return piece if self.master is None else (spec_in(piece[0], self.master.dtype), self.master)

    def master_matched(self) -> None:
        """The parameter now holds its master's value (cast): note its piece and version."""
        local = full_local(self.param)
        self.master_of = (local, local._version, self.param._version)

    def refresh_master(self) -> None:
        """The parameter was written since the master last matched it (a checkpoint loaded, an
        in-place edit) and holds another value than the master cast: the master takes it, cast
        up.  (Weights loaded with their masters hold the masters' values: those stay exact.)"""
        local = full_local(self.param)
        held, version, outer = self.master_of
        if local is not held or local._version != version or self.param._version != outer:
            piece = self.piece()[1]
            if not torch.equal(piece, self.master.to(piece.dtype)):
                with torch.no_grad():
                    self.master.copy_(piece)
            self.master_matched()

    @property
    def cut_dim(self) -> int:
        """The tensor dim the sharding mesh dim cuts."""
        return self.sharded.placements[self.mesh_dim].dim


def whole_piece(p: torch.Tensor) -> Optional[tuple]:
    """Where a parameter is stepped without ZeRO-1/2: (its spec, its local piece), None when plain."""
    return (p._spec, p._local) if type(p) is DistTensor else None


def full_local(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the whole parameter (a plain one's data)."""
    return p._local if type(p) is DistTensor else p.data


def param_spec(p: torch.Tensor, fallback_mesh: Optional[ProcessMesh]) -> DistSpec:
    """p's placements; a plain parameter is Replicate on `fallback_mesh`."""
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


def piece_within(local: torch.Tensor, outer: DistSpec, inner: DistSpec) -> torch.Tensor:
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
