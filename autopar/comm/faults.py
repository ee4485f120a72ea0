"""What a rank does when the job goes wrong: leaving early, timing out, mismatched collectives.

Every rank counts the collectives it enters on each group (a Python int: nothing goes through
the store while the job is healthy).  When a collective fails, the rank publishes its counts
and where it waits in the rendezvous store, reads its peers' reports for a few seconds, and
names the ranks that did not arrive.  A rank leaving the program records that it left (and
whether it died of an exception), so that its peers can say so, and it does not wait for them
longer than a few seconds: an exit ends the job at once.  Its exit also wakes every peer's
watchdog (`exits.py`), so that one waiting for it fails within seconds under NCCL too, where
no socket closes.

An op that raises while it runs on this rank's pieces (`raised`) is reported there too; when
some ranks of its mesh did not raise it, they would wait for this rank in their next
collective (or pair it with another one): this rank shuts its groups down, so that theirs
fail at once and raise its error (`fail`), and every rank makes its groups anew.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

import torch
import torch.distributed as tdist

from . import backend, exits
from .backend import CommError, channel_group, destroy_groups, get_rank, get_world_size, reading, timeout_seconds

_ARRIVED: dict[str, int] = {}  # group name -> collectives this rank entered on it
_ARRIVED_GENERATION = [0]  # `reset_groups` makes new groups: their counts start again
_FAILED = [False]
_EXIT_STATUS: list = [None]  # the status this rank leaves with, when the launcher's worker knows it
_GRACE = 3.0  # seconds to wait for peers' reports after a failure, and for peers at exit
_NAMES: dict = {}  # (ranks, value read?) -> the group's name in messages and reports
_RAISED: dict = {}  # (generation, mesh ranks) -> how many ops raised on this rank while running on that mesh


def _group_name(ranks, read: bool | None = None) -> str:
    """The group's name in messages, reports and counts: the one over `ranks`, or its value
    reads' own (`read`; default: whether a value read is running)."""
    key = (tuple(ranks), reading() is not None if read is None else read)
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = f"ranks {list(ranks)}" + (" (value reads)" if key[1] else "")
    return name


def _key(what: str, rank: int) -> str:
    return f"autopar/faults/{backend._GENERATION[0]}/{what}/{rank}"


def _entered_here() -> dict:
    """{group name: collectives this rank entered on it} for the groups of this generation."""
    return dict(_ARRIVED) if _ARRIVED_GENERATION[0] == backend._GENERATION[0] else {}


def entered(ranks, read: bool | None = None) -> int:
    """How many collectives this rank entered on the group over `ranks` (see `_group_name`)."""
    if _ARRIVED_GENERATION[0] != backend._GENERATION[0]:
        return 0
    return _ARRIVED.get(_group_name(ranks, read), 0)


def arrive(ranks) -> int:
    """Count this rank's entry into the next collective over `ranks`; returns its number."""
    if _ARRIVED_GENERATION[0] != backend._GENERATION[0]:
        _ARRIVED.clear()
        _ARRIVED_GENERATION[0] = backend._GENERATION[0]
    name = _group_name(ranks)
    seq = _ARRIVED[name] = _ARRIVED.get(name, 0) + 1
    return seq


def _store():
    try:
        return tdist.distributed_c10d._get_default_store()
    except Exception:  # not initialised, or already torn down
        return None


def _peer_state(store, rank: int):
    """("left", how) once `rank` has left the program, ("report", dict) once it has reported a
    failed collective, ("raised", dict) once it shut its groups down after an op raised on
    it alone (see `raised`), else None."""
    left, report, raised_ = _key("left", rank), _key("report", rank), _key("raised", rank)
    if store.check([left]):
        return "left", store.get(left).decode()
    if store.check([report]):
        return "report", json.loads(store.get(report))
    if store.check([raised_]):
        return "raised", json.loads(store.get(raised_))
    return None


