"""Starting the default process group and caching one group per ordered rank tuple."""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket

import torch
import torch.distributed as tdist


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the op and the group."""


def timeout_seconds() -> float:
    """AUTOPAR_TIMEOUT: how long a collective may wait for its peers (seconds, default 300).
    A typo must not turn into a zero or negative timeout that fails every collective at once."""
    raw = os.environ.get("AUTOPAR_TIMEOUT", "300")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(
            f"AUTOPAR_TIMEOUT={raw!r}: expected a positive number of seconds (how long a collective "
            f"waits for its peers, default 300), e.g. AUTOPAR_TIMEOUT=600 or 0.5"
        )
    return seconds


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def _backend() -> str:
    forced = os.environ.get("AUTOPAR_BACKEND")
    if forced:
        return forced
    return "nccl" if torch.cuda.is_available() and tdist.is_nccl_available() else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_initialized() -> None:
    """Start the default process group on first use.

    Under `python -m autopar.launch` (or torchrun) the rendezvous variables are set; a
    plain `python script.py` becomes a world of one.
    """
    if tdist.is_initialized():
        return
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    backend = _backend()
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(current_device())
        kwargs["device_id"] = current_device()
    tdist.init_process_group(backend, timeout=_timeout(), **kwargs)
    from .faults import install_exit_handling

    install_exit_handling()


SIMULATING = [False]  # inside `simulate`: transfers move nothing and their outputs are made up


def destroy_groups() -> None:
    """Tear down autopar's own groups, then the default one, so that no gloo thread is left
    for the interpreter's teardown."""
    shut_down_groups()
    _WHO[0] = None
    tdist.destroy_process_group()


def shut_down_groups() -> None:
    """Shut autopar's own groups down (a peer waiting in one of them fails at once) and make
    the next ones anew (`reset_groups`)."""
    for pg in _GROUPS.values():
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()
    reset_groups()


_WHO: list = [None]  # (rank, world size) of the default group, read once


def _who() -> tuple[int, int]:
    who = _WHO[0]
    if who is None:
        ensure_initialized()
        who = _WHO[0] = (tdist.get_rank(), tdist.get_world_size())
    return who


def get_rank() -> int:
    """This process's global rank (starts the process group if needed).

    >>> import autopar as dist
    >>> dist.get_rank() < dist.get_world_size()
    True
    """
    return _who()[0]


def get_world_size() -> int:
    """Number of processes in the job (starts the process group if needed)."""
    return _who()[1]


def current_device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if torch.cuda.is_available() and _backend() == "nccl":
        devices = os.environ.get("AUTOPAR_DEVICES")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        index = int(devices.split(",")[local]) if devices else local
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


_GROUPS: dict[tuple, object] = {}
_GENERATION = [0]


_READING: list = [None]  # what value read is running (`.item()`, ...), None in training code


@contextlib.contextmanager
def value_read(what: str):
    """Run the collectives of a value read (`.item()`, `.tolist()`, `print(t)`) on groups of
    their own: a read made on some ranks only then waits for the missing ranks' read and
    times out naming it, instead of pairing with their next training collective."""
    outer, _READING[0] = _READING[0], _READING[0] or what
    try:
        yield
    finally:
        _READING[0] = outer


def reading() -> str | None:
    """The value read in progress on this rank, if any."""
    return _READING[0]


def group_for(ranks: tuple):
    """The process group whose group rank i is `ranks[i]`; made on first use by its members only.
    Inside `value_read` it is the members' group reserved for value reads.

    torch's `new_group(use_local_synchronization=True)` names a group after how many groups
    the calling rank made before, which differs between ranks of an SPMD program that skip
    meshes they are not in, and then hangs.  autopar builds the backend itself on a store
    prefix derived from the ordered rank tuple, so members agree without any other rank.
    """
    if _READING[0] is not None:
        return channel_group(ranks, "value-read")
    pg = _GROUPS.get(ranks)
    if pg is None:
        ensure_initialized()
        world = tdist.get_world_size()
        bad = [r for r in ranks if r >= world]
        if bad:
            raise ValueError(f"ranks {bad} of group {list(ranks)} are beyond the world size {world}")
        me = tdist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of group {list(ranks)}")
        # never the default group, which autopar cannot make anew (see `shut_down_groups`)
        prefix = f"autopar/{_GENERATION[0]}/{'_'.join(map(str, ranks))}"
        store = tdist.PrefixStore(prefix, tdist.distributed_c10d._get_default_store())
        pg = _make_backend(store, ranks)
        _GROUPS[ranks] = pg
    return pg


def _make_backend(store, ranks: tuple, on_host: bool = False):
    from torch._C import _distributed_c10d as c10d

    from . import exits
    from .faults import meet

    group_rank, size = ranks.index(tdist.get_rank()), len(ranks)
    if SIMULATING[0]:  # `simulate`: a group that records, sends nothing
        return c10d.FakeProcessGroup._create_internal(group_rank, size)
    meet(store, ranks)
    exits.start(tdist.distributed_c10d._get_default_store())  # (once: the watchdog of peers that leave)
    if tdist.get_backend() == "nccl" and not on_host:
        opts = c10d.ProcessGroupNCCL.Options()
        opts._timeout = _timeout()
        return c10d.ProcessGroupNCCL(store, group_rank, size, opts)
    return c10d.ProcessGroupGloo(store, group_rank, size, _timeout())


def abort_device_groups_with(rank: int, waits_for) -> None:
    """Abort this rank's NCCL groups that `rank` is a member of and that `waits_for(key)`
    (`key`: the group's ranks, or (ranks, channel name)) says wait for it: it left the program,
    and the kernels waiting for it end.  Host (gloo) groups stay: their waits are sliced
    instead (`exits.wait_for`), for gloo's abort does not wake a waiter."""
    from torch._C import _distributed_c10d as c10d

    nccl = getattr(c10d, "ProcessGroupNCCL", None)
    for key, pg in list(_GROUPS.items()):
        ranks = key[0] if isinstance(key[-1], str) else key
        if nccl is not None and isinstance(pg, nccl) and rank in ranks and waits_for(key):
            with contextlib.suppress(Exception):
                pg.abort()


def forget_job() -> None:
    """Forget the rank, world size and groups read from the current job (`simulate` swaps jobs)."""
    _WHO[0] = None
    reset_groups()


def reset_groups() -> None:
    """Forget cached sub-groups; the next use makes new ones under a fresh store prefix."""
    _GROUPS.clear()
    _GENERATION[0] += 1


def channel_group(ranks: tuple, name: str, on_host: bool = False):
    """A process group of `ranks` (group rank i is `ranks[i]`) reserved for the transfers named
    `name`, made on first use by its members only.  Transfers posted on one group are matched
    in posting order on every backend (NCCL ignores tags), so a pipeline gives each stage edge
    its own group and its messages can never be taken for another edge's.  `on_host`: a gloo
    group for CPU tensors, under NCCL too (a checkpoint thread's agreements)."""
    key = (ranks, name)
    pg = _GROUPS.get(key)
    if pg is None:
        ensure_initialized()
        me = tdist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of channel {name!r} over ranks {list(ranks)}")
        prefix = f"autopar/{_GENERATION[0]}/{'_'.join(map(str, ranks))}/{name}"
        store = tdist.PrefixStore(prefix, tdist.distributed_c10d._get_default_store())
        pg = _GROUPS[key] = _make_backend(store, ranks, on_host)
    return pg
