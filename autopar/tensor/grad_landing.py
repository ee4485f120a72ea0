"""Gradients written where their bucket reduces them (DDP's `gradient_as_bucket_view`).

The optimizer's pre-step packs the data-parallel gradients of a bucket into one flat buffer
and all-reduces it (`runtime/grad_reduce.py`).  Once it has done so, it knows the bucket's
layout and leaves a `Landing` on each member parameter; from then on a parameter's first
gradient of a step is written into its slot of the bucket's buffer as it arrives (by a local
region's backward, or by the parameter's gradient hook for gradients computed op by op), so
the next pre-step finds the bucket packed and reduces the buffer in place: no packing, no
unpacking, no new tensors.

A round of slots runs from one pre-step to the next: within it each slot is written once (a
second gradient of the same parameter, under accumulation, adds to the first as torch does,
outside the buffer).  A new round writes the same buffer again only if nothing outside the
Landing holds any part of it (the gradients handed out last time are gone, no view of it is
kept); otherwise it starts a fresh buffer, so that a gradient someone holds is never written
over.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from ..comm.observers import capture_running

LANDING = "_grad_landing"  # a parameter's attribute: (its Landing, its slot)


class Landing:
    """One bucket's flat layout and its current buffer (see the module doc)."""

    __slots__ = ("key", "shapes", "sizes", "numel", "dtype", "device", "slots", "filled", "alone")

    def __init__(self, key: tuple, locals_: list):
        self.key = key  # what the layout was learnt from (the pre-step compares it)
        self.shapes = [t.shape for t in locals_]
        self.sizes = [t.numel() for t in locals_]
        self.numel = sum(self.sizes)
        self.dtype, self.device = locals_[0].dtype, locals_[0].device
        self.slots: list = []  # views of the current buffer, one per member
        self.filled: Optional[set] = None  # the slots written this round; None: a new round
        self.alone: tuple = ()  # `_holders` of the current buffer when it was made

    def take(self, i: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        """Slot i for a gradient shaped and typed like `like`, or None where it must not land
        (written already this round, or another layout)."""
        if self.shapes[i] != like.shape or self.dtype != like.dtype:
            return None
        if self.filled is None:
            if not self.slots or _holders(self.slots) != self.alone:
                buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                self.slots = [piece.view(shape) for piece, shape in zip(buffer.split(self.sizes), self.shapes)]
                self.alone = _holders(self.slots)
            self.filled = set()
        elif i in self.filled:
            return None
        self.filled.add(i)
        return self.slots[i]

    def new_round(self) -> None:
        """The pre-step has taken this round's gradients."""
        self.filled = None


def _holders(slots: list) -> tuple:
    """Who holds a buffer and its slots: each slot's Python references and the storage's
    tensors; equal to the count taken when the buffer was made, only the Landing does."""
    return tuple(map(sys.getrefcount, slots)), torch._C._storage_Use_Count(slots[0].untyped_storage()._cdata)


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
    slot = entry[0].take(entry[1], local)
    return None if slot is None else slot.copy_(local)
