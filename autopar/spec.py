"""DistSpec: a mesh, its placements and the global tensor meta; gives local shapes/offsets.

The split rule used everywhere: a tensor dim of size `n` sharded over `k` ranks is cut
like numpy's `array_split` (the first `n % k` pieces are one longer).  When several mesh
dims shard the same tensor dim, the cut is nested in mesh-dim order: the lowest mesh dim
cuts first, the next cuts each piece again.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .mesh import ProcessMesh
from .placement import Partial, Placement, Replicate, Shard, StridedShard


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when `size` items are cut into `parts` (array_split)."""
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def global_shape_of_pieces(mesh: ProcessMesh, placements: Sequence[Placement], pieces: dict) -> tuple[int, ...]:
    """The global shape whose pieces under `placements` are `pieces` ({rank: local shape},
    one per rank of the mesh), or ValueError naming a rank whose piece does not fit: a
    sharded dim is the sum of its pieces along the mesh dims that shard it, which must
    follow the split rule (the first pieces one longer, never shorter); other dims agree.

    >>> mesh = ProcessMesh([0, 1, 2])
    >>> global_shape_of_pieces(mesh, [Shard(0)], {0: (3, 2), 1: (3, 2), 2: (2, 2)})
    (8, 2)
    """
    ranks = mesh.process_ids
    ndims = {len(pieces[r]) for r in ranks}
    if len(ndims) != 1:
        raise ValueError(f"pieces on {mesh} have different numbers of dims: {[pieces[r] for r in ranks]}")
    ndim = ndims.pop()
    shape = []
    for d in range(ndim):
        sharding = [m for m, p in enumerate(placements) if type(p) is Shard and p.dim == d]
        # one rank per distinct coordinate on the sharding mesh dims
        firsts: dict = {}
        for r in ranks:
            coord = mesh.coordinate(r)
            firsts.setdefault(tuple(coord[m] for m in sharding), r)
        shape.append(sum(pieces[r][d] for r in firsts.values()))
    shape = tuple(shape)
    spec = DistSpec(mesh, placements, TensorMeta.contiguous(shape, torch.float32))
    for r in ranks:
        want = spec.local_shape(mesh.coordinate(r))
        if tuple(pieces[r]) != want:
            raise ValueError(
                f"the pieces held on {mesh} with placements {list(placements)} do not form one tensor: rank {r} "
                f"holds {list(pieces[r])}, but a {list(shape)} tensor cut by the split rule (the first pieces one "
                f"longer) gives it {list(want)}; pass the global shape or fix the pieces"
            )
    return shape


