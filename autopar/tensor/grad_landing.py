"""Gradients written where their bucket reduces them (DDP's `gradient_as_bucket_view`).

The optimizer's pre-step packs the data-parallel gradients of a bucket into one flat buffer
and all-reduces it (`runtime/grad_reduce.py`).  Once it has done so, it knows the bucket's
layout and leaves a `Landing` on each member parameter; from then on a parameter's first
gradient of a step is written into its slot of the bucket's buffer as it arrives (by a local
region's backward, or by the parameter's gradient hook for gradients computed op by op), so
the next pre-step finds the bucket packed and reduces the buffer in place: no packing, no
unpacking, no new tensors.

A round of slots runs from one pre-step to the next (for a bucket reduced in backward, until
its gradients are let go, at `zero_grad`): within it each slot is written once (a
second gradient of the same parameter, under accumulation, adds to the first as torch does,
outside the buffer).  A new round writes the same buffer again only if nothing outside the
Landing holds any part of it (the gradients handed out last time are gone, no view of it is
kept); otherwise it starts a fresh buffer, so that a gradient someone holds is never written
over.

A bucket whose slots all hold this step's gradients, each its parameter's `.grad`, starts its
all-reduce in place at once, while backward goes on with the earlier layers (DDP's overlap);
the end of that backward waits for it and gives the gradients the placement they were
reduced to, so the pre-step finds nothing to do.  A gradient that arrives for a slot already
written (a weight used in two places, accumulation over micro-batches) waits for the
reduction and makes its value Partial again with no communication (one rank keeps the sum, the
others zeros), so that it adds up as before and the pre-step reduces the total; that bucket
stays with the pre-step from then on, as do buckets holding a weight known to be tied or used
twice (`IN_PARTS`).
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from ..comm import all_reduce_start, get_rank
from ..comm.observers import capture_running
from . import riders
from .backward_end import AtBackwardEnd
from .dispatch import keep_reduced

LANDING = "_grad_landing"  # a parameter's attribute: (its Landing, its slot)
# a parameter's attribute: its gradient comes in parts (a weight tied or used twice, whose
# second part may come after a local region has delivered the first; accumulation over
# micro-batches): its bucket is not reduced in backward
IN_PARTS = "_grad_in_parts"


class Landing:
    """One bucket's flat layout and its current buffer (see the module doc)."""

    __slots__ = ("key", "shapes", "sizes", "numel", "dtype", "device", "slots", "filled", "alone", "reduce", "flight",
                 "riders", "settled")

    def __init__(self, key: tuple, locals_: list):
        self.key = key  # what the layout was learnt from (the pre-step compares it)
        self.shapes = [t.shape for t in locals_]
        self.sizes = [t.numel() for t in locals_]
        self.numel = sum(self.sizes)
        self.dtype, self.device = locals_[0].dtype, locals_[0].device
        self.slots: list = []  # views of the current buffer, one per member
        self.filled: Optional[set] = None  # the slots written this round; None: a new round
        self.alone: tuple = ()  # `_holders` of the current buffer when it was made
        self.reduce: Optional[Reduce] = None  # the bucket's all-reduce, to start in backward
        self.flight = None  # the all-reduce started this round (comm.Pending)
        self.riders: list = []  # sums carried by that all-reduce (`riders`)
        self.settled = False  # the members' gradients hold the reduced values, placed so

    def take(self, i: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        """Slot i for a gradient shaped and typed like `like`, or None where it must not land
        (written already this round, or another layout)."""
        if self.shapes[i] != like.shape or self.dtype != like.dtype:
            return None
        if self.settled and not self._holds(i):
            self.new_round()  # (the gradients reduced in backward were taken: a new step)
        if self.filled is None:
            if not self.slots or _holders(self.slots) != self.alone:
                # (with room for sums riding along, see `riders`)
                buffer = torch.empty(self.numel + riders.SPARE, dtype=self.dtype, device=self.device)
                self.slots = [piece.view(shape)
                              for piece, shape in zip(buffer[:self.numel].split(self.sizes), self.shapes)]
                self.alone = _holders(self.slots)
            self.filled = set()
        elif i in self.filled:
            self.written_again(i)
            return None
        self.filled.add(i)
        if len(self.filled) == len(self.sizes) and self.reduce is not None and self.reduce.early:
            _COMPLETE.append(self)
            _SETTLE.queue()
        return self.slots[i]

    def _holds(self, i: int) -> bool:
        """Parameter i's `.grad` is slot i."""
        p = self.reduce.params[i]()
        return p is not None and p.grad is not None and _is(p.grad._local, self.slots[i])

    def _grads_in_slots(self, specs: list) -> list:
        """Each member's `.grad` where it is its slot placed at `specs`' spec, else None."""
        out = []
        for ref, slot, spec in zip(self.reduce.params, self.slots, specs):
            p = ref()
            g = None if p is None else p.grad
            out.append(g if g is not None and g._spec == spec and _is(g._local, slot) else None)
        return out

    def startable(self) -> bool:
        """Every slot holds this round's gradient, and each is its parameter's `.grad` as
        placed when it landed (not a gradient handed to `autograd.grad`, not replaced; a hook's
        gradient only once autograd has made it `.grad`, which may copy it)."""
        return all(g is not None for g in self._grads_in_slots(self.reduce.specs))  # (`in` would call Tensor.__eq__)

    def _flat(self, spare: int = 0) -> torch.Tensor:
        """The whole buffer the slots tile (and `spare` elements after them)."""
        return self.slots[0].as_strided((self.numel + spare,), (1,), 0)

    def start(self) -> None:
        """Start the bucket's all-reduce, carrying the sums waiting to be taken over its ranks."""
        r = self.reduce
        self.riders = riders.take(r.ranks, self.dtype, r.op)
        flat = self._flat(sum(rider.width for rider in self.riders))
        at = self.numel
        for rider in self.riders:
            flat[at:at + rider.width].copy_(rider.values(self.dtype, self.device))
            rider.carrier = self
            at += rider.width
        self.flight = all_reduce_start(flat, r.ranks, r.op)
        _IN_FLIGHT.append(self)

    def arrive(self) -> None:
        """Wait for the all-reduce in flight; the sums it carried have arrived too."""
        flight, self.flight = self.flight, None
        flight.wait()
        carried, self.riders = self.riders, []
        at = self.numel
        for rider in carried:
            rider.arrived(self.slots[0].as_strided((rider.width,), (1,), at))
            rider.carrier = None
            at += rider.width

    def settle(self) -> None:
        """Wait for the all-reduce; the members' gradients take its placement."""
        self.arrive()
        r = self.reduce
        for g, placed in zip(self._grads_in_slots(r.specs), r.placed):
            if g is not None:
                keep_reduced(g, g._local, placed)
        self.settled = True

    def written_again(self, i: int) -> None:
        """Slot i gets a second gradient this round: if its bucket was reduced early, its
        values go back to Partial (see the module doc) and it is reduced at the pre-step."""
        r = self.reduce
        if r is None or not self._holds(i):
            return  # (a gradient reduced early and dropped: nothing holds it)
        r.params[i]().__dict__[IN_PARTS] = True  # (the next layout learnt leaves it to the pre-step)
        if self.flight is None and not self.settled:
            return
        if self.flight is not None:
            self.arrive()
        for g, spec in zip(self._grads_in_slots(r.placed), r.specs):
            if g is not None:
                keep_reduced(g, g._local, spec)
        if r.ranks[0] != get_rank():  # (the first rank keeps the sum)
            self._flat().zero_()
        self.settled = False
        r.early = False  # (for good: the pre-step reduces this bucket)

    def new_round(self) -> None:
        """The pre-step has taken this round's gradients."""
        self.filled = None
        self.settled = False


class Reduce:
    """A bucket's all-reduce, as the pre-step runs it: its members (weakly), their gradients'
    specs before and after, the ranks, the reduce op, and whether it starts in backward."""

    __slots__ = ("params", "specs", "placed", "ranks", "op", "early")

    def __init__(self, params: list, specs: list, placed: list, ranks: tuple, op, early: bool):
        self.params = [weakref.ref(p) for p in params]
        self.specs, self.placed, self.ranks, self.op = specs, placed, tuple(ranks), op
        self.early = early  # started in backward once its gradients have landed


_COMPLETE: list = []  # landings whose slots all hold this round's gradients, not yet started
_IN_FLIGHT: list = []  # landings whose all-reduce runs, to settle at the end of backward


def start_complete() -> None:
    """Start the all-reduce of every complete bucket whose gradients are all in place (this
    backward settles them when it ends); a bucket not yet startable (a gradient hook's
    gradient becomes `.grad` after the hook) is tried again at the next landing."""
    if not _COMPLETE:
        return
    for landing in list(_COMPLETE):
        if landing.reduce.early and landing.filled is not None and landing.startable():
            _COMPLETE.remove(landing)
            landing.start()


def settle_all() -> None:
    """Start the complete buckets that can start, and settle every bucket in flight (the end
    of a backward; the pre-step, for a backward that raised); the rest are the pre-step's."""
    start_complete()  # (a hook's gradient, the backward's last, is `.grad` by now)
    _COMPLETE.clear()
    while _IN_FLIGHT:
        landing = _IN_FLIGHT.pop(0)
        if landing.flight is not None:
            landing.settle()


# settle_all where each backward that lands a gradient ends (the pre-step settles one that raised)
_SETTLE = AtBackwardEnd(settle_all)


def _holders(slots: list) -> tuple:
    """Who holds a buffer and its slots: each slot's Python references and the storage's
    tensors; equal to the count taken when the buffer was made, only the Landing does."""
    return tuple(map(sys.getrefcount, slots)), torch._C._storage_Use_Count(slots[0].untyped_storage()._cdata)


def _is(local: torch.Tensor, slot: torch.Tensor) -> bool:
    """`local` is `slot` or an alias of it (autograd hands `.grad` a detached alias)."""
    return local is slot or (local.data_ptr() == slot.data_ptr() and local.shape == slot.shape)


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`b` starts where `a` ends, in one storage, both contiguous: two gradients lying one
    after the other in a bucket's buffer."""
    return (a.is_contiguous() and b.is_contiguous() and b.storage_offset() == a.storage_offset() + a.numel()
            and b.untyped_storage()._cdata == a.untyped_storage()._cdata)


def land(params: list, grads: list) -> list:
    """The local gradients `grads` of `params` (None where absent) that have a slot, copied
    into it (one copy for all): the slot in its place, None for the rest (all None while a
    program is captured: it replays its own packing)."""
    if capture_running():
        return [None] * len(grads)
    out, slots, sources = [], [], []
    for p, g in zip(params, grads):
        slot = None
        if g is not None:
            entry = p.__dict__.get(LANDING)
            if entry is not None:
                slot = entry[0].take(entry[1], g)
                if slot is not None:
                    slots.append(slot)
                    sources.append(g)
        out.append(slot)
    if slots:
        torch._foreach_copy_(slots, sources)
    return out


def land_one(attrs: dict, local: torch.Tensor) -> Optional[torch.Tensor]:
    """`land` for one gradient, given its parameter's attribute dict (a gradient hook's)."""
    entry = attrs.get(LANDING)
    if entry is None or capture_running():
        return None
    start_complete()  # (the previous hook's gradient is `.grad` by now)
    slot = entry[0].take(entry[1], local)
    return None if slot is None else slot.copy_(local)
