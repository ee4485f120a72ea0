"""Transfers that overlap what follows: posted now, arrived later, each half a step that a
captured program replays where the eager step made it.

`all_reduce_start` and its kin, `isend` and `irecv` run as two calls over the same tensors:
a `Post` hands them to the backend and returns at once, its `Arrival` waits for the bytes,
logs them and finishes the result in place (a division, a local reduction).  Each half runs
through the attached captures as a transfer (`observers.seen_whole`), so `to_static`'s
program holds both at their places and its replay overlaps what the eager step overlapped
(a ring's next key/value block with this block's attention, a gradient bucket's reduction
with the rest of backward).  A program's tensors that both halves name live until the arrival.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .backend import SIMULATING
from .exits import wait_for
from .fake import filling_outputs, plausible
from .faults import enter, fail
from .log import blocked_since, record
from .observers import _STARTS


class Post:
    """A collective's first half: `post(*tensors)` starts it (the input last) over `ranks`;
    the backend's work waits for the `Arrival`."""

    __slots__ = ("op", "ranks", "start", "logs", "seq", "work")
    half = "post "

    def __init__(self, op: str, ranks: tuple, start: Callable, logs: tuple = ()):
        self.op, self.ranks, self.start, self.logs = op, tuple(ranks), start, logs
        self.seq, self.work = 0, None

    def __call__(self, *tensors) -> None:
        self.seq = self.counted(tensors[-1])
        try:
            if SIMULATING[0]:  # the fake group copies the input to the outputs: the transfer's bytes
                with filling_outputs():
                    self.work = self.start(*tensors)
            else:
                self.work = self.start(*tensors)
        except RuntimeError as e:
            self.failed(e)
        for log in self.logs:
            record(*log)
        self.announce()

    def counted(self, t) -> int:
        """This rank counted into the collective (`faults.enter`): its number on the group."""
        return enter(self.op, self.ranks, t)

    def announce(self) -> None:
        for observer in _STARTS:
            observer.started(self.op, self.ranks)

    def failed(self, err: RuntimeError):
        fail(self.op, self.ranks, self.seq, err)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class Arrival:
    """A transfer's second half: `arrival(*tensors)` (the post's tensors) waits for its
    `post`, logs it, then `finish(*tensors)` completes the result in place.  `moved`: how
    many of the last tensors are the transfer's (outputs, input), for a simulation's values."""

    __slots__ = ("post", "logs", "finish", "moved")
    half = "arrive "

    def __init__(self, post: Post, logs: tuple = (), finish: Optional[Callable] = None, moved: int = 2):
        self.post, self.logs, self.finish, self.moved = post, logs, finish, moved

    @property
    def op(self) -> str:
        return self.post.op

    @property
    def ranks(self) -> tuple:
        return self.post.ranks

    def __call__(self, *tensors) -> None:
        work, self.post.work = self.post.work, None
        start = time.perf_counter()
        try:
            self.wait(work)
        except RuntimeError as e:
            self.post.failed(e)
        blocked_since(start)
        if SIMULATING[0]:
            self.simulated(tensors)
        for log in self.logs:
            record(*log)
        if self.finish is not None:
            try:
                self.finish(*tensors)
            except RuntimeError as e:  # a max/min's NaN check moves bytes too
                self.post.failed(e)

    def wait(self, work) -> None:
        wait_for(work, self.ranks, self.post.seq)

    def simulated(self, tensors: tuple) -> None:
        plausible(self.op, tensors[len(tensors) - self.moved:], ())
