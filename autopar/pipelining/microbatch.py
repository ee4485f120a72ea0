"""Cutting a batch into equal micro-batches along dim 0.

A plain tensor is cut like `torch.chunk`.  A distributed tensor is cut piece by piece: each
rank cuts its own rows, so a batch split over data-parallel ranks stays split without a
transfer (micro-batch i holds the i-th part of every rank's rows: the mean over the
micro-batches is still the mean over the batch).  Every rank checks the same global shapes,
so a batch that does not cut evenly fails on every rank alike.
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import get_rank
from ..tensor.dtensor import DistTensor, new_dist
from ..spec import DistSpec, TensorMeta


def _cut_spec(spec: DistSpec, m: int) -> DistSpec:
    shape = (spec.meta.shape[0] // m,) + tuple(spec.meta.shape[1:])
    return DistSpec(spec.mesh, spec.placements, TensorMeta.contiguous(shape, spec.meta.dtype))


def check_cut(t: torch.Tensor, m: int, what: str) -> None:
    """Raise ValueError unless `t` cuts into `m` equal micro-batches (for a distributed tensor:
    every rank's piece, into the pieces of the micro-batch).

    >>> check_cut(torch.zeros(6, 2), 4, "x")
    Traceback (most recent call last):
    ...
    ValueError: x of shape [6, 2] does not split into 4 equal micro-batches along dim 0 (6 rows)
    """
    if t.dim() == 0 or t.shape[0] % m:
        rows = f"{t.shape[0]} rows" if t.dim() else "a scalar"
        raise ValueError(f"{what} of shape {list(t.shape)} does not split into {m} equal micro-batches along dim 0 ({rows})")
    if type(t) is DistTensor:
        spec, cut = t._spec, _cut_spec(t._spec, m)
        for rank in spec.mesh.process_ids:
            coord = spec.mesh.coordinate(rank)
            rows, want = spec.local_shape(coord)[0], cut.local_shape(coord)[0]
            if rows != want * m:
                raise ValueError(
                    f"{what} of shape {list(t.shape)} placed {list(spec.placements)} on {spec.mesh}: rank {rank} "
                    f"holds {rows} rows, which do not cut into {m} micro-batches of {want} rows; use a batch size "
                    f"that is a multiple of {m} times the number of pieces"
                )


def cut(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    """`t` in `m` micro-batches along dim 0 (`check_cut` first)."""
    if type(t) is not DistTensor:
        return list(t.chunk(m))
    spec = _cut_spec(t._spec, m)
    local = t._local
    if get_rank() not in spec.mesh:  # off the mesh: an empty piece
        return [new_dist(local, spec) for _ in range(m)]
    return [new_dist(piece, spec) for piece in local.chunk(m)]


def split_batch(batch: Any, m: int, what: str) -> list[tuple]:
    """`batch` (a tensor or a tuple/list of tensors) as `m` tuples of micro-batch tensors."""
    items = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    for n, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{n}] is a {type(t).__name__}; the pipeline cuts tensors into micro-batches")
        check_cut(t, m, what if len(items) == 1 else f"{what}[{n}]")
    pieces = [cut(t, m) for t in items]
    return [tuple(p[i] for p in pieces) for i in range(m)]