def strided_cuts_valid(placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Every StridedShard(d, f) is the last cut of dim d, the Shard cuts of d before it keep
    its blocks whole, and each block splits evenly over its mesh dim."""
    for m, p in enumerate(placements):
        if type(p) is not StridedShard or mesh_shape[m] == 1:
            continue
        n, f, d = shape[p.dim], p.split_factor, p.dim
        if f <= 0 or n % f or (n // f) % mesh_shape[m]:
            return False
        before = 1
        for m2, q in enumerate(placements):
            if mesh_shape[m2] == 1 or type(q) not in (Shard, StridedShard) or q.dim != d or m2 == m:
                continue
            if m2 > m or type(q) is StridedShard:
                return False
            before *= mesh_shape[m2]
        if f % before:
            return False
    return True


class TensorMeta:
    """Global shape, stride and dtype of a distributed tensor."""

    __slots__ = ("shape", "stride", "dtype", "_hash")

    def __init__(self, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype):
        self.shape = tuple(shape)
        self.stride = tuple(stride)
        self.dtype = dtype
        self._hash = hash((self.shape, self.stride, dtype))

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(t.shape, t.stride(), t.dtype)

    @staticmethod
    def contiguous(shape: Sequence[int], dtype: torch.dtype) -> "TensorMeta":
        return TensorMeta(shape, contiguous_strides(shape), dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def dim_order(self) -> tuple[int, ...] | None:
        """Dims from outermost to innermost in memory (None: the plain row-major order).

        A broadcast dim (stride 0, `expand`) has no place in memory: it goes where row-major
        order puts it, just outside the dim after it.  (Sorted by its stride it would land
        innermost, and a piece laid out so would reach kernels with a last dim of stride
        other than 1, which some assume without checking.)

        >>> TensorMeta((2, 3, 4, 5), (20, 0, 5, 1), torch.float32).dim_order()
        (0, 1, 2, 3)
        >>> TensorMeta((4, 5), (1, 4), torch.float32).dim_order()
        (1, 0)
        """
        if self.stride == contiguous_strides(self.shape):
            return None
        n = len(self.shape)
        order = sorted((d for d in range(n) if self.stride[d] != 0), key=lambda d: (-self.stride[d], -self.shape[d]))
        for d in reversed(range(n)):
            if self.stride[d] == 0:
                order.insert(order.index(d + 1) if d + 1 < n else len(order), d)
        return tuple(order)

    def __eq__(self, other):
        return (
            isinstance(other, TensorMeta)
            and self.shape == other.shape
            and self.stride == other.stride
            and self.dtype == other.dtype
        )

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"TensorMeta(shape={list(self.shape)}, dtype={self.dtype})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


_ITEMSIZE: dict = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


class DistSpec:
    """How one logical tensor lies on a mesh: placements per mesh dim plus global meta.

    >>> spec = DistSpec(ProcessMesh([[0, 1], [2, 3]]), (Shard(0), Shard(0)),
    ...                 TensorMeta.contiguous((5, 3), torch.float32))
    >>> spec.local_box((0, 1)), spec.local_box((1, 1))
    ([(2, 3), (0, 3)], [(4, 5), (0, 3)])
    """

    __slots__ = ("mesh", "placements", "meta", "_boxes", "__weakref__")
    _POOL: dict = {}

    def __new__(cls, mesh: ProcessMesh, placements: Sequence[Placement], meta: TensorMeta):
        # one object per distinct spec: the op dispatch compares specs by identity
        key = (mesh, tuple(placements), meta)
        spec = cls._POOL.get(key)
        if spec is None:
            if any(type(p) is StridedShard for p in key[1]) and not strided_cuts_valid(key[1], meta.shape, mesh.shape):
                raise ValueError(f"placements {list(key[1])} on {mesh} do not cut a {list(meta.shape)} tensor into "
                                 f"pieces (a StridedShard must be its dim's last cut, over whole blocks)")
            spec = object.__new__(cls)
            spec.mesh, spec.placements, spec.meta = key
            spec._boxes = {}
            cls._POOL[key] = spec
        return spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    def with_placements(self, placements: Sequence[Placement]) -> "DistSpec":
        return DistSpec(self.mesh, placements, self.meta)

    def same_pieces(self, other: "DistSpec") -> bool:
        """Every rank holds the same local piece under both specs: same mesh and global shape,
        same placements on every mesh dim of size > 1 (a dim of size 1 holds the whole
        tensor whatever its placement says)."""
        if self is other:
            return True
        if self.mesh != other.mesh or self.meta.shape != other.meta.shape:
            return False
        return all(
            a == b or k == 1 for a, b, k in zip(self.placements, other.placements, self.mesh.shape)
        )

    def without_partial(self) -> "DistSpec":
        """The same spec with every Partial mesh dim made Replicate (the reduced value's layout)."""
        if not any(type(p) is Partial for p in self.placements):
            return self
        return self.with_placements([Replicate() if type(p) is Partial else p for p in self.placements])

    def sharding_mesh_dims(self, tensor_dim: int) -> list[int]:
        """Mesh dims that shard `tensor_dim`, in nesting order."""
        return [m for m, p in enumerate(self.placements) if type(p) is Shard and p.dim == tensor_dim]

    def partial_dims(self) -> list[int]:
        return [m for m, p in enumerate(self.placements) if type(p) is Partial]

    def is_replicated(self) -> bool:
        return all(type(p) is Replicate for p in self.placements)

    def num_shards(self, tensor_dim: int) -> int:
        n = 1
        for m in self.sharding_mesh_dims(tensor_dim):
            n *= self.mesh.shape[m]
        return n

    def local_box(self, coord: Sequence[int]) -> list[tuple[int, int]]:
        """[start, stop) per tensor dim of the piece held at mesh coordinate `coord`."""
        if self.strided_dims():
            raise ValueError(f"{self}: a strided piece is not a box; reshard it (to Shard or Replicate) first")
        return self.block_box(coord)

    def block_box(self, coord: Sequence[int]) -> list[tuple[int, int]]:
        """The box the Shard placements cut at `coord` (StridedShard dims left whole: their
        blocks are then split inside it, see `strided_dims`)."""
        coord = tuple(coord)
        box = self._boxes.get(coord)
        if box is None:
            box = [(0, s) for s in self.meta.shape]
            mesh_shape = self.mesh.shape
            for m, p in enumerate(self.placements):
                if type(p) is Shard:
                    lo, hi = box[p.dim]
                    a, b = split_range(hi - lo, mesh_shape[m], coord[m])
                    box[p.dim] = (lo + a, lo + b)
            self._boxes[coord] = box
        return box

    def strided_dims(self) -> list[tuple[int, StridedShard]]:
        """(mesh dim, placement) of every StridedShard on a mesh dim of size > 1.  Each is the
        last cut of its tensor dim: the blocks of the box's extent along it are split evenly."""
        return [(m, p) for m, p in enumerate(self.placements) if type(p) is StridedShard and self.mesh.shape[m] > 1]

    def without_strided(self) -> "DistSpec":
        """The same spec with every StridedShard made Replicate."""
        return self.with_placements([Replicate() if type(p) is StridedShard else p for p in self.placements])

    def as_boxes(self) -> "DistSpec":
        """The same spec with every StridedShard made a plain Shard of its dim: pieces of the
        same sizes that are boxes of the global tensor (what a checkpoint stores)."""
        return self.with_placements([Shard(p.dim) if type(p) is StridedShard else p for p in self.placements])

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        shape = [b - a for a, b in self.block_box(coord)]
        for m, p in self.strided_dims():
            shape[p.dim] //= self.mesh.shape[m]
        return tuple(shape)

    def max_local_numel(self) -> int:
        """Elements in the biggest piece (the first coordinate holds it under array_split)."""
        n = 1
        for s in self.local_shape((0,) * self.mesh.ndim):
            n *= s
        return n

    # equality and hash are object identity (C-level, fast): the pool makes it value equality

    def __reduce__(self):
        return (DistSpec, (self.mesh, self.placements, self.meta))

    def __repr__(self):
        return f"DistSpec({list(self.placements)} on {self.mesh}, shape={list(self.meta.shape)})"
