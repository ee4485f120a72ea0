"""A peer that left the program, seen through the store within a second, whatever the backend.

Under gloo a rank that exits closes its sockets, and a peer waiting for it in a collective
fails at once.  Under NCCL nothing fails: the peer's kernel waits for it, and the peer's host
with it at its next CUDA sync, until the NCCL timeout.  So a rank that leaves says so in the
store (`announce`, which `faults` runs for every rank leaving the program, cleanly or of an
exception): it bumps one counter (`store.add`) and writes, into the slot the count names, its
rank, how it left and how many collectives it entered on each group.  Every rank runs one
daemon thread (`start`: with its first group) blocked in the store on the next slot's key,
over a store connection of its own (a wait holds the connection it runs on).  A healthy job
sends nothing but that one wait per rank, renewed hourly; an exit wakes every rank with one
write, however many ranks there are.

What a gone rank means is decided by counting, not by a clock: collective #n of a group
waits for a rank that left only when that rank entered fewer than n collectives on the group
(`missing`).  A rank that left cleanly entered every collective of a correct program, so no
wait of a correct job can fail on its account, however slowly this rank finishes the
collectives they shared.  (The first version marked a cleanly leaving rank gone after a
3-second grace measured here: a wait still completing after that, on a starved rank, failed
in a correct job; see docs/failures.md for the stress failure it was backed out for.)
Woken, the thread:

- aborts this rank's NCCL groups that hold the gone rank where it waits for the gone rank
  (it entered more collectives on the group than the gone rank did), or any that hold a rank
  that left with an error (`ProcessGroupNCCL.abort()`: the kernels waiting for it end and a
  host blocked in a CUDA sync behind them gets on);
- for a wait on a host (gloo) group, which neither gloo's `abort()` nor its `shutdown()` from
  another thread wakes (tried on torch 2.13: the waiter returned only when the peer's sockets
  closed), `wait_for` waits in slices of a quarter second: a wait that outlasts a slice looks
  whether a rank of its group is `missing`, and raises if so.  A collective that completes
  within a slice pays for nothing but the timed wait (see docs/failures.md for the figure).

The thread never raises, prints or sleeps: a store that fails under it (its host left) ends
it quietly (torch's C++ store client logs one warning line of its own for the closed socket,
as it does for the main thread's store calls then).

Point-to-point transfers wait unsliced: a timed gloo send or receive wait that expires closes
the pair ("Application timeout caused pair closure"), and gloo's point-to-point works have no
future and report completion only once waited for.  The NCCL path is written against torch's
API but has not run on a GPU.
"""
from __future__ import annotations

import datetime
import json
import threading

import torch.distributed as tdist

from . import backend

_COUNT = "autopar/exits/count"  # how many ranks have announced that they left
_SLICE = datetime.timedelta(seconds=0.25)
_IDLE = datetime.timedelta(hours=1)  # a watchdog's wait, renewed when it ends with no exit
_GONE: dict = {}  # rank -> (group generation, how it left, {group name: collectives it entered})
_STATE = {"started": False, "leaving": False, "sliced": False}


def _slot(n: int) -> str:
    return f"autopar/exits/{n}"


def announce(store, rank: int, how: str, entered: dict) -> None:
    """Tell every rank's watchdog that `rank` left the program (`how`: "exited", "failed", ...)
    having entered `entered[name]` collectives on each group of this group generation."""
    n = store.add(_COUNT, 1)
    store.set(_slot(n), json.dumps({"rank": rank, "how": how, "generation": backend._GENERATION[0],
                                    "entered": entered}))


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
    threading.Thread(target=_watch, args=(own, seen, backend.get_rank()),
                     name="autopar-exit-watchdog", daemon=True).start()


def _watch(store, seen: int, me: int) -> None:
    try:
        while not _STATE["leaving"]:
            key = _slot(seen + 1)
            try:
                store.wait([key], _IDLE)
            except Exception:
                if not store.check([key]):  # an hour without exits (a store gone raises here)
                    continue
            seen += 1
            entry = json.loads(store.get(key))
            if entry["rank"] == me or _STATE["leaving"]:
                continue
            _gone(entry)
    except Exception:  # the store went down with the job: nothing more can be seen through it
        return


def _gone(entry: dict) -> None:
    rank, how, theirs = entry["rank"], entry["how"], entry["entered"]
    _GONE[rank] = (entry["generation"], how, theirs)
    if backend._GENERATION[0] != entry["generation"]:
        return
    from .faults import _group_name, entered

    def waits_for(key) -> bool:
        """Whether this rank entered more collectives on group `key` than the gone rank did
        (always, when it left with an error); uncounted channels (a pipeline's) are left be."""
        if how != "exited":
            return True
        ranks, channel = (key[0], key[1]) if isinstance(key[-1], str) else (key, None)
        if channel not in (None, "value-read"):
            return False
        read = channel is not None
        return entered(ranks, read) > theirs.get(_group_name(ranks, read), 0)

    backend.abort_device_groups_with(rank, waits_for)


def missing(ranks, seq: int) -> list:
    """The ranks of `ranks` seen leaving (while the groups were these) before they entered
    collective #`seq` of the group over `ranks`."""
    if not _GONE:
        return []
    from .faults import _group_name

    generation, name = backend._GENERATION[0], _group_name(ranks)
    out = []
    for r in ranks:
        gone = _GONE.get(r)
        if gone is not None and gone[0] == generation and gone[2].get(name, 0) < seq:
            out.append(r)
    return out


def left_before(ranks, seq: int) -> RuntimeError | None:
    """The error of collective #`seq` over `ranks` when a rank of them left the program before
    entering it (raised where a collective is entered or waited for), else None."""
    gone = missing(ranks, seq)
    if not gone:
        return None
    return RuntimeError(f"rank {gone[0]} left the program (its exit was announced in the store) before it "
                        f"entered this collective")


def wait_for(work, ranks, seq: int | None = None) -> None:
    """`work.wait()` for collective #`seq` over `ranks` (default: the last one this rank
    entered on them); on a host (gloo) job in slices, between which a rank of `ranks` that
    left before entering it ends the wait with a RuntimeError naming it (which `faults.fail`
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
        if _GONE:
            from .faults import entered

            gone = left_before(ranks, entered(ranks) if seq is None else seq)
            if gone is not None:
                raise gone
