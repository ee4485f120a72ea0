"""Who watches the op dispatch, and how they attach: declared interfaces, never a list to edit.

An *op watcher* sees every dispatched op with the decision taken for it (a local region
verifying a module's first call, `explain`); `watching(w)` attaches one for a `with` block.
A *pending-gradient reducer* (a sharded optimizer) is asked first when a Partial gradient
is about to be reduced for a read, so that it reduces all its pending gradients at once, in
buckets (`clip_grad_norm_` reads every gradient: one collective per bucket, not one per
parameter); `reduce_pending_on_read(r)` registers one for as long as it lives.

>>> import torch, autopar as dist
>>> from autopar.tensor import observers
>>> class Ops:
...     def see(self, func, decision, flat):
...         print(func, decision.out_specs[0].placements)
>>> x = dist.shard_tensor(torch.ones(4), dist.ProcessMesh([0]), [dist.Shard(0)])
>>> with observers.watching(Ops()):
...     y = x * 2
aten.mul.Tensor (Shard(0),)
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Protocol

from torch.utils.hooks import RemovableHandle

from ..comm.observers import attached

if TYPE_CHECKING:
    from .dispatch import Decision
    from .dtensor import DistTensor


class OpWatcher(Protocol):
    """Sees each dispatched op while attached."""

    def see(self, func, decision: Optional[Decision], flat: list) -> None:
        """`func` runs on the tensors `flat` as `decision` says (None: an in-place op on a plain
        tensor, run on the global values)."""


class PendingGradients(Protocol):
    """Holds gradients it reduces in buckets (a sharded optimizer)."""

    def reduce_if_pending(self, t: DistTensor) -> None:
        """`t`, a Partial leaf, is about to be reduced for a read: if it is one of ours, reduce
        it now with all the others (it then holds its reduced piece)."""


# read by `dispatch` on every op (a list's truth is the cheapest check): changed only here
_WATCHERS: list[OpWatcher] = []
# handle id -> weak reference to a PendingGradients, in registration order (an OrderedDict: a
# RemovableHandle refers to it weakly)
_REDUCERS: OrderedDict[int, weakref.ref] = OrderedDict()


def watching(watcher: OpWatcher) -> contextlib.AbstractContextManager:
    """Attach `watcher` for the block."""
    return attached(_WATCHERS, watcher)


def reduce_pending_on_read(reducer: PendingGradients) -> RemovableHandle:
    """Ask `reducer` before a Partial leaf is reduced for a read, until the handle's `remove()`
    or until `reducer` is garbage collected (it is held weakly: nothing is left behind)."""
    handle = RemovableHandle(_REDUCERS)
    key = handle.id
    _REDUCERS[key] = weakref.ref(reducer, lambda _: _REDUCERS.pop(key, None))
    return handle


def before_partial_read(t: DistTensor) -> None:
    """`t`, a Partial leaf, is about to be reduced for a read: each registered reducer first."""
    for ref in list(_REDUCERS.values()):
        reducer = ref()
        if reducer is not None:
            reducer.reduce_if_pending(t)
