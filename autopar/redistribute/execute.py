"""Carry out planned steps on this rank's local tensor (one function per step kind)."""
from __future__ import annotations

import torch

from .. import comm
from ..placement import Partial, ReduceType, Replicate
from ..spec import DistSpec, split_range
from .plan import Step


def _pieces(block: tuple[int, int], k: int) -> list[tuple[int, int]]:
    """[start, stop) offsets, relative to the block, of its k pieces."""
    length = block[1] - block[0]
    return [split_range(length, k, i) for i in range(k)]


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def all_gather(local, step, ranks, me, pieces):
    d = step.src.dim
    sizes = [b - a for a, b in pieces]
    if d == 0 and len(set(sizes)) == 1:
        return comm.all_gather_into(local, ranks)  # already the concatenation: no copy
    padded = _pad_to(local, d, sizes[0]).contiguous()
    gathered = comm.all_gather(padded.reshape(-1), ranks)
    parts = [g.reshape(padded.shape).narrow(d, 0, n) for g, n in zip(gathered, sizes)]
    return torch.cat(parts, dim=d)


def slice_(local, step, ranks, me, pieces):
    a, b = pieces[me]
    return local.narrow(step.dst.dim, a, b - a).clone()


def all_reduce(local, step, ranks, me, pieces):
    return comm.all_reduce(local, ranks, step.src.reduce_type)


def reduce_scatter(local, step, ranks, me, pieces):
    d = step.dst.dim
    sizes = [b - a for a, b in pieces]
    if d == 0 and len(set(sizes)) == 1:
        return comm.reduce_scatter(local, ranks, step.src.reduce_type)
    chunks = [_pad_to(local.narrow(d, a, b - a), d, sizes[0]) for a, b in pieces]
    flat = torch.cat([c.reshape(-1) for c in chunks])
    out = comm.reduce_scatter(flat, ranks, step.src.reduce_type)
    return out.reshape(chunks[0].shape).narrow(d, 0, sizes[me]).clone()


def all_to_all(local, step, ranks, me, pieces):
    """S(i) -> S(j): send member l the part of my i-piece in l's j-range; glue received parts along i."""
    i, j = step.src.dim, step.dst.dim
    src_pieces, dst_pieces = pieces
    pieces_out = [local.narrow(j, a, b - a) for a, b in dst_pieces]
    send_numels = [p.numel() for p in pieces_out]
    send = torch.empty(sum(send_numels), dtype=local.dtype, device=local.device)
    offset = 0
    for p, n in zip(pieces_out, send_numels):  # pack with one copy
        send[offset:offset + n].view(p.shape).copy_(p)
        offset += n
    recv_shapes = []
    for a, b in src_pieces:
        shape = list(local.shape)
        shape[i] = b - a
        shape[j] = dst_pieces[me][1] - dst_pieces[me][0]
        recv_shapes.append(shape)
    recv_numels = [_numel(s) for s in recv_shapes]
    out = comm.all_to_all(send, send_numels, recv_numels, ranks)
    if i == 0:  # parts arrive stacked along dim 0: already the result
        shape = list(recv_shapes[0])
        shape[0] = sum(s[0] for s in recv_shapes)
        return out.view(shape)
    parts = [p.view(s) for p, s in zip(out.split(recv_numels), recv_shapes)]
    return torch.cat(parts, dim=i)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _identity(dtype: torch.dtype, rt: ReduceType):
    if rt in (ReduceType.SUM, ReduceType.AVG):
        return 0
    if dtype == torch.bool:
        return rt is ReduceType.MIN
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if rt is ReduceType.MAX:
        return float("-inf") if dtype.is_floating_point else info.min
    return float("inf") if dtype.is_floating_point else info.max


def to_partial(local, step, ranks, me, pieces):
    """R -> P: the value stays a valid reduction of the terms with no communication."""
    rt = step.dst.reduce_type
    if rt is ReduceType.SUM and me != 0:
        return torch.zeros_like(local)
    return local


def shard_to_partial(local, step, ranks, me, pieces):
    """S(d) -> P: place my piece in a block filled with the reduction's identity."""
    d, red = step.src.dim, step.dst.reduce_type
    shape = list(local.shape)
    shape[d] = pieces[-1][1]
    out = torch.full(shape, _identity(local.dtype, red), dtype=local.dtype, device=local.device)
    a, b = pieces[me]
    out.narrow(d, a, b - a).copy_(local * len(ranks) if red is ReduceType.AVG else local)
    return out


def repartial(local, step, ranks, me, pieces):
    full = comm.all_reduce(local, ranks, step.src.reduce_type)
    return to_partial(full, step, ranks, me, pieces)


_RUN = {
    "all_gather": all_gather,
    "slice": slice_,
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "to_partial": to_partial,
    "shard_to_partial": shard_to_partial,
    "repartial": repartial,
}


def run_steps(local: torch.Tensor, src: DistSpec, steps: tuple, rank: int) -> torch.Tensor:
    """Apply `steps` (from plan.plan) to this rank's local tensor of `src`."""
    mesh = src.mesh
    coord = mesh.coordinate(rank)
    state = list(src.placements)
    for st in steps:
        if st.also:  # one all-reduce over several mesh dims: no pieces to cut
            local = comm.all_reduce(local, mesh.group_of(rank, st.mesh_dims), st.src.reduce_type)
            for m in st.mesh_dims:
                state[m] = st.dst
            continue
        m = st.mesh_dim
        k = mesh.shape[m]
        ranks = mesh.dim_group_of(rank, m)
        state[m] = Replicate()
        base = DistSpec(mesh, state, src.meta)
        box = base.local_box(coord)
        pieces = _step_pieces(st, box, k)
        local = _RUN[st.kind](local, st, ranks, coord[m], pieces)
        state[m] = st.dst
    return local


def _step_pieces(st: Step, box, k: int):
    """Offsets within the current block of the k pieces the step cuts or glues."""
    dims = [p.dim for p in (st.src, st.dst) if not isinstance(p, (Replicate, Partial))]
    if st.kind == "all_to_all":
        return _pieces(box[st.src.dim], k), _pieces(box[st.dst.dim], k)
    if not dims:
        return None
    return _pieces(box[dims[0]], k)
