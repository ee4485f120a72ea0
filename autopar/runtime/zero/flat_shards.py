"""Many tensors, each cut on one dim over k ranks, moved by one collective.

A reduce-scatter or an all-gather moves k equal chunks, chunk j to or from member j.
`FlatShards` lays a list of tensors out that way: chunk j holds piece j of every tensor (the
rows `split_range(n, k, j)` of the tensor's cut dim, the split rule of `spec.py`), in order,
padded to the largest chunk.  Pack the full tensors for a reduce-scatter and read this
member's pieces from its result; pack this member's pieces for an all-gather and copy every
member's pieces into the full tensors from its result.  When every tensor is cut evenly on
dim 0 the chunks need no padding and a whole bucket packs and unpacks in one op each.
"""
from __future__ import annotations

import functools
import math

import torch

from ...spec import split_range


class FlatShards:
    """The chunk layout of tensors of `shapes`, tensor i cut on dim `dims[i]` over `k` members.

    >>> layout = FlatShards([(4, 2), (3,)], [0, 0], 2)
    >>> flat = layout.pack([torch.arange(8.).reshape(4, 2), torch.tensor([8., 9., 10.])])
    >>> flat.tolist()   # chunk 0: rows 0-1 and items 0-1; chunk 1: rows 2-3, item 2, padding
    [0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 4.0, 5.0, 6.0, 7.0, 10.0, 0.0]
    >>> [p.tolist() for p in layout.pieces_of(flat[6:], 1)]
    [[[4.0, 5.0], [6.0, 7.0]], [10.0]]
    """

    def __init__(self, shapes: list, dims: list, k: int):
        self.shapes, self.dims, self.k = [tuple(s) for s in shapes], list(dims), k
        self.rows = [[split_range(s[d], k, j) for j in range(k)] for s, d in zip(self.shapes, self.dims)]
        self.piece_shapes = [
            [s[:d] + (b - a,) + s[d + 1:] for a, b in rows] for s, d, rows in zip(self.shapes, self.dims, self.rows)
        ]
        self.numels = [[math.prod(shapes[j]) for shapes in self.piece_shapes] for j in range(k)]
        self.chunk = max(sum(n) for n in self.numels)
        self.even = all(d == 0 and s[0] % k == 0 for s, d in zip(self.shapes, self.dims))

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(shapes: tuple, dims: tuple, k: int) -> "FlatShards":
        """The layout, made once per (shapes, dims, k): buckets recur every step."""
        return FlatShards(list(shapes), list(dims), k)

    def pack(self, tensors: list) -> torch.Tensor:
        """The full tensors as k chunks (a reduce-scatter's input)."""
        if self.even:
            return torch.cat([t.reshape(self.k, -1) for t in tensors], dim=1).reshape(-1)
        parts = []
        for j in range(self.k):
            parts += [self._piece(t, i, j).reshape(-1) for i, t in enumerate(tensors)]
            parts += self._padding(tensors[0], j)
        return torch.cat(parts)

    def pack_pieces(self, pieces: list, j: int) -> torch.Tensor:
        """Member j's pieces as its chunk (an all-gather's input)."""
        return torch.cat([p.reshape(-1) for p in pieces] + self._padding(pieces[0], j))

    def pieces_of(self, chunk: torch.Tensor, j: int) -> list:
        """Member j's pieces, views into its chunk (a reduce-scatter's output)."""
        sizes = self.numels[j]
        parts = chunk[: sum(sizes)].split(sizes)
        return [p.view(shapes[j]) for p, shapes in zip(parts, self.piece_shapes)]

    def unpack(self, gathered: torch.Tensor, fulls: list) -> None:
        """Copy every member's pieces from the k chunks (an all-gather's output) into `fulls`."""
        if self.even and all(f.is_contiguous() for f in fulls):
            sizes = self.numels[0]
            torch.split_with_sizes_copy(gathered.view(self.k, -1), sizes, dim=1,
                                        out=[f.view(self.k, -1) for f in fulls])
            return
        for j in range(self.k):
            for i, piece in enumerate(self.pieces_of(gathered[j * self.chunk:(j + 1) * self.chunk], j)):
                self._piece(fulls[i], i, j).copy_(piece)

    def _piece(self, t: torch.Tensor, i: int, j: int) -> torch.Tensor:
        a, b = self.rows[i][j]
        return t.narrow(self.dims[i], a, b - a)

    def _padding(self, like: torch.Tensor, j: int) -> list:
        pad = self.chunk - sum(self.numels[j])
        return [like.new_zeros(pad)] if pad else []
