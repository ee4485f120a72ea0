"""Who watches the transfers, and how they attach: declared interfaces, attached for a scope.

A *capture* sees every transfer whole (`to_static`'s program recorder, a local region's
verification and the guard of its trial run; one that overlaps what follows as its post and
its arrival, `comm.inflight`) and every read of values into Python;
a *start observer* hears each collective started to overlap with what follows (the
planner's step recorder).  Nothing else holds them: `capturing(c)` and `observing_starts(o)`
attach one for the `with` block, and `capture_running()` says whether any capture is on.

>>> from autopar.comm import collectives, observers
>>> class Reads(observers.CaptureBase):  # sees value reads; ignores transfers
...     def value_read(self, what):
...         print("read:", what)
>>> with observers.capturing(Reads()):
...     collectives.reading_values("tolist")
...     observers.capture_running()
read: tolist
True
>>> observers.capture_running()
False
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

if TYPE_CHECKING:
    from .collectives import Wire


class TransferCapture(Protocol):
    """Sees each transfer (`collectives.Wire`) and each value read while attached."""

    # True for a capture that records the local ops of the step it watches (`to_static`'s):
    # a module that a module rule vouches for runs as its region then (`runtime.local_region`)
    records_local_ops: bool

    def enter_wire(self) -> None:
        """A transfer starts: the ops it runs itself follow, up to `exit_wire`."""

    def exit_wire(self) -> None:
        """The transfer's own ops are done (also when it raised)."""

    def wire(self, wire: Wire, tensors: tuple) -> None:
        """The transfer went through: `wire(*tensors)` runs it again.  A transfer that overlaps
        what follows comes as two: its post and, later, its arrival (`comm.inflight`)."""

    def value_read(self, what: str) -> None:
        """A distributed tensor's values are about to be read into Python (`what`: how)."""


class CaptureBase:
    """A TransferCapture that ignores everything: subclass it and override what you watch."""

    records_local_ops = False

    def enter_wire(self) -> None:
        pass

    def exit_wire(self) -> None:
        pass

    def wire(self, wire: Wire, tensors: tuple) -> None:
        pass

    def value_read(self, what: str) -> None:
        pass


class StartObserver(Protocol):
    """Hears each collective that starts now and is waited for later (`*_start`)."""

    def started(self, op: str, ranks: tuple) -> None:
        """`op` over `ranks` was posted; comm_log records it at its `wait()`."""


# the attached captures, innermost last, and start observers: changed only by the functions
# below; `collectives` reads them on every transfer (a list's truth is the cheapest check)
_CAPTURES: list[TransferCapture] = []
_STARTS: list[StartObserver] = []


@contextlib.contextmanager
def attached(registry: list, observer) -> Iterator:
    """`observer` in `registry` (innermost last) for the block: how every observer attaches."""
    registry.append(observer)
    try:
        yield observer
    finally:
        registry.remove(observer)


def capturing(capture: TransferCapture) -> contextlib.AbstractContextManager:
    """Attach `capture` for the block."""
    return attached(_CAPTURES, capture)


@contextlib.contextmanager
def capture_paused() -> Iterator[None]:
    """No capture sees the block: what runs once, where it is called, and is no part of a
    captured program (ranks agreeing on a random state)."""
    paused = _CAPTURES[:]
    _CAPTURES.clear()
    try:
        yield
    finally:
        _CAPTURES.extend(paused)


def seen_whole(transfer: Callable, tensors: tuple) -> None:
    """Run `transfer(*tensors)` as one transfer for the attached captures: the ops it runs
    itself are its own (`enter_wire`/`exit_wire` around them), and each capture then sees it
    whole (`wire`)."""
    if not _CAPTURES:
        transfer(*tensors)
        return
    captures = tuple(_CAPTURES)
    for capture in captures:
        capture.enter_wire()
    try:
        transfer(*tensors)
    finally:
        for capture in captures:
            capture.exit_wire()
    for capture in captures:
        capture.wire(transfer, tensors)


def capture_running() -> bool:
    """Whether a capture is attached."""
    return bool(_CAPTURES)


def active_captures() -> tuple:
    """The attached captures, innermost last."""
    return tuple(_CAPTURES)


def observing_starts(observer: StartObserver) -> contextlib.AbstractContextManager:
    """Attach `observer` for the block."""
    return attached(_STARTS, observer)
