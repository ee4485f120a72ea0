"""One rank of an N-rank job, run in this process without any other: `simulate(world_size, rank)`.

Every collective and transfer goes to torch's fake process group, which returns at once and
moves nothing, so the program makes the same decisions it makes in the real job (the
placements, the reshards, the buckets) and `comm_log` records the same collectives with the
same bytes, while the values that come back are meaningless.  Running each rank (or one
rank per distinct role) of a job this way tells what it will send and hold without the
machines: the planner's exact check on small worlds.
"""
from __future__ import annotations

import contextlib
import os

import torch.distributed as tdist

import torch

from . import backend


@contextlib.contextmanager
def simulate(world_size: int, rank: int):
    """Run the body as rank `rank` of a `world_size`-rank job, with no communication.

    >>> import torch, autopar as dist
    >>> with dist.simulate(8, 3), dist.comm_log() as log:
    ...     mesh = dist.ProcessMesh(list(range(8)), dim_names=["dp"])
    ...     t = dist.dtensor_from_local(torch.ones(2, 4), mesh, [dist.Shard(0)], shape=(16, 4))
    ...     full = dist.reshard(t, mesh, [dist.Replicate()])
    >>> full.shape, [(r.op, len(r.ranks), r.bytes) for r in log]
    (torch.Size([16, 4]), [('all_gather', 8, 224)])

    The body must not depend on the values collectives return (a loss read to decide a
    branch gets a meaningless number).  Refused inside a real job.

    The body may build its model and batches on the meta device (`with torch.device("meta"):`,
    `ids.to("meta")`): nothing is allocated or computed, so a rank of a model too big for
    this machine simulates, with the same collectives.  There value reads (`.item()`,
    `bool(t)`, `.tolist()`) read zeros, and a local region's trial run, whose values cannot
    be compared, is taken to agree (as it does on real tensors).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"simulate: rank {rank} is not in a world of {world_size} ranks")
    if tdist.is_initialized():
        raise RuntimeError("simulate: this process already belongs to a real job; simulate from a plain process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    world = tdist.group.WORLD  # meta tensors go to the same fake backend as CPU ones
    world._register_backend(torch.device("meta"), tdist.ProcessGroup.BackendType.CUSTOM,
                            world._get_backend(torch.device("cpu")))
    _forget_job()
    backend.SIMULATING[0] = True
    try:
        yield
    finally:
        backend.SIMULATING[0] = False
        tdist.destroy_process_group()
        _forget_job()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def plausible(op: str, tensors: tuple, logs: tuple) -> None:
    """Give a simulated transfer's outputs values a program can go on with (the fake group
    leaves them as allocated): gathered pieces are copies of this rank's own (shapes a rank
    gathers from its peers agree in an SPMD program), received data is zeros (ids index
    tables), reductions keep this rank's terms."""
    if op == "all_gather":
        out, t = tensors
        out.view((-1,) + tuple(t.shape)).copy_(t.unsqueeze(0).expand((out.numel() // max(t.numel(), 1),) + tuple(t.shape)))
    elif op in ("reduce_scatter", "all_to_all"):
        out, t = tensors
        out.copy_(t.reshape(-1)[: out.numel()].view(out.shape)) if out.numel() <= t.numel() else out.zero_()
    elif op == "send/recv":
        for buf in tensors[len(tensors) - sum(log[0] == "recv" for log in logs):]:
            buf.zero_()


def readable(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor whose values are read (`.item()`, `bool(t)`, `.tolist()`): zeros of its
    shape and dtype, the made-up value a simulation on the meta device reads."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal`, except that meta tensors hold no values to differ: they agree (a local
    region's trial on the meta device is taken to match, as it does on real tensors)."""
    return a.is_meta or b.is_meta or torch.equal(a, b)


def received(buf: torch.Tensor) -> torch.Tensor:
    """A simulated receive's buffer, zeroed (see `plausible`)."""
    return buf.zero_()


def _forget_job() -> None:
    """Drop what this process cached about its job: its rank, groups and decisions."""
    from .. import dispatch

    backend.forget_job()
    dispatch.clear_cache()
