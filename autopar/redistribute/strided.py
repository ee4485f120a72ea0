"""StridedShard <-> Replicate on one mesh dim: the strided piece is `block` elements out of
every block of the tensor dim, so gathering interleaves the ranks' pieces block by block,
and cutting takes every block's slice.  Other transitions go through Replicate."""
from __future__ import annotations

import torch

from .. import comm
from ..spec import DistSpec, split_range


def _blocks(t: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """`t` with dim `dim` read as [n_blocks, block] (an empty dim: one empty block)."""
    return t.unflatten(dim, (t.shape[dim] // block if block else 1, block))


def cut(full: torch.Tensor, spec: DistSpec, coord) -> torch.Tensor:
    """This coordinate's strided piece of `full`, the piece of `spec.without_strided()`."""
    out = full
    for m, p in spec.strided_dims():
        block = spec.shape[p.dim] // p.split_factor
        lo, hi = split_range(block, spec.mesh.shape[m], coord[m])
        out = _blocks(out, p.dim, block).narrow(p.dim + 1, lo, hi - lo).flatten(p.dim, p.dim + 1)
    return out.contiguous()


def gather(local: torch.Tensor, spec: DistSpec, rank: int) -> torch.Tensor:
    """This rank's piece of `spec.without_strided()`: each strided mesh dim all-gathered and
    the pieces interleaved back into whole blocks (innermost cut first)."""
    out = local
    for m, p in reversed(spec.strided_dims()):
        k = spec.mesh.shape[m]
        piece = spec.shape[p.dim] // p.split_factor // k
        parts = comm.all_gather(out.contiguous(), spec.mesh.dim_group_of(rank, m))
        stacked = torch.stack([_blocks(t, p.dim, piece) for t in parts], dim=p.dim + 1)
        out = stacked.flatten(p.dim + 1, p.dim + 2).flatten(p.dim, p.dim + 1)
    return out
