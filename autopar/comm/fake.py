"""What a simulated transfer writes, and what a simulated read sees (`autopar.tools.simulate`
runs one rank of a job with torch's fake process group, which moves nothing).

The transfers and reads of the core ask these so that a simulated program goes on with
plausible values; a step's recorder (`autopar.planner.predict`) asks `filling` to leave the
ops that stand for a transfer's bytes out of the rank's own work.
"""
from __future__ import annotations

import contextlib

import torch

from . import backend

_FILLING = [False]  # inside `plausible` or `received`: ops the real rank's transfer does not run


def filling() -> bool:
    """Whether the ops running now fill a simulated transfer's outputs (a step's recorder
    leaves them out: in the real job the transfer writes those bytes, priced as its own)."""
    return _FILLING[0]


@contextlib.contextmanager
def filling_outputs():
    """The ops run inside write a simulated transfer's outputs (the fake group's own copies
    of the input, or `plausible`'s values): see `filling`."""
    _FILLING[0] = True
    try:
        yield
    finally:
        _FILLING[0] = False


def plausible(op: str, tensors: tuple, logs: tuple) -> None:
    """Give a simulated transfer's outputs values a program can go on with (the fake group
    leaves them as allocated): gathered pieces are copies of this rank's own (shapes a rank
    gathers from its peers agree in an SPMD program), received data is zeros (ids index
    tables), and so is a broadcast's on its receivers (the source's values are not here; left
    as allocated they could hold NaNs, which a local region's trial run never matches, or
    not, from one run to the next), reductions keep this rank's terms (a pair's small all-reduce,
    gathered and reduced locally, reduces copies of them)."""
    with filling_outputs():
        _fill(op, tensors, logs)


def _fill(op: str, tensors: tuple, logs: tuple) -> None:
    # a pair's small all-reduce gathers its terms (collectives.gathered_all_reduce): copies too
    if op == "all_gather" or (op == "all_reduce" and len(tensors) == 2):
        out, t = tensors
        out.view((-1,) + tuple(t.shape)).copy_(t.unsqueeze(0).expand((out.numel() // max(t.numel(), 1),) + tuple(t.shape)))
    elif op in ("reduce_scatter", "all_to_all"):
        out, t = tensors
        out.copy_(t.reshape(-1)[: out.numel()].view(out.shape)) if out.numel() <= t.numel() else out.zero_()
    elif op == "broadcast":
        if logs[0][3]:  # this rank received it
            tensors[0].zero_()
    elif op == "send/recv":
        for buf in tensors[len(tensors) - sum(log[0] == "recv" for log in logs):]:
            buf.zero_()


def readable(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose values are read (`.item()`, `bool(t)`, `.tolist()`): under `simulate`
    a meta tensor reads as zeros of its shape and dtype (the made-up value of a simulation
    on the meta device); anything else as it is (torch refuses meta reads elsewhere)."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta and backend.SIMULATING[0] else t


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal`, except that meta tensors hold no values to differ: they agree (a local
    region's trial on the meta device is taken to match, as it does on real tensors)."""
    return a.is_meta or b.is_meta or torch.equal(a, b)


def received(buf: torch.Tensor) -> torch.Tensor:
    """A simulated receive's buffer, zeroed (see `plausible`)."""
    with filling_outputs():
        return buf.zero_()


