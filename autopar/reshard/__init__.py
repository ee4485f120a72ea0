"""Reshard: turn a tensor's local piece under one DistSpec into its piece under another.

`plan` picks the steps (pure, cached); `execute` runs them with the fewest bytes;
`cross_mesh` moves data between different meshes with point-to-point transfers.
"""
from __future__ import annotations

import torch

from ..comm import get_rank
from ..spec import DistSpec
from .cross_mesh import cross_mesh
from .execute import run_steps
from .plan import Step, plan, plan_bytes, step_kind

__all__ = ["Step", "plan", "plan_bytes", "redistribute_local", "step_kind"]


def _same_mesh(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    return run_steps(local, src, plan(src, dst), get_rank())


def redistribute_local(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    """This rank's piece of `dst`, given its piece of `src` (collective over the meshes' ranks)."""
    if src.shape != dst.shape or src.meta.dtype != dst.meta.dtype:
        raise ValueError(f"reshard cannot change shape or dtype: {src} -> {dst}")
    rank = get_rank()
    if src.mesh == dst.mesh:
        if rank not in src.mesh:
            return local
        if src.placements == dst.placements:
            return local
        return _same_mesh(local, src, dst)
    if rank not in src.mesh and rank not in dst.mesh:
        return torch.empty(0, dtype=src.meta.dtype, device=local.device)
    return cross_mesh(local, src, dst, rank, _same_mesh)
