"""ProcessMesh: an n-D array of global ranks with named dims."""
from __future__ import annotations

from functools import cached_property
from typing import Iterable, Sequence

import numpy as np


class ProcessMesh:
    """An n-D array of global process ranks; each dim can carry a name.

    Meshes compare equal (and hash) by their rank array and dim names, so the same
    mesh built twice is the same mesh.

    >>> mesh = ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    >>> mesh.shape, mesh.process_ids
    ([2, 3], [2, 4, 5, 0, 1, 3])
    >>> mesh.get_mesh_with_dim("y").shape
    [3, 2]
    >>> mesh[1].process_ids
    [0, 1, 3]
    """

    def __init__(self, mesh, dim_names: Sequence[str] | None = None):
        if isinstance(mesh, ProcessMesh):
            dim_names = dim_names or mesh.dim_names
            mesh = mesh._ids
        try:
            arr = np.array(mesh)
        except Exception:
            raise TypeError(f"ProcessMesh needs a rectangular nested list of int ranks, got {mesh!r}") from None
        if arr.size == 0:
            raise ValueError("ProcessMesh needs at least one rank")
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ProcessMesh ranks must be ints in a rectangular nested list, got {mesh!r}")
        if (arr < 0).any():
            raise ValueError(f"ProcessMesh ranks must be non-negative, got {arr.tolist()}")
        flat = arr.reshape(-1).tolist()
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(f"ProcessMesh {arr.tolist()} lists ranks {dup} more than once")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(arr.ndim)]
        dim_names = list(dim_names)
        if len(dim_names) != arr.ndim or len(set(dim_names)) != len(dim_names):
            raise ValueError(
                f"ProcessMesh of shape {list(arr.shape)} needs {arr.ndim} distinct dim_names, got {dim_names}"
            )
        arr.setflags(write=False)
        self._ids = arr.astype(np.int64)
        self._dim_names = dim_names
        self._key = (tuple(flat), tuple(arr.shape), tuple(dim_names))
        self._hash = hash(self._key)

    # -- description ---------------------------------------------------------------
    @property
    def shape(self) -> list[int]:
        return list(self._ids.shape)

    @property
    def ndim(self) -> int:
        return self._ids.ndim

    @property
    def process_ids(self) -> list[int]:
        return self._process_ids

    @cached_property
    def _process_ids(self) -> list[int]:
        return self._ids.reshape(-1).tolist()

    @cached_property
    def _rank_set(self) -> frozenset:
        return frozenset(self._process_ids)

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def mesh(self) -> np.ndarray:
        return self._ids

    @property
    def size(self) -> int:
        return self._ids.size

    def dim_index(self, dim: int | str) -> int:
        """Mesh dim number for a name or number (negative numbers count from the end)."""
        if isinstance(dim, str):
            if dim not in self._dim_names:
                raise ValueError(f"mesh {self} has no dim named {dim!r} (dims: {self._dim_names})")
            return self._dim_names.index(dim)
        d = dim + self.ndim if dim < 0 else dim
        if not 0 <= d < self.ndim:
            raise ValueError(f"mesh {self} has no dim {dim}")
        return d

    def get_dim_size(self, dim: int | str) -> int:
        return self._ids.shape[self.dim_index(dim)]

    def __contains__(self, rank: int) -> bool:
        return rank in self._rank_set

    def contains(self, rank: int) -> bool:
        return rank in self._rank_set

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """This rank's index in the mesh, or None when the rank is not in it."""
        return self._coords.get(rank)

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        return {int(r): tuple(int(i) for i in idx) for idx, r in np.ndenumerate(self._ids)}

    def dim_groups(self, dim: int | str) -> list[tuple[int, ...]]:
        """All groups of ranks along mesh dim `dim` (one per index of the other dims)."""
        d = self.dim_index(dim)
        moved = np.moveaxis(self._ids, d, -1).reshape(-1, self._ids.shape[d])
        return [tuple(int(r) for r in row) for row in moved]

    def dim_group_of(self, rank: int, dim: int) -> tuple[int, ...]:
        """The ranks along mesh dim `dim` that share `rank`'s other coordinates, in mesh order."""
        return self.group_of(rank, (dim,))

    def group_of(self, rank: int, dims: tuple[int, ...]) -> tuple[int, ...]:
        """The ranks spanning mesh dims `dims` that share `rank`'s other coordinates, in mesh
        order (one collective over them reduces several mesh dims at once)."""
        key = (rank, dims)
        group = self._groups.get(key)
        if group is None:
            coord = list(self._coords[rank])
            for d in dims:
                coord[d] = slice(None)
            group = self._groups[key] = tuple(int(r) for r in self._ids[tuple(coord)].reshape(-1))
        return group

    @cached_property
    def _groups(self) -> dict:
        return {}

    # -- sub-meshes -------------------------------------------------------------------
    def get_mesh_with_dim(self, dim_name: str, index: int | None = None) -> "ProcessMesh":
        """The mesh with `dim_name` moved to the front; with `index`, the sub-mesh at that index."""
        d = self.dim_index(dim_name)
        order = [d] + [i for i in range(self.ndim) if i != d]
        ids = np.transpose(self._ids, order)
        names = [self._dim_names[i] for i in order]
        if index is None:
            return ProcessMesh(ids, names)
        return ProcessMesh(ids[index], names[1:]) if ids.ndim > 1 else ProcessMesh([ids[index]], names)

    def get_submesh_with_dim(self, dim_name: str) -> "ProcessMesh":
        """The 1-D mesh along `dim_name` that contains the current rank."""
        from .comm import get_rank

        rank = get_rank()
        d = self.dim_index(dim_name)
        if rank not in self:
            raise ValueError(f"rank {rank} is not in mesh {self}")
        return ProcessMesh(list(self.dim_group_of(rank, d)), [dim_name])

    def __getitem__(self, index) -> "ProcessMesh":
        if isinstance(index, str):
            return self.get_mesh_with_dim(index)
        if not isinstance(index, tuple):
            index = (index,)
        sub = self._ids[index]
        kept = _kept_dims(index, self.ndim)
        names = [self._dim_names[i] for i in kept]
        if np.ndim(sub) == 0:
            return ProcessMesh([int(sub)], names[:1] or [self._dim_names[-1]])
        return ProcessMesh(sub, names)

    # -- value semantics ---------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessMesh) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ProcessMesh({self._ids.tolist()}, dim_names={self._dim_names})"

    def __reduce__(self):
        return (ProcessMesh, (self._ids.tolist(), self._dim_names))


def _kept_dims(index: tuple, ndim: int) -> list[int]:
    """Which mesh dims survive numpy indexing with `index` (ints drop a dim, slices keep it)."""
    kept, d = [], 0
    for item in index:
        if item is Ellipsis:
            rest = ndim - (len(index) - 1)
            kept.extend(range(d, d + rest))
            d += rest
        elif isinstance(item, slice):
            kept.append(d)
            d += 1
        else:
            d += 1
    kept.extend(range(d, ndim))
    return kept


def as_mesh(mesh: "ProcessMesh | Iterable[int]") -> ProcessMesh:
    return mesh if isinstance(mesh, ProcessMesh) else ProcessMesh(mesh)
