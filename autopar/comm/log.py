"""comm_log: what collectives this rank ran and how many bytes it sent; `blocked_seconds`:
how long it waited in them."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CommRecord:
    """One collective or transfer run by this rank.

    `bytes` is the payload this rank sent with the bandwidth-optimal algorithm for the op
    (ring all-gather: its shard to each peer; all-reduce: 2(k-1)/k of the tensor;
    reduce-scatter: (k-1)/k of its input; all-to-all: what it sends to the others).
    `recv_bytes` is what it received.  A complex tensor counts the bytes of its (re, im)
    pairs.  A max/min all-reduce whose result holds the winning +inf/-inf is followed by a
    second, of one byte per such place, that tells which were NaN: it is logged as its own
    `all_reduce`.
    """

    op: str
    ranks: tuple
    bytes: int
    recv_bytes: int = 0
    shape: tuple = ()

    def __repr__(self) -> str:
        return f"{self.op}(ranks={list(self.ranks)}, bytes={self.bytes})"


class comm_log:
    """Context manager collecting this rank's communication; iterate it for `CommRecord`s.

    >>> import autopar as dist
    >>> with dist.comm_log() as log:
    ...     pass
    >>> list(log), log.total_bytes()
    ([], 0)
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self) -> "comm_log":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def ops(self) -> list[str]:
        return [r.op for r in self.records]

    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def __repr__(self) -> str:
        return f"comm_log({self.records})"


_ACTIVE: list[comm_log] = []


def record(op: str, ranks: tuple, sent: int, received: int = 0, shape: tuple = ()) -> None:
    if _ACTIVE:
        rec = CommRecord(op, tuple(ranks), int(sent), int(received), tuple(shape))
        for log in _ACTIVE:
            log.records.append(rec)


_BLOCKED = [0.0]


def blocked_seconds() -> float:
    """Seconds this process has spent blocked in transfers (a blocking collective, a wait on a
    started one, a point-to-point wait), since it started: a step's share of communication
    is the difference over the step.  Host time: on a GPU, where NCCL runs on the stream and
    the host does not wait, it counts only the waits the host makes."""
    return _BLOCKED[0]


def blocked_since(start: float) -> None:
    """Count the time since `start` (time.perf_counter()) as blocked in a transfer."""
    _BLOCKED[0] += time.perf_counter() - start