def _absence(peer: int, state, name: str, seq: int) -> str | None:
    """Why `peer` is not in collective #`seq` of group `name` (None when it is)."""
    if state is None:
        return f"rank {peer} sent no report (busy outside collectives, hung, or killed)"
    kind, what = state
    if kind == "left":
        return f"rank {peer} has {'died of an exception' if what == 'failed' else what}"
    if kind == "raised":
        return f"rank {peer} raised {what['error']} in {what['op']}"
    entered = what["arrived"].get(name, 0)
    if entered >= seq:
        return None
    where = what["waiting"]
    return (f"rank {peer} entered only {entered} collective(s) on this group and waits in "
            f"{where['op']} #{where['seq']} over {where['group']}")


def _peer_states(op: str, ranks, seq: int) -> dict:
    """After collective #`seq` over `ranks` failed here: publish where this rank is, then read
    the peers' reports for up to a few seconds: {peer: its state (see `_peer_state`)}."""
    store = _store()
    if store is None:
        return {}
    me = get_rank()
    peers = [r for r in ranks if r != me]
    states: dict = {}
    try:
        store.set(_key("report", me), json.dumps(
            {"arrived": _ARRIVED, "waiting": {"op": op, "seq": seq, "group": _group_name(ranks)}}))
        deadline = time.monotonic() + min(_GRACE, timeout_seconds())
        while True:
            for r in peers:
                if states.get(r) is None:
                    states[r] = _peer_state(store, r)
            if all(states[r] is not None for r in peers) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store went down with the job
        return {}
    return states


def _shut_by_peer(ranks):
    """The report of a peer in `ranks` whose op raised and who shut its groups down, or None."""
    store = _store()
    if store is None:
        return None
    me = get_rank()
    try:
        for r in ranks:
            if r != me and (state := _peer_state(store, r)) is not None and state[0] == "raised":
                return state[1]
    except Exception:  # the store went down with the job
        return None
    return None


def _shut_down(store, report: dict) -> None:
    """Say that this rank's groups go down because of `report`'s error, then shut them down:
    a peer waiting in one fails at once and finds the report (`fail`)."""
    store.set(_key("raised", get_rank()), json.dumps(report))
    store.set(_key("shut", 0), "")  # one key that a rank making a group checks (`meet`)
    backend.shut_down_groups()


def meet(store, ranks) -> None:
    """Before a group over `ranks` is made on `store` (its prefix store): wait until every
    member is there.  A member that shut its groups down after an op raised on it (`raised`)
    makes this group under a new prefix and never comes: that is raised here at once (a
    RuntimeError that `fail` turns into its error), where the group's own rendezvous would
    wait for AUTOPAR_TIMEOUT.  A member that does not come within AUTOPAR_TIMEOUT is raised
    here too, naming it (the backend's own rendezvous would wait for the store's timeout)."""
    me = get_rank()
    store.set(f"meet/{me}", "")
    here = [f"meet/{r}" for r in ranks]
    shut = [_key("shut", 0)]
    deadline = time.monotonic() + timeout_seconds()
    while not store.check(here):
        main = _store()
        if main is not None and main.check(shut) and _shut_by_peer(ranks) is not None:
            raise RuntimeError(f"making the group of ranks {list(ranks)}: a member shut its groups down")
        if time.monotonic() > deadline:
            missing = [r for r, key in zip(ranks, here) if not store.check([key])]
            raise RuntimeError(f"making the group of ranks {list(ranks)}: ranks {missing} did not come within "
                               f"AUTOPAR_TIMEOUT={timeout_seconds():g} s")
        time.sleep(0.02)


