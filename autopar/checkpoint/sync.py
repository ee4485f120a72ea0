"""The few collectives a checkpoint needs: who am I, and an all-gather of small JSON objects.

Without an initialised process group the program is a world of one and nothing is sent.
Objects travel as JSON bytes in a uint8 tensor (never pickled), over autopar.comm.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.distributed as tdist

from ..comm import all_gather, current_device
from .errors import Problems, raise_agreed


def has_group() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when no process group is running."""
    if has_group():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def all_gather_json(obj, group=None) -> list:
    """Every rank's `obj` (JSON-encodable), in rank order, decoded as JSON on every rank
    (over the job's groups, or over `group`, a host process group of the whole job)."""
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    _, n = world()
    if n == 1:
        return [json.loads(data)]
    gather = functools.partial(all_gather, ranks=tuple(range(n))) if group is None else \
        functools.partial(_all_gather_on, group, n)
    device = current_device() if group is None else torch.device("cpu")
    lengths = gather(torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(x.item()) for x in lengths]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = gather(buf.to(device))
    return [json.loads(bytes(p[:m].cpu().numpy())) for p, m in zip(parts, lengths)]


def _all_gather_on(group, n: int, t: torch.Tensor) -> list:
    out = torch.empty(n * t.numel(), dtype=t.dtype)
    group._allgather_base(out, t).wait()
    return list(out.chunk(n))


def agree(problems: Problems, what: str, consequence: str, data=None, on_failure=None, group=None) -> list:
    """All ranks exchange their problems (and `data`); raise the same error everywhere if any
    rank had one, else return every rank's `data`.  Also a barrier.  `group`: see
    `all_gather_json`.

    `on_failure()` runs first when some rank failed, and every rank waits until all have run
    it before raising, so the cleanup is done by the time any rank sees the error."""
    gathered = all_gather_json({"problems": problems.items, "data": data}, group)
    per_rank = [g["problems"] for g in gathered]
    if on_failure is not None and any(per_rank):
        try:
            on_failure()
        finally:
            all_gather_json(None, group)
    raise_agreed(per_rank, what, consequence)
    return [g["data"] for g in gathered]
