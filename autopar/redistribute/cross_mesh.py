"""Reshard between two different meshes with point-to-point transfers.

Partial terms are reduced on the source mesh first; then every destination rank receives
each part of its box from exactly one source rank that holds it (itself when it can,
otherwise holders are spread over receivers), so each byte crosses the wire once.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import comm
from ..spec import DistSpec


def _intersect(a, b):
    box = [(max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b)]
    return None if _empty(box) else box


@lru_cache(maxsize=1024)
def transfer_plan(src: DistSpec, dst: DistSpec) -> tuple:
    """(src_rank, dst_rank, global box) for every piece that must reach a destination rank.

    Both specs are partial-free.  Pure function of the specs, so every rank agrees on it.
    """
    holders: dict[tuple, list[int]] = {}
    for r in src.mesh.process_ids:
        box = tuple(src.local_box(src.mesh.coordinate(r)))
        holders.setdefault(box, []).append(r)
    moves = []
    for n, r in enumerate(dst.mesh.process_ids):
        need = dst.local_box(dst.mesh.coordinate(r))
        for box, ranks in holders.items():
            part = _intersect(list(box), need)
            if part is None:
                continue
            sender = r if r in ranks else ranks[n % len(ranks)]
            moves.append((sender, r, tuple(part)))
    return tuple(moves)


def _empty(box) -> bool:
    return any(hi <= lo for lo, hi in box)


def _view(t: torch.Tensor, box, origin) -> torch.Tensor:
    for d, ((lo, hi), (o, _)) in enumerate(zip(box, origin)):
        t = t.narrow(d, lo - o, hi - lo)
    return t


def cross_mesh(local: torch.Tensor, src: DistSpec, dst: DistSpec, rank: int, run_same_mesh) -> torch.Tensor:
    """New local tensor of `dst` for this rank (empty when the rank is not on dst's mesh)."""
    src_flat, dst_flat = src.without_partial(), dst.without_partial()
    if rank in src.mesh and src_flat != src:
        local = run_same_mesh(local, src, src_flat)
    in_src, in_dst = rank in src.mesh, rank in dst.mesh
    my_src_box = src_flat.local_box(src.mesh.coordinate(rank)) if in_src else None
    if in_dst:
        my_dst_box = dst_flat.local_box(dst.mesh.coordinate(rank))
        out = torch.empty([hi - lo for lo, hi in my_dst_box], dtype=src.meta.dtype, device=local.device)
    sends, recvs = [], []
    for sender, receiver, box in transfer_plan(src_flat, dst_flat):
        if sender == rank and receiver == rank:
            _view(out, box, my_dst_box).copy_(_view(local, box, my_src_box))
        elif sender == rank:
            sends.append((_view(local, box, my_src_box).contiguous(), receiver))
        elif receiver == rank:
            target = _view(out, box, my_dst_box)
            # receive straight into the result where that part of it is contiguous
            buf = target if target.is_contiguous() else torch.empty_like(target)
            recvs.append((buf, sender, target))
    comm.exchange(sends, [(b, s) for b, s, _ in recvs])
    for buf, _, target in recvs:
        if buf is not target:
            target.copy_(buf)
    if not in_dst:
        return torch.empty(0, dtype=src.meta.dtype, device=local.device)
    if dst_flat != dst:
        out = run_same_mesh(out, dst_flat, dst)
    return out
