"""A peer that left the program, seen through the store within a second, whatever the backend.

Under gloo a rank that exits closes its sockets, and a peer waiting for it in a collective
fails at once.  Under NCCL nothing fails: the peer's kernel waits for it, and the peer's host
with it at its next CUDA sync, until the NCCL timeout.  So a rank that leaves says so in the
store (`announce`, which `faults` runs for every rank leaving the program, cleanly or of an
exception): it bumps one counter (`store.add`) and writes its rank into the slot the count
names.  Every rank runs one daemon thread (`start`: with its first group) blocked in the store
on the next slot's key, over a store connection of its own (a wait holds the connection it
runs on).  A healthy job sends nothing but that one wait per rank, renewed hourly; an exit
wakes every rank with one write, however many ranks there are.  Woken, the thread notes the
rank as gone (a clean exit after the few seconds of grace the leaving rank gives its peers to
finish the collectives they shared) and:

- aborts this rank's NCCL groups that hold it (`ProcessGroupNCCL.abort()`: NCCL's
  communicators are aborted, so the kernels waiting for the gone rank end and a host blocked in
  a CUDA sync behind them gets on);
- for a wait on a host (gloo) group, which neither gloo's `abort()` nor its `shutdown()` from
  another thread wakes (tried on torch 2.13: the waiter returned only when the peer's sockets
  closed), `wait_for` waits in slices of a quarter second: a wait that outlasts a slice looks
  whether a rank of its group is gone, and raises if so.  A collective that completes within a
  slice pays 0.2 us (a finished wait: 0.63 us against 0.43 us, on this machine's CPU).  Point-to-point transfers wait unsliced: gloo ends a send or receive
  whose timed wait expires for good (the work completes with the timeout, and the transfer's
  next wait never returns), so a pipeline's transfer to a rank that left still waits for the
  closed socket or AUTOPAR_TIMEOUT.

A gloo collective waiting for a rank that left therefore fails within about a second (3 s more
after a clean exit), through `faults.fail`, which names the rank from its "left" mark
(`tests/test_faults.py`: a peer that marks itself left and stays away with its sockets open).
The NCCL path is written against torch's API but has not run: this project has had no GPU to
run it on.  What a rank whose groups were aborted then sees (an error from its next wait or
sync, or torch's own NCCL watchdog ending the process under TORCH_NCCL_ASYNC_ERROR_HANDLING)
is untested, and a host (gloo) group made under NCCL (`channel_group(on_host=True)`) waits
unsliced.
"""
from __future__ import annotations

import datetime
import json
import threading
import time

import torch.distributed as tdist

from . import backend

_COUNT = "autopar/exits/count"  # how many ranks have announced that they left
_SLICE = datetime.timedelta(seconds=0.25)
_IDLE = datetime.timedelta(hours=1)  # a watchdog's wait, renewed when it ends with no exit
CLEAN_EXIT_GRACE = 3.0  # seconds a cleanly leaving rank waits for its peers to leave too
_GONE: dict = {}  # rank -> the group generation in which this rank's watchdog saw it leave
_STATE = {"started": False, "leaving": False, "sliced": False}


def _slot(n: int) -> str:
    return f"autopar/exits/{n}"


def announce(store, rank: int, how: str) -> None:
    """Tell every rank's watchdog that `rank` left the program (`how`: "exited", "failed", ...)."""
    n = store.add(_COUNT, 1)
    store.set(_slot(n), json.dumps({"rank": rank, "how": how}))


def stop() -> None:
    """This rank is leaving: its watchdog does nothing more."""
    _STATE["leaving"] = True


def start(store) -> None:
    """Start this rank's watchdog over `store` (the job's), once; nothing where the store
    cannot open a connection of its own."""
    if _STATE["started"] or store is None:
        return
    _STATE["started"] = True
    try:
        own = store.clone()
        seen = own.add(_COUNT, 0)
    except Exception:  # a store without clients (HashStore) or one already gone
        return
    _STATE["sliced"] = tdist.get_backend() != "nccl"
    threading.Thread(target=_watch, args=(own, seen, backend.get_rank()), name="autopar-exit-watchdog",
                     daemon=True).start()


def _watch(store, seen: int, me: int) -> None:
    while not _STATE["leaving"]:
        key = _slot(seen + 1)
        try:
            store.wait([key], _IDLE)
        except Exception:
            try:
                posted = store.check([key])
            except Exception:  # the store went down with the job
                return
            if not posted:
                continue
        seen += 1
        try:
            entry = json.loads(store.get(key))
        except Exception:
            return
        if entry["rank"] != me and not _STATE["leaving"]:
            _gone(entry["rank"], entry["how"])


def _gone(rank: int, how: str) -> None:
    if how == "exited":  # a clean exit: the collectives it took part in may still be finishing here
        time.sleep(min(CLEAN_EXIT_GRACE, backend.timeout_seconds()))
        if _STATE["leaving"]:  # (this rank is leaving meanwhile: its exit handler tears the groups down)
            return
    _GONE[rank] = backend._GENERATION[0]
    backend.abort_device_groups_with(rank)


def gone_among(ranks) -> list:
    """The ranks of `ranks` this rank's watchdog saw leave (while its groups were these)."""
    generation = backend._GENERATION[0]
    return [r for r in ranks if _GONE.get(r) == generation]


def wait_for(work, ranks) -> None:
    """`work.wait()` for a transfer over `ranks`; on a host (gloo) job in slices, between which
    a rank of `ranks` seen gone ends the wait with a RuntimeError naming it (which `faults.fail`
    turns into its CommError)."""
    if not _STATE["sliced"]:
        work.wait()
        return
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # done meanwhile, or its own error: that one is raised here
                work.wait()
                return
        gone = gone_among(ranks)
        if gone:
            raise RuntimeError(f"rank {gone[0]} left the program (its exit was announced in the store) while "
                               f"this rank waited for it")
