"""Synchronous collectives over mesh-ordered rank tuples, each logged and error-wrapped.

Inputs are this rank's local tensors; dim 0 is the exchange dim (callers move the dim
they exchange to the front).  Uneven pieces are the caller's job (pad or use all_to_all).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import AllreduceOptions, AllToAllOptions, BroadcastOptions, ReduceScatterOptions

from ..placement import ReduceType
from .backend import CommError, get_rank, group_for
from .log import record

_TORCH_OP = {
    ReduceType.SUM: tdist.ReduceOp.SUM,
    ReduceType.AVG: tdist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    ReduceType.MAX: tdist.ReduceOp.MAX,
    ReduceType.MIN: tdist.ReduceOp.MIN,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fail(op: str, ranks: Sequence[int], err: Exception):
    raise CommError(
        f"{op} over ranks {list(ranks)} failed on rank {get_rank()}: {err}. "
        f"A peer may have crashed or not reached this collective (timeout: AUTOPAR_TIMEOUT)."
    ) from err


def all_gather_into(t: torch.Tensor, ranks: tuple) -> torch.Tensor:
    """Every member's `t` (all the same shape) concatenated along dim 0, in mesh order."""
    k = len(ranks)
    if k == 1:
        return t
    t = t.contiguous().reshape(t.shape if t.dim() else (1,))
    out = torch.empty((k * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    try:
        group_for(ranks)._allgather_base(out, t).wait()
    except RuntimeError as e:
        _fail("all_gather", ranks, e)
    record("all_gather", ranks, _nbytes(t) * (k - 1), _nbytes(t) * (k - 1), tuple(t.shape))
    return out


def all_gather(t: torch.Tensor, ranks: tuple) -> list[torch.Tensor]:
    """Every member's `t` (all the same shape), in mesh order."""
    if len(ranks) == 1:
        return [t]
    out = all_gather_into(t, ranks)
    return list(out.chunk(len(ranks))) if t.dim() > 0 else [x.reshape(()) for x in out.unbind()]


def all_reduce(
    t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM, inplace: bool = False
) -> torch.Tensor:
    """Reduce `t` over the members; returns the reduced tensor (a new contiguous tensor, or
    `t` itself with `inplace=True` when it is contiguous and the caller owns it)."""
    k = len(ranks)
    if inplace and t.is_contiguous():
        out = t
    else:
        out = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    if k == 1:
        return out
    try:
        opts = AllreduceOptions()
        opts.reduceOp = _TORCH_OP[reduce_type]
        group_for(ranks).allreduce([out], opts).wait()
    except RuntimeError as e:
        _fail("all_reduce", ranks, e)
    if reduce_type is ReduceType.AVG:
        out.div_(k)
    moved = 2 * (k - 1) * _nbytes(out) // k
    record("all_reduce", ranks, moved, moved, tuple(out.shape))
    return out


def reduce_scatter(t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM) -> torch.Tensor:
    """Reduce `t` over the members and return piece i (dim 0 cut in k equal pieces) to member i."""
    k = len(ranks)
    if k == 1:
        return t.clone()
    if t.shape[0] % k:
        raise ValueError(f"reduce_scatter needs dim 0 ({t.shape[0]}) divisible by {k}")
    t = t.contiguous()
    out = torch.empty((t.shape[0] // k,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    if reduce_type in (ReduceType.SUM, ReduceType.AVG):
        try:
            opts = ReduceScatterOptions()
            opts.reduceOp = _TORCH_OP[reduce_type]
            group_for(ranks)._reduce_scatter_base(out, t, opts).wait()
        except RuntimeError as e:
            _fail("reduce_scatter", ranks, e)
        if reduce_type is ReduceType.AVG:
            out.div_(k)
    else:
        # gloo's reduce_scatter only sums: max/min go as all-to-all of pieces + local reduce,
        # which moves the same bytes.
        pieces = _all_to_all_equal(t, ranks)
        red = torch.amax if reduce_type is ReduceType.MAX else torch.amin
        out = red(pieces.reshape((k,) + tuple(out.shape)), dim=0)
    moved = (k - 1) * _nbytes(out)
    record("reduce_scatter", ranks, moved, moved, tuple(t.shape))
    return out


def _all_to_all_equal(t: torch.Tensor, ranks: tuple) -> torch.Tensor:
    out = torch.empty_like(t)
    try:
        group_for(ranks).alltoall_base(out, t, [], [], AllToAllOptions()).wait()
    except RuntimeError as e:
        _fail("all_to_all", ranks, e)
    return out


def all_to_all(t: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], ranks: tuple) -> torch.Tensor:
    """Send rows [sum(send_rows[:j]), ...) of `t` to member j; receive recv_rows[j] rows from j."""
    if len(ranks) == 1:
        return t
    me = ranks.index(get_rank())
    t = t.contiguous()
    out = torch.empty((sum(recv_rows),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    try:
        group_for(ranks).alltoall_base(out, t, list(recv_rows), list(send_rows), AllToAllOptions()).wait()
    except RuntimeError as e:
        _fail("all_to_all", ranks, e)
    row = _row_bytes(t)
    record(
        "all_to_all",
        ranks,
        row * (sum(send_rows) - send_rows[me]),
        row * (sum(recv_rows) - recv_rows[me]),
        tuple(t.shape),
    )
    return out


def _row_bytes(t: torch.Tensor) -> int:
    n = t.element_size()
    for s in t.shape[1:]:
        n *= s
    return n


def broadcast(t: torch.Tensor, src: int, ranks: tuple) -> torch.Tensor:
    """`t` from global rank `src` to every member (in place on the receivers)."""
    if len(ranks) == 1:
        return t
    t = t.contiguous()
    try:
        opts = BroadcastOptions()
        opts.rootRank = ranks.index(src)
        group_for(ranks).broadcast([t], opts).wait()
    except RuntimeError as e:
        _fail("broadcast", ranks, e)
    me = get_rank()
    record("broadcast", ranks, _nbytes(t) * (len(ranks) - 1) if me == src else 0,
           0 if me == src else _nbytes(t), tuple(t.shape))
    return t


def send_recv(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Post all sends (tensor, dst) and receives (buffer, src) at once and wait for them."""
    ops = [tdist.P2POp(tdist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [tdist.P2POp(tdist.irecv, buf, peer) for buf, peer in recvs]
    if not ops:
        return
    peers = sorted({p for _, p in sends} | {p for _, p in recvs})
    try:
        for work in tdist.batch_isend_irecv(ops):
            work.wait()
    except RuntimeError as e:
        _fail("send/recv", [get_rank()] + peers, e)
    me = get_rank()
    for t, peer in sends:
        record("send", (me, peer), _nbytes(t), 0, tuple(t.shape))
    for buf, peer in recvs:
        record("recv", (peer, me), 0, _nbytes(buf), tuple(buf.shape))
