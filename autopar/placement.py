"""Placements: how a tensor lies along one mesh dimension.

`Replicate` - every rank of that mesh dim holds the whole (sub)tensor;
`Shard(d)` - tensor dim `d` is split across the ranks of that mesh dim;
`Partial(r)` - every rank holds a term; the value is the reduction `r` of all terms;
`StridedShard(d, f)` - tensor dim `d` read as [f, n/f] blocks, the inner part split
  (what merging an outer dim into a sharded one makes, such as attention heads merged into
  the batch for a batched matmul; produced by the view rules, not written by users).
Placements are immutable values: `Shard(0) == Shard(0)` and they hash.
"""
from __future__ import annotations

import enum
from typing import Union


class ReduceType(str, enum.Enum):
    """Reduction that turns the terms of a Partial tensor into its value."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"

    # Paddle spellings, so ported programs read the same.
    kRedSum = "sum"
    kRedAvg = "avg"
    kRedMax = "max"
    kRedMin = "min"

    def __repr__(self) -> str:
        return repr(self.value)

    __str__ = __repr__


class Placement:
    """Base class; use `Replicate()`, `Shard(dim)` or `Partial(reduce_type)`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicated(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Replicate(Placement):
    """Every rank along the mesh dim holds the full tensor.

    >>> Replicate() == Replicate()
    True
    """

    __slots__ = ()

    def is_replicated(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "Replicate()"


class Shard(Placement):
    """Tensor dim `dim` is split over the ranks of the mesh dim.

    Uneven sizes follow numpy's `array_split`: with `n` rows on `k` ranks the first
    `n % k` ranks hold one row more than the rest.

    >>> Shard(1).dim
    1
    """

    __slots__ = ("dim",)

    def __init__(self, dim: int):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {dim!r}")
        object.__setattr__(self, "dim", dim)

    def __setattr__(self, name, value):
        raise AttributeError("placements are immutable")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __reduce__(self):
        return (Shard, (self.dim,))

    def get_dim(self) -> int:
        return self.dim

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("S", self.dim))

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


class StridedShard(Placement):
    """Tensor dim `dim`, read as `split_factor` equal blocks, has each block split alike over
    the ranks of the mesh dim: rank i holds piece i of every block, blocks in order.

    A [b, h] tensor sharded on h, viewed as [b * h], is StridedShard(0, split_factor=b): the
    merged dim of a batched matmul over heads.  Each block must split evenly.

    >>> StridedShard(0, 4)
    StridedShard(0, split_factor=4)
    """

    __slots__ = ("dim", "split_factor")

    def __init__(self, dim: int, split_factor: int):
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def __setattr__(self, name, value):
        raise AttributeError("placements are immutable")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __reduce__(self):
        return (StridedShard, (self.dim, self.split_factor))

    def __eq__(self, other: object) -> bool:
        return type(other) is StridedShard and other.dim == self.dim and other.split_factor == self.split_factor

    def __hash__(self) -> int:
        return hash(("SS", self.dim, self.split_factor))

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, split_factor={self.split_factor})"


class Partial(Placement):
    """Each rank holds a term; the tensor's value is `reduce_type` over the ranks.

    >>> Partial() == Partial("sum")
    True
    >>> Partial("max").reduce_type
    'max'
    """

    __slots__ = ("reduce_type",)

    def __init__(self, reduce_type: Union[str, ReduceType] = ReduceType.SUM):
        try:
            rt = ReduceType(reduce_type)
        except ValueError:
            raise ValueError(
                f"Partial reduce_type must be one of sum/avg/max/min, got {reduce_type!r}"
            ) from None
        object.__setattr__(self, "reduce_type", rt)

    def __setattr__(self, name, value):
        raise AttributeError("placements are immutable")

    def is_partial(self) -> bool:
        return True

    def __reduce__(self):
        return (Partial, (self.reduce_type.value,))

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_type == self.reduce_type

    def __hash__(self) -> int:
        return hash(("P", self.reduce_type.value))

    def __repr__(self) -> str:
        if self.reduce_type is ReduceType.SUM:
            return "Partial()"
        return f"Partial({self.reduce_type.value!r})"


def normalize_placements(placements, ndim_mesh: int, tensor_ndim: int, what: str = "tensor"):
    """Validate user placements and return them as a tuple with non-negative Shard dims."""
    if isinstance(placements, Placement):
        placements = [placements]
    try:
        placements = list(placements)
    except TypeError:
        raise TypeError(f"placements for {what} must be a list of Placement, got {placements!r}") from None
    if len(placements) != ndim_mesh:
        raise ValueError(
            f"{what}: {len(placements)} placements {placements} given for a {ndim_mesh}-D mesh; "
            f"need exactly one per mesh dim"
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"{what}: {p!r} is not a Placement (use Replicate(), Shard(d), Partial())")
        if isinstance(p, Shard):
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise ValueError(
                    f"{what}: {p} is out of range for a {tensor_ndim}-D tensor (placements {placements})"
                )
            p = Shard(d) if d != p.dim else p
        out.append(p)
    return tuple(out)
