"""Asynchronous point-to-point transfers: a pipeline posts them and computes while they move.

`isend`/`irecv` return at once with a `P2PWork`; `wait()` blocks until the bytes have moved.
Each goes over a *channel*: a 2-rank group of its own per name (`backend.channel_group`), so
the messages of one stage edge are matched in posting order on every backend and never
taken for another edge's.  Both are recorded in `comm_log` when posted (`send` / `recv`).

`deferred_sends()` lets the cross-mesh transfers of an annotated model (`exchange`, which
`reshard` calls) return once their receives are done, without waiting for their sends: a
pipeline running micro-batches in different orders on different ranks would otherwise
deadlock (a gloo or NCCL send completes only when the peer posts its receive).
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
import torch.distributed as tdist

from .backend import SIMULATING, CommError, channel_group, get_rank
from .collectives import _nbytes, _real, _sendable, send_recv
from .log import blocked_since, record
from .fake import received
from .observers import capture_running


class P2PWork:
    """One posted send or receive; `wait()` returns its tensor once the transfer is done."""

    __slots__ = ("work", "op", "peer", "tensor", "channel")

    def __init__(self, work, op: str, peer: int, tensor: torch.Tensor, channel: str):
        self.work, self.op, self.peer, self.tensor, self.channel = work, op, peer, tensor, channel

    def wait(self) -> torch.Tensor:
        work, self.work = self.work, None
        if work is not None:
            start = time.perf_counter()
            try:
                work.wait()
            except RuntimeError as e:
                direction = "to" if self.op == "send" else "from"
                raise CommError(
                    f"{self.op} {direction} rank {self.peer} on channel {self.channel!r} failed on rank {get_rank()}: "
                    f"{e}. The peer may have crashed or not reached this transfer (timeout: AUTOPAR_TIMEOUT)."
                ) from e
            blocked_since(start)
            if SIMULATING[0] and self.op == "recv":
                received(self.tensor)
        return self.tensor

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _pair(me: int, peer: int) -> tuple:
    return (me, peer) if me < peer else (peer, me)


def isend(t: torch.Tensor, dst: int, channel: str) -> P2PWork:
    """Start sending `t` (contiguous; keep it unchanged until `wait`) to global rank `dst`."""
    me = get_rank()
    ranks = _pair(me, dst)
    work = channel_group(ranks, channel).send([_real(t)], ranks.index(dst), 0)
    record("send", (me, dst), _nbytes(t), 0, tuple(t.shape))
    return P2PWork(work, "send", dst, t, channel)


def irecv(buf: torch.Tensor, src: int, channel: str) -> P2PWork:
    """Start receiving into `buf` (contiguous) from global rank `src`."""
    me = get_rank()
    ranks = _pair(me, src)
    work = channel_group(ranks, channel).recv([_real(buf)], ranks.index(src), 0)
    record("recv", (src, me), 0, _nbytes(buf), tuple(buf.shape))
    return P2PWork(work, "recv", src, buf, channel)


class SendWindow:
    """The open `deferred_sends()`: sends in flight, and the seconds spent posting them and
    waiting for receives (what a pipeline reports as sending and idle time)."""

    def __init__(self):
        self.pending: list = []  # (work, dst, tensor): the tensor stays referenced until sent
        self.send_seconds = 0.0
        self.recv_seconds = 0.0

    def finish(self) -> None:
        t0 = time.perf_counter()
        for work, dst, _tensor in self.pending:
            try:
                work.wait()
            except RuntimeError as e:
                raise CommError(f"send to rank {dst} failed on rank {get_rank()}: {e}") from e
        self.pending.clear()
        self.send_seconds += time.perf_counter() - t0
        blocked_since(t0)


_DEFERRED: list[SendWindow] = []  # the open windows, innermost last


@contextlib.contextmanager
def deferred_sends():
    """Within: `exchange` returns without waiting for its sends; they are waited at exit."""
    window = SendWindow()
    _DEFERRED.append(window)
    try:
        yield window
    finally:
        _DEFERRED.pop()
        window.finish()


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
    """`send_recv`, except that inside `deferred_sends()` the sends are only posted: the call
    returns when the receives are done (a captured program records the blocking form)."""
    if not _DEFERRED or capture_running():
        send_recv(sends, recvs)
        return
    window, me = _DEFERRED[-1], get_rank()
    t0 = time.perf_counter()
    for t, dst in sends:
        t = _sendable(t)
        window.pending.append((tdist.isend(_real(t), dst), dst, t))
        record("send", (me, dst), _nbytes(t), 0, tuple(t.shape))
    t1 = time.perf_counter()
    window.send_seconds += t1 - t0
    if recvs:
        ops = [tdist.P2POp(tdist.irecv, _real(buf), src) for buf, src in recvs]
        for buf, src in recvs:
            record("recv", (src, me), 0, _nbytes(buf), tuple(buf.shape))
        start = time.perf_counter()
        try:
            for work in tdist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as e:
            raise CommError(f"receive from ranks {[s for _, s in recvs]} failed on rank {me}: {e}") from e
        blocked_since(start)
        if SIMULATING[0]:
            for buf, _ in recvs:
                received(buf)
        window.recv_seconds += time.perf_counter() - t1
