"""The pipeline's errors are raised on every rank together, never on one while others wait.

A rank that finds a problem (bad input, a stage's output that changed shape, an exception in
a stage's module) records it instead of raising; at the next agreement point every rank of
the group learns all problems and raises the same error.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from .. import comm
from ..placement import ReduceType


class Problem:
    """What went wrong on this rank: the error type to raise and its message."""

    __slots__ = ("kind", "message", "cause")

    def __init__(self, message: str, cause: Optional[BaseException] = None):
        self.kind = "ValueError" if cause is None or isinstance(cause, ValueError) else type(cause).__name__
        self.message, self.cause = message, cause


def gather_text(text: str, ranks: tuple) -> list[str]:
    """Every rank's `text`, in the order of `ranks` (collective over them)."""
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    device = comm.current_device()
    sizes = comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), ranks)
    sizes = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(sizes + [1]), dtype=torch.uint8)
    buf[: data.numel()] = data
    parts = comm.all_gather(buf.to(device), ranks)
    return [bytes(p[:n].cpu().numpy()).decode("utf-8") for p, n in zip(parts, sizes)]


def agree(problem: Optional[Problem], ranks: tuple, what: str) -> None:
    """Raise on every rank of `ranks` if any had a problem (one small all-reduce otherwise).

    The error is a ValueError when every problem is one (bad input), else a RuntimeError;
    the rank where an exception happened raises with it as the cause.
    """
    if len(ranks) > 1:
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=comm.current_device())
        if not int(comm.all_reduce(flag, ranks, ReduceType.MAX).item()):
            return
        mine = "" if problem is None else json.dumps({"kind": problem.kind, "message": problem.message})
        found = [(r, json.loads(t)) for r, t in zip(ranks, gather_text(mine, ranks)) if t]
    elif problem is None:
        return
    else:
        found = [(ranks[0], {"kind": problem.kind, "message": problem.message})]
    lines = "\n".join(f"  [rank {r}] {p['message']}" for r, p in found)
    error = ValueError if all(p["kind"] == "ValueError" for _, p in found) else RuntimeError
    raise error(f"{what} failed:\n{lines}") from (problem.cause if problem is not None else None)
