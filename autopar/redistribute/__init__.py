"""Reshard: turn a tensor's local piece under one DistSpec into its piece under another.

`plan` picks the steps (pure, cached); `execute` runs them with the fewest bytes;
`cross_mesh` moves data between different meshes with point-to-point transfers.
"""
from __future__ import annotations

import torch

from ..comm import get_rank
from ..placement import Partial, ReduceType
from ..spec import DistSpec
from . import strided
from .cross_mesh import cross_mesh
from .execute import run_steps
from .plan import Step, plan, plan_bytes, step_kind

__all__ = ["Step", "piece_of_full", "piece_of_replicated", "plan", "plan_bytes", "redistribute_local", "step_kind"]


def piece_of_replicated(full: torch.Tensor, spec: DistSpec, rank: int) -> torch.Tensor:
    """This rank's piece of `spec` when every rank holds the full value (no communication).

    Shards are views into `full`; a Partial(sum) keeps the value on the first coordinate
    and zeros elsewhere (the other reduce kinds keep it everywhere).
    """
    if rank not in spec.mesh:
        return full.new_empty(0)
    coord = spec.mesh.coordinate(rank)
    out = full
    for d, (a, b) in enumerate(spec.block_box(coord)):
        if b - a != full.shape[d]:
            out = out.narrow(d, a, b - a)
    if spec.strided_dims():
        out = strided.cut(out, spec, coord)
    for m, p in enumerate(spec.placements):
        if type(p) is Partial and p.reduce_type is ReduceType.SUM and coord[m] != 0:
            return torch.zeros_like(out)
    return out


def piece_of_full(full: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """This rank's piece of `spec` cut from the full value (no communication), as its own
    storage: a cut piece must not pin the full tensor, each rank holds only its shard.
    Contiguous, as `spec`'s meta says (a strided input, like seq[:, 1:], would otherwise
    make a later view valid on the global meta fail on the local piece)."""
    out = piece_of_replicated(full, spec, get_rank())
    return out.clone(memory_format=torch.contiguous_format) if out.shape != full.shape else out.contiguous()


def _same_mesh(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    return run_steps(local, src, plan(src, dst), get_rank())


def redistribute_local(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    """This rank's piece of `dst`, given its piece of `src` (collective over the meshes' ranks).

    The piece comes out dense in the global tensor's dim order (its meta strides), as a view
    of the global tensor expects: a reshard never changes what a view may do."""
    if src.shape != dst.shape or src.meta.dtype != dst.meta.dtype:
        raise ValueError(f"reshard cannot change shape or dtype: {src} -> {dst}")
    if src.meta.dtype.is_complex:
        _refuse_unordered(src, dst)
    rank = get_rank()
    if src.strided_dims() or dst.strided_dims():
        return _via_whole_blocks(local, src, dst, rank)
    if src.mesh == dst.mesh:
        if rank not in src.mesh:
            return local
        if src.placements == dst.placements:
            return local
        return _laid_out(_same_mesh(local, src, dst), dst)
    if rank not in src.mesh and rank not in dst.mesh:
        return torch.empty(0, dtype=src.meta.dtype, device=local.device)
    out = cross_mesh(local, src, dst, rank, _same_mesh)
    return _laid_out(out, dst) if rank in dst.mesh else out


def _refuse_unordered(src: DistSpec, dst: DistSpec) -> None:
    """A complex tensor has no Partial(max/min) value (torch.amax refuses complex numbers): say
    so naming the placement, before any rank moves anything."""
    for spec in (src, dst):
        for p in spec.placements:
            if isinstance(p, Partial) and p.reduce_type in (ReduceType.MAX, ReduceType.MIN):
                raise TypeError(
                    f"reshard {src} -> {dst}: {p} of a {src.meta.dtype} tensor has no value, complex numbers have "
                    f"no order (torch.amax/amin refuse them); use Partial('sum')/Partial('avg'), or reduce .abs()"
                )


def _via_whole_blocks(local: torch.Tensor, src: DistSpec, dst: DistSpec, rank: int) -> torch.Tensor:
    """A transition from or to StridedShard: its mesh dims gathered to Replicate first (an
    all-gather, as for Shard), the rest resharded as usual, then the strided cut of `dst`
    taken locally."""
    if rank in src.mesh and src.strided_dims():
        local = strided.gather(local, src, rank)
    out = redistribute_local(local, src.without_strided(), dst.without_strided())
    if rank in dst.mesh and dst.strided_dims():
        out = strided.cut(out, dst, dst.mesh.coordinate(rank))
    return out


def _laid_out(local: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """`local` dense in the dim order of `spec`'s strides (a copy only when it is not)."""
    order = spec.meta.dim_order()
    dense = local.permute(order) if order is not None else local
    if dense.is_contiguous():
        return local
    if order is None:
        return local.contiguous()
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return dense.contiguous().permute(inverse)
