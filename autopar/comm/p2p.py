"""Asynchronous point-to-point transfers: a pipeline posts them and computes while they move.

`isend`/`irecv` return at once with a `P2PWork`; `wait()` blocks until the bytes have moved.
Each goes over a *channel*: a 2-rank group of its own per name (`backend.channel_group`), so
the messages of one stage edge are matched in posting order on every backend and never
taken for another edge's.  Both are recorded in `comm_log` when posted (`send` / `recv`); a
captured program holds each as its post and its arrival (`inflight`), and overlaps it as the
eager step did.

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
from .fake import received
from .inflight import Arrival, Post
from .log import blocked_since, record
from .observers import capture_running, seen_whole


class _PointPost(Post):
    """A send's or receive's first half: neither counted nor announced as a collective (the
    two sides' rank lists differ), logged when posted."""

    __slots__ = ("peer", "channel")

    def __init__(self, op: str, peer: int, channel: str, t: torch.Tensor):
        me = get_rank()
        pair = _pair(me, peer)
        group, index = channel_group(pair, channel), pair.index(peer)
        if op == "send":
            start, ranks, nbytes = (lambda t: group.send([_real(t)], index, 0)), (me, peer), (_nbytes(t), 0)
        else:
            start, ranks, nbytes = (lambda buf: group.recv([_real(buf)], index, 0)), (peer, me), (0, _nbytes(t))
        super().__init__(op, ranks, start, ((op, ranks) + nbytes + (tuple(t.shape),),))
        self.peer, self.channel = peer, channel

    def counted(self, t) -> int:
        return 0

    def announce(self) -> None:
        pass

    def failed(self, err: RuntimeError):
        direction = "to" if self.op == "send" else "from"
        raise CommError(
            f"{self.op} {direction} rank {self.peer} on channel {self.channel!r} failed on rank {get_rank()}: "
            f"{err}. The peer may have crashed or not reached this transfer (timeout: AUTOPAR_TIMEOUT)."
        ) from err


class _PointArrival(Arrival):
    __slots__ = ()

    def wait(self, work) -> None:
        work.wait()  # (unsliced: a timed gloo send or receive wait closes the pair, see `exits`)

    def simulated(self, tensors: tuple) -> None:
        if self.op == "recv":
            received(tensors[0])


class P2PWork:
    """One posted send or receive; `wait()` returns its tensor once the transfer is done."""

    __slots__ = ("arrival", "tensor")

    def __init__(self, post: _PointPost, tensor: torch.Tensor):
        seen_whole(post, (tensor,))
        self.arrival, self.tensor = _PointArrival(post), tensor

    def wait(self) -> torch.Tensor:
        arrival, self.arrival = self.arrival, None
        if arrival is not None:
            seen_whole(arrival, (self.tensor,))
        return self.tensor

    def is_completed(self) -> bool:
        return self.arrival is None or self.arrival.post.is_completed()


def _pair(me: int, peer: int) -> tuple:
    return (me, peer) if me < peer else (peer, me)


def isend(t: torch.Tensor, dst: int, channel: str) -> P2PWork:
    """Start sending `t` (contiguous; keep it unchanged until `wait`) to global rank `dst`."""
    return P2PWork(_PointPost("send", dst, channel, t), t)


def irecv(buf: torch.Tensor, src: int, channel: str) -> P2PWork:
    """Start receiving into `buf` (contiguous) from global rank `src`."""
    return P2PWork(_PointPost("recv", src, channel, buf), buf)


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
