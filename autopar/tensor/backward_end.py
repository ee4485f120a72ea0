"""Work done where the running backward ends, queued once per backward.

A backward that raises never runs its end-of-backward callbacks, so a flag set when one is
queued and cleared by it would stay set, and every later backward would queue none (its
gradients never settled).  An `AtBackwardEnd` remembers the backward (autograd's graph task)
it is queued on instead: a later backward queues its own, and `abandoned()` tells, outside
any backward, that the one it was queued on raised.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

_NO_BACKWARD = -1  # torch._C._current_graph_task_id() outside any backward


class AtBackwardEnd:
    """`fn()` where the backward that calls `queue()` ends, once however often it calls."""

    __slots__ = ("fn", "task")

    def __init__(self, fn: Callable[[], None]):
        # a method of the object that holds this one, weakly: no cycle keeps the owner alive
        self.fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.task: Optional[int] = None  # the graph task it is queued on, until it runs

    def queue(self) -> None:
        """Queue `fn` on the running backward unless it is queued there already."""
        task = torch._C._current_graph_task_id()
        if self.task != task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def queued(self) -> bool:
        """Queued on a backward that has not ended (or raised: see `abandoned`)."""
        return self.task is not None

    def abandoned(self) -> bool:
        """Queued on a backward that raised: no backward runs now and `fn` never ran."""
        return self.task is not None and torch._C._current_graph_task_id() == _NO_BACKWARD

    def forget(self) -> None:
        """Drop the queue of a backward that raised (its callback will never run)."""
        self.task = None

    def _run(self) -> None:
        self.task = None
        fn = self.fn()
        if fn is not None:
            fn()
