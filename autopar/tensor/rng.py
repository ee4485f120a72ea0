"""Every rank draws random numbers from rank 0's stream.

Distributed random ops (dropout, `rand_like`, initialisers on distributed tensors) draw the
full tensor on every rank and keep their piece: that is the single-process draw only while
every rank's generator is in the same state.  Scripts often seed per rank
(`torch.manual_seed(base + rank)`), so the state is taken from rank 0 once, at the first
distributed random op, and from then on every rank advances it alike.  A shuffled data
loader takes rank 0's generator state before every epoch (`shard_dataloader`).

>>> import torch
>>> from autopar.tensor import rng
>>> rng.agree_with_rank0(torch.Generator().manual_seed(3))   # one rank: nothing to agree on
"""
from __future__ import annotations

import weakref

import torch

from ..comm import broadcast, current_device, get_rank, get_world_size
from ..comm.observers import capture_paused

_AGREED: weakref.WeakSet = weakref.WeakSet()  # generators whose state was taken from rank 0


def agree_with_rank0(generator: torch.Generator) -> None:
    """Set `generator`'s state to rank 0's (collective over the whole job).  Not part of a
    captured program: it runs once, where it is called."""
    world = get_world_size()
    if world == 1:
        return
    state = generator.get_state()
    with capture_paused():
        state = broadcast(state.to(current_device()), 0, tuple(range(world)))
    if get_rank() != 0:
        generator.set_state(state.cpu())


def default_generator(device: torch.device) -> torch.Generator:
    """The generator torch's random ops use on `device` by default."""
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def agree_once(generator: torch.Generator) -> None:
    """At the first distributed random op drawing from `generator`: take rank 0's state."""
    if generator not in _AGREED:
        _AGREED.add(generator)
        agree_with_rank0(generator)


def forget() -> None:
    """The next distributed random op agrees again (tests re-seed between programs)."""
    _AGREED.clear()