def raised(op: str, err: Exception, ranks: tuple) -> None:
    """`op` raised `err` on this rank while running on its pieces; `ranks` is the op's mesh,
    every rank of which runs it.  If they all raise it (a check torch makes on shapes or
    dtypes), they are in step and nothing more is done.  If some do not within a few seconds
    (a check on this rank's values, an uneven piece), they have gone on to their next
    collective with this rank: this rank shuts its groups down so that they raise its error
    there at once (`fail`) instead of waiting or pairing wrongly, and every rank makes its
    groups anew.  Only after an op raised; nothing on the way of ops that do not."""
    store = _store()
    if store is None or len(ranks) == 1 or backend.SIMULATING[0] or getattr(err, "_autopar_told", False):
        return
    err._autopar_told = True  # a list op's dispatch runs inside another's: tell once
    me = get_rank()
    slot = (backend._GENERATION[0], ranks)
    n = _RAISED[slot] = _RAISED.get(slot, 0) + 1
    mesh = "_".join(map(str, ranks))
    try:
        store.set(_key(f"raised/{mesh}/{n}", me), op)
        peers = [_key(f"raised/{mesh}/{n}", r) for r in ranks if r != me]
        deadline = time.monotonic() + min(_GRACE, timeout_seconds())
        while not store.check(peers) and time.monotonic() < deadline:
            time.sleep(0.01)
        # the first rank to decide decides for all: a late one follows it
        alike = "alike" if store.check(peers) else "apart"
        if store.compare_set(_key(f"decided/{mesh}/{n}", 0), "", alike).decode() == "apart":
            _shut_down(store, {"rank": me, "op": op, "error": f"{type(err).__name__}: {err}"})
    except Exception:  # the store went down with the job
        pass


def fail(op: str, ranks, seq: int, err: Exception):
    """Raise CommError for collective #`seq` over `ranks` (0: point-to-point transfers, whose
    rank lists differ between the sides, are not counted): the op, the group, the ranks that
    did not arrive, and what a value read must do.  When a peer raised in an op and shut its
    groups down, this is its error: this rank's groups go down too (a rank waiting on one of
    them learns it in turn) and the next collectives run on new ones."""
    name = _group_name(ranks)
    where = f"{op}{f' #{seq}' if seq else ''} over {name} failed on rank {get_rank()}"
    told = _shut_by_peer(ranks)
    if told is not None:
        _shut_down(_store(), told)  # in its name: a rank waiting for this one learns it in turn
        raise CommError(
            f"{where}: rank {told['rank']} raised {told['error']}, in {told['op']}, and went on without this "
            f"collective. Every rank raises it; the groups are made anew, so the job may catch it and go on."
        ) from err
    read = reading()
    states = _peer_states(op, ranks, seq) if seq or read else {}
    absent = {}
    if not seq:
        who = "A peer may have crashed or not reached this transfer."
    else:
        absent = {r: why for r, state in states.items() if (why := _absence(r, state, name, seq)) is not None}
        who = (f"Ranks that did not arrive: {'; '.join(absent.values())}." if absent
               else "Every peer reached this collective; one may have crashed in it.")
    # a read made on some ranks only leaves the others alive elsewhere; a peer that left is no sign of one
    alive = [r for r in (absent if seq else states) if states[r] is None or states[r][0] != "left"]
    hint = (f" This collective belongs to a value read ({read}): value reads are collective over the job, "
            f"every rank of the tensor's mesh must make the same read (not only `if rank == 0`)."
            if read and alive else "")
    raise CommError(f"{where}: {err}. {who}{hint} (timeout: AUTOPAR_TIMEOUT={timeout_seconds():g} s)") from err


# -- AUTOPAR_DEBUG_COLLECTIVES=1: every collective checks its op and shapes first -------------
_OPS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 8


def debugging() -> bool:
    """AUTOPAR_DEBUG_COLLECTIVES=1 (read at every collective, so a test or a debugger can flip it)."""
    return os.environ.get("AUTOPAR_DEBUG_COLLECTIVES") == "1"


def _signature(op: str, t: torch.Tensor) -> torch.Tensor:
    """(op, value read or not, dtype, ndim, shape...) as one int64 row; all_to_all
    sends each member its own number of rows, so its dim 0 is left out."""
    shape = list(t.shape)
    if op == "all_to_all" and shape:
        shape[0] = -1
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    row = [_OPS.index(op), int(reading() is not None), dtype, len(shape), *shape[:_MAX_DIMS]]
    return torch.tensor(row + [-2] * (4 + _MAX_DIMS - len(row)), dtype=torch.int64)


def _describe(row: list) -> str:
    op, read, dtype, ndim = row[:4]
    shape = [("*" if s == -1 else s) for s in row[4:4 + min(ndim, _MAX_DIMS)]]
    dt = _DTYPES[dtype] if dtype < len(_DTYPES) else "another dtype"
    return f"{_OPS[op]}{' (a value read)' if read else ''} of shape {shape} {dt}"


def check_signature(op: str, ranks, t: torch.Tensor) -> None:
    """Gather every member's (op, shape, dtype) on a group of its own and raise, naming each
    member's call, when they differ: a mismatched collective fails here instead of hanging or
    mixing values.  Training collectives and value reads share this group so that a read made
    on some ranks only meets the others' next training collective and is reported."""
    sig = _signature(op, t)
    out = torch.empty(len(ranks) * sig.numel(), dtype=torch.int64)
    try:
        exits.wait_for(channel_group(tuple(ranks), "debug-signatures")._allgather_base(out, sig), ranks,
                       entered(ranks) + 1)
    except RuntimeError as e:
        raise CommError(f"checking {op} over ranks {list(ranks)} (AUTOPAR_DEBUG_COLLECTIVES=1) failed on rank "
                        f"{get_rank()}: {e}. A peer did not reach a collective over these ranks.") from e
    rows = out.view(len(ranks), -1).tolist()
    if any(row != rows[0] for row in rows):
        calls = "; ".join(f"rank {r}: {_describe(row)}" for r, row in zip(ranks, rows))
        raise CommError(f"mismatched collective over ranks {list(ranks)} (AUTOPAR_DEBUG_COLLECTIVES=1): {calls}")


# -- leaving the program ----------------------------------------------------------------------
def install_exit_handling() -> None:
    """On exit, record that this rank left; a clean exit waits a few seconds for its peers to
    leave too, then tears the groups down; a rank dying of an exception (or leaving with an
    error status the launcher's worker reported) leaves at once."""
    atexit.register(_leave)
    sys.excepthook = _note_failure(sys.excepthook)


def _note_failure(hook):
    def excepthook(*exc_info):
        _FAILED[0] = True
        hook(*exc_info)

    return excepthook


def leaving_with(status: int) -> None:
    """Tell the exit handler the status the program leaves with (the launcher's worker knows
    it): a rank leaving with an error does not wait for its peers, and they can name it."""
    _EXIT_STATUS[0] = status


def record_left(store, how: str) -> None:
    """Say in the store that this rank left the program (`how`: "exited", "failed", "exited
    with code N"): its peers name it when a collective with it fails (`_absence`), and their
    watchdogs wake (`exits`), so that one waiting for it fails within seconds on any backend."""
    me = get_rank()
    store.set(_key("left", me), how)
    exits.announce(store, me, how, _entered_here())


def _leave() -> None:
    if not tdist.is_initialized():
        return
    store, me, world = _store(), get_rank(), get_world_size()
    status = _EXIT_STATUS[0]
    how = "failed" if _FAILED[0] else f"exited with code {status}" if status else "exited"
    exits.stop()
    try:
        record_left(store, how)
        if _FAILED[0] or status:
            return
        # Peers still computing get a few seconds to finish; a peer blocked in a collective
        # this rank will never join fails as soon as the groups are torn down below.
        deadline = time.monotonic() + min(_GRACE, timeout_seconds())
        keys = [_key("left", r) for r in range(world)]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store's host has gone: nobody is left to wait for
        pass
    destroy_groups()


def enter(op: str, ranks, t: torch.Tensor) -> int:
    """Count this rank into the collective (see above); under AUTOPAR_DEBUG_COLLECTIVES=1
    first check that every member calls the same op on the same shapes.  Point-to-point
    transfers (whose rank lists differ between the sides) are neither counted nor checked."""
    if op == "send/recv":
        return 0
    if debugging():
        check_signature(op, ranks, t)
    seq = arrive(ranks)
    if exits._GONE:  # (a peer left the program: one that left before this collective never comes)
        gone = exits.left_before(ranks, seq)
        if gone is not None:
            fail(op, ranks, seq, gone)
    return seq
