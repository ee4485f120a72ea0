"""save_state_dict: every rank writes its own pieces; rank 0 writes the metadata and swaps the
finished checkpoint into place.

Steps (each `agree` is one small all-gather that also acts as a barrier, and raises the same
error on every rank when any rank had one):

1. flatten the state dict; rank 0 claims this save's names next to `path` (same filesystem,
   so renames are atomic; see claim.py): its lock file `.<name>.lock-<token>`, flock-ed for
   the whole save, then the temporary directory `.<name>.tmp-<token>`; agree on the token and
   on a digest of the entries (names, shapes, dtypes, meshes, placements);
2. where the entries differ, every rank raises the same error (one more agreement); each rank
   takes the pieces it writes, Partial tensors reduced (the checkpoint holds global values);
3. every rank sees rank 0's lock file and directory: agree, before anything is written (a path
   on a disk of each node's own is caught here); write this rank's pieces - a box several
   ranks hold is written once: a large one in row slices by all its holders (`_share`), a
   small one by the lowest - into `rankNNNNN.safetensors`, fsync it, checksum every piece;
   agree (on failure the temporary directory is removed and `path` was never touched);
4. rank 0 checks every file the ranks reported is there with its size, writes metadata.json,
   fsyncs, and swaps the directory in, one swap of `path` at a time: an atomic exchange
   (renameat2 RENAME_EXCHANGE) where the OS has one, else rename old away / rename new in
   (a crash between those two renames leaves the old checkpoint at `.<name>.old-<token>`,
   which load_state_dict falls back to); then it removes the replaced checkpoint and the
   leftovers of other saves that are provably over; agree once more so no rank returns
   before the checkpoint is in place.

`path` is resolved (symlinks followed) first: saving to `latest -> step_10` replaces step_10.

With `async_save=True` the call runs steps 1 and 2 (one agreement), the pieces copied to host
buffers; a thread (`AsyncSave`) runs steps 3 and 4, its agreements on a gloo group of their
own so they never pair with the training's collectives.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import sys
import threading
import time
import uuid
from typing import Optional

import numpy as np
import torch

from .. import comm
from ..tensor.dtensor import DistTensor
from ..placement import Partial, Replicate, Shard
from ..spec import split_range
from ..redistribute import redistribute_local
from . import claim, sync
from .errors import CheckpointError, Problems
from .flatten import Leaf, flatten
from .safetensors_file import write_safetensors
from .metadata import (
    FORMAT,
    METADATA_FILE,
    VERSION,
    checksum,
    describe_mesh,
    describe_placement,
    dtype_name,
    encode_value,
    rank_file,
    volume,
    write_metadata,
)


def save_state_dict(state_dict, path, *, async_save: bool = False) -> Optional[AsyncSave]:
    """Save a (nested) state dict of DistTensors, plain tensors and JSON-like values to the
    directory `path`, collectively: every rank of the job must call it with the same entries.

    Each rank writes only its own pieces (a replicated piece once, by its lowest holder;
    Partial tensors reduced first); plain tensors count as replicated on every rank.  The
    previous checkpoint at `path` stays intact until the new one is complete.  `path` must be
    on a filesystem all ranks share; a symlink is followed (the directory it points to is
    replaced, the link kept).

    `async_save=True` (torch DCP's `async_save`) returns once every rank has copied its pieces
    to host memory (pinned on CUDA), with an `AsyncSave` handle: a background thread writes the
    files and swaps the checkpoint in as a blocking save does, while training goes on and
    changes the tensors (the checkpoint holds their values at the call).  `handle.wait()` waits
    and raises the save's error; the next save (either kind) and the process's exit wait for it
    first, and the next save raises its error if nobody has seen it.

    >>> import torch, tempfile, os, autopar as dist
    >>> from autopar.checkpoint import save_state_dict, load_state_dict
    >>> d = tempfile.mkdtemp()
    >>> save_state_dict({"w": torch.arange(4.), "step": 3}, os.path.join(d, "ckpt"))
    >>> sd = {"w": torch.zeros(4), "step": 0}
    >>> load_state_dict(sd, os.path.join(d, "ckpt")); sd
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    >>> w = torch.arange(4.)
    >>> handle = save_state_dict({"w": w}, os.path.join(d, "ckpt"), async_save=True)
    >>> w.add_(10)  # training goes on; the checkpoint keeps the values at the call
    tensor([10., 11., 12., 13.])
    >>> handle.wait(); load_state_dict(sd := {"w": torch.zeros(4)}, os.path.join(d, "ckpt")); sd
    {'w': tensor([0., 1., 2., 3.])}
    """
    wait_for_saves()
    save = _Save(path)
    try:
        save.agree_on_entries(state_dict)
        save.take_pieces(snapshot=async_save)
    except BaseException:
        save.release()
        raise
    if not async_save:
        try:
            save.write_and_swap(sync.agree)
        finally:
            save.release()
        return None
    return AsyncSave.start(save)


class _Save:
    """One save of `path`: the steps of the module's docstring, split where an asynchronous
    save hands over to its thread (after every rank holds a copy of its pieces)."""

    def __init__(self, path):
        self.rank, self.world = sync.world()
        self.given = os.fspath(path)
        self.path = os.path.realpath(self.given)
        self.parent, self.base = os.path.split(self.path)
        self.what = f"save_state_dict({self.given!r})"
        self.untouched = f"the checkpoint at {self.given} is unchanged"
        self.unwritten = "nothing was written; " + self.untouched  # (a failure before any rank writes)
        self.claim: claim.Claim | None = None

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()

    def _abandon(self) -> None:
        if self.claim is not None:
            self.claim.abandon()

    def agree_on_entries(self, state_dict) -> None:
        """Step 1 and step 2's error: rank 0's claim, and the same entries everywhere."""
        rank, nothing = self.rank, self.unwritten
        problems = Problems()
        leaves: list[Leaf] = []
        self.values: dict = {}
        mine = {"digest": None, "entries": 0, "token": None}
        try:
            leaves = flatten(state_dict)
            mine["digest"], mine["entries"] = _digest(leaves)
            if rank == 0:
                self.values = {
                    l.name: {"path": list(l.path), "value": encode_value(l.value, l.name)}
                    for l in leaves if not l.is_tensor
                }
                _check_replaceable(self.path, self.given)
                mine["token"] = uuid.uuid4().hex[:12]
                self.claim = claim.Claim(self.parent, self.base, mine["token"])
        except Exception as e:
            problems.add(f"rank {rank}: {_err(e)}")
        first = sync.agree(problems, self.what, nothing, mine, on_failure=self._abandon)
        self.token = first[0]["token"]
        _, self.tmp, _ = claim.names(self.parent, self.base, self.token)
        if len({d["digest"] for d in first}) > 1:  # every rank sees it: one error, raised everywhere
            problems = Problems()
            if rank == 0:
                problems.add(_differ(first))
            sync.agree(problems, self.what, nothing, on_failure=self._abandon)
        self.tensors = [l for l in leaves if l.is_tensor]

    def take_pieces(self, snapshot: bool) -> None:
        """Step 2's pieces: the pieces this rank writes (collective for Partial tensors: the
        same order everywhere); with `snapshot`, copies that training cannot change.  A
        failure is told to the other ranks at the next agreement, before anything is written."""
        self.problems = Problems()
        self.pieces: list = []
        try:
            self.pieces = _my_pieces(self.tensors, self.rank, snapshot=snapshot)
        except Exception as e:
            self.problems.add(f"rank {self.rank} copying its pieces: {_err(e)}")

    def write_and_swap(self, agree) -> None:
        """Steps 3 and 4: every rank sees the claim, agree, write, agree, rank 0 swaps, agree
        (`agree`: the collective every rank meets at, the training's groups or a save thread's
        own)."""
        rank, tmp, problems = self.rank, self.tmp, self.problems
        if rank != 0:
            blind = claim.unseen(self.parent, self.base, self.token)
            if blind:
                problems.add(blind)
        agree(problems, self.what, self.unwritten, on_failure=self._abandon)

        problems = Problems()
        records, file_info = [], None
        try:
            if self.pieces:
                fname = rank_file(rank)
                payload = {}
                for name, box, data in self.pieces:
                    payload[name] = data
                    records.append({"name": name, "key": name, "box": box, "checksum": checksum(data)})
                _write_rank_file(payload, os.path.join(tmp, fname))
                file_info = {"name": fname, "size": os.path.getsize(os.path.join(tmp, fname))}
            _crash_point("files_written")
        except Exception as e:
            problems.add(f"rank {rank} writing its pieces into {tmp}: {_err_in(e, tmp)}")
        self.pieces = []  # the host copies are on disk now
        gathered = agree(problems, self.what, self.untouched, {"file": file_info, "pieces": records},
                         on_failure=self._abandon)

        problems = Problems()
        mine_claim = self.claim
        if rank == 0:
            try:
                _check_files(tmp, gathered)
                write_metadata(tmp, _build_metadata(self.tensors, self.values, gathered, self.world))
                _fsync_dir(tmp)
                _crash_point("metadata_written")
                with claim.swap_lock(self.parent, self.base):
                    _swap_into_place(mine_claim, self.path)
            except Exception as e:
                problems.add(f"rank 0 putting the checkpoint in place: {_err_in(e, tmp)}")
                mine_claim.abandon()
            else:  # the new checkpoint is in place: what follows is tidying up
                shutil.rmtree(mine_claim.tmp, ignore_errors=True)
                shutil.rmtree(mine_claim.old, ignore_errors=True)
                claim.remove_leftovers(self.parent, self.base, self.token)
                mine_claim.finish()
        agree(problems, self.what, self.untouched)


class AsyncSave:
    """A save running in a background thread (`save_state_dict(..., async_save=True)`).

    Its agreements go over a process group of its own, on the host, so they never pair with
    the training's collectives running meanwhile."""

    def __init__(self, save: _Save):
        self.path = save.given
        self._error: Optional[BaseException] = None
        ranks = tuple(range(save.world))
        group = comm.channel_group(ranks, "checkpoint-save", on_host=True) if save.world > 1 else None
        agree = functools.partial(sync.agree, group=group)
        self._thread = threading.Thread(target=self._run, args=(save, agree), name=f"autopar save {self.path}")

    @classmethod
    def start(cls, save: _Save) -> "AsyncSave":
        handle = cls(save)
        _IN_FLIGHT.append(handle)
        handle._thread.start()
        return handle

    def _run(self, save: _Save, agree) -> None:
        try:
            save.write_and_swap(agree)
        except BaseException as e:  # kept for wait(), the next save, or the exit
            self._error = e
        finally:
            save.release()

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save to finish; raise its error, if it had one."""
        self._thread.join()
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)
        if self._error is not None:
            raise self._error


_IN_FLIGHT: list[AsyncSave] = []  # asynchronous saves not yet waited for, oldest first


def wait_for_saves() -> None:
    """Wait for every asynchronous save still running; raise the first error nobody has seen."""
    failed = None
    while _IN_FLIGHT:
        handle = _IN_FLIGHT[0]
        try:
            handle.wait()
        except BaseException as e:
            failed = failed or e
    if failed is not None:
        raise failed


@atexit.register
def _wait_at_exit() -> None:
    """The process ends: the saves in flight finish first (their threads are joined before
    atexit runs; this reports the error of one nobody waited for)."""
    try:
        wait_for_saves()
    except BaseException as e:
        print(f"autopar: an asynchronous save_state_dict failed and was never waited for: {_err(e)}",
              file=sys.stderr)


def _differ(first: list) -> str:
    groups: dict = {}
    for r, d in enumerate(first):
        groups.setdefault((d["digest"], d["entries"]), []).append(r)
    desc = "; ".join(f"ranks {rs} have {n} entries (digest {dg[:8]})" for (dg, n), rs in groups.items())
    return (f"the state dicts differ across ranks ({desc}). Every rank must pass the same keys, shapes, "
            f"dtypes, meshes and placements")


def _err_in(e: Exception, tmp: str) -> str:
    """The error, or that another process removed the temporary directory (the reason when it is gone)."""
    if not os.path.isdir(tmp):
        return f"{tmp} was removed by another process while this save was writing it"
    return _err(e)


def _check_files(tmp: str, gathered: list) -> None:
    """Every data file a rank reported is in `tmp`, with the size it had when written."""
    wrong = []
    for r, got in enumerate(gathered):
        if got["file"] is None:
            continue
        name, size = got["file"]["name"], got["file"]["size"]
        try:
            now = os.stat(os.path.join(tmp, name)).st_size
        except FileNotFoundError:
            wrong.append(f"{name}, which rank {r} wrote, is missing")
            continue
        if now != size:
            wrong.append(f"{name}, which rank {r} wrote with {size} bytes, has {now} bytes")
    if wrong:
        raise CheckpointError(f"in {tmp}: " + "; ".join(wrong) + ": another process changed it after it was written")


# -- pieces --------------------------------------------------------------------------------------
def _my_pieces(tensors: list[Leaf], rank: int, snapshot: bool = False) -> list[tuple[str, list, torch.Tensor]]:
    """(name, global box, CPU data) of every piece this rank writes; with `snapshot`, each in
    a host buffer of its own (`_host_copies`).  Pieces may share memory (tied weights, views
    of one buffer): `write_safetensors` writes each one's bytes."""
    out = []
    with torch.no_grad():
        for leaf in tensors:
            got = _piece(leaf.value, rank)
            if got is not None:
                box, data = got
                out.append((leaf.name, box, data.detach() if snapshot else data.detach().to("cpu").contiguous()))
    return _host_copies(out) if snapshot else out


def _host_copies(pieces: list) -> list:
    """Each piece copied into a host buffer of its own (pinned for a device piece, the copies
    queued and waited for once), so training may change the tensors while a thread writes.
    The buffers are kept for the next asynchronous save of the same pieces (it starts after
    this one has finished): allocating, and for pinned memory registering, costs more than
    the copy."""
    copies, on_device, kept = [], False, {}
    for name, box, data in pieces:
        pinned = data.device.type == "cuda"
        key = (name, tuple(data.shape), data.dtype, pinned)
        buf = _STAGING.get(key)
        if buf is None:
            buf = torch.empty(data.shape, dtype=data.dtype, pin_memory=pinned)
        kept[key] = buf
        on_device |= data.device.type != "cpu"
        copies.append((name, box, buf.copy_(data, non_blocking=pinned)))
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    _STAGING.clear()
    _STAGING.update(kept)
    return copies


# the host buffers of the last asynchronous save, by (name, shape, dtype, pinned)
_STAGING: dict = {}


def _piece(t: torch.Tensor, rank: int):
    """This rank's (box, data) if it is the writer of its piece of `t`, else None."""
    if not isinstance(t, DistTensor):
        box = [[0, s] for s in t.shape]
        return (box, t) if rank == 0 and volume(box) > 0 else None
    spec = t._spec
    local = t._local
    if spec.partial_dims():  # the checkpoint holds the value, not the terms
        whole = spec.with_placements([Replicate() if type(p) is Partial else p for p in spec.placements])
        local = redistribute_local(local, spec, whole)
        spec = whole
    if spec.strided_dims():  # blocks split alike (a fused projection): stored as one box per rank
        boxes = spec.as_boxes()
        local = redistribute_local(local, spec, boxes)
        spec = boxes
    coord = spec.mesh.coordinate(rank)
    if coord is None:
        return None
    box = [list(b) for b in spec.local_box(coord)]
    if volume(box) == 0:
        return None
    holders = _holders(spec, coord)
    return _share(box, local, holders.index(rank), len(holders))


def _holders(spec, coord) -> tuple[int, ...]:
    """The ranks holding the same (non-empty) box as `coord`: along the mesh dims that replicate
    the tensor, since distinct shards of a dim never share a non-empty box."""
    if all(type(p) in (Shard, Replicate) for p in spec.placements):
        return _replica_ranks(spec.mesh, spec.placements, coord)
    mine = spec.local_box(coord)
    return tuple(sorted(int(r) for c, r in np.ndenumerate(spec.mesh.mesh) if spec.local_box(c) == mine))


@functools.lru_cache(maxsize=1024)
def _replica_ranks(mesh, placements: tuple, coord: tuple) -> tuple[int, ...]:
    """`_holders` of a Shard/Replicate layout, which depends on nothing else: a state dict
    holds many tensors laid out alike, and a save asks for each."""
    at = tuple(slice(None) if type(p) is Replicate else c for p, c in zip(placements, coord))
    return tuple(sorted(int(r) for r in np.asarray(mesh.mesh)[at].reshape(-1)))


SHARED_WRITE_BYTES = 1 << 16  # a piece held alike by several ranks and at least this large is written by all


def _share(box: list, local: torch.Tensor, index: int, holders: int):
    """The part of a piece that `holders` ranks hold alike which the `index`-th of them writes:
    a large one's rows split among them as evenly as they go (under data parallel every rank
    holds the whole model: no rank writes it alone), a small or 0-d one by the first."""
    if holders == 1 or not box or local.numel() * local.element_size() < SHARED_WRITE_BYTES:
        return (box, local) if index == 0 else None
    start, stop = split_range(box[0][1] - box[0][0], holders, index)
    if start == stop:
        return None
    return [[box[0][0] + start, box[0][0] + stop]] + box[1:], local[start:stop]


def _write_rank_file(tensors: dict, filename: str) -> None:
    """Write one rank's pieces and make them durable (tests replace this to simulate crashes)."""
    write_safetensors(tensors, filename, metadata={"format": "pt", "writer": "autopar"})
    _fsync_file(filename)


def _crash_point(stage: str) -> None:
    """No-op; tests replace it to stop a save at `stage` as a crash would."""


# -- metadata ------------------------------------------------------------------------------------
def _describe(leaf: Leaf) -> dict:
    t = leaf.value
    entry = {"path": list(leaf.path), "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    if isinstance(t, DistTensor):
        entry["mesh"] = describe_mesh(t._spec.mesh)
        entry["placements"] = [describe_placement(p) for p in t._spec.placements]
    else:
        entry["mesh"], entry["placements"] = None, None
    return entry


def _digest(leaves: list[Leaf]) -> tuple[str, int]:
    """A hash of every entry's name, shape, dtype, mesh and placements, compared across ranks
    (never stored): the reprs of tuples, which cost a fraction of describing each entry as
    JSON on every save."""
    desc = [(l.path, tuple(l.value.shape), str(l.value.dtype), _layout(l.value)) if l.is_tensor else (l.path,)
            for l in leaves]
    return hashlib.sha256(repr(desc).encode()).hexdigest(), len(leaves)


def _layout(t: torch.Tensor) -> str | None:
    return _layout_text(t._spec.mesh, t._spec.placements) if isinstance(t, DistTensor) else None


@functools.lru_cache(maxsize=1024)
def _layout_text(mesh, placements: tuple) -> str:
    """The layout as the metadata describes it, once per distinct layout."""
    return repr((describe_mesh(mesh), [describe_placement(p) for p in placements]))


def _build_metadata(tensors: list[Leaf], values: dict, gathered: list, world: int) -> dict:
    files, pieces = {}, {}
    for r, got in enumerate(gathered):
        if got["file"] is not None:
            files[got["file"]["name"]] = {"size": got["file"]["size"], "rank": r}
            for p in got["pieces"]:
                pieces.setdefault(p["name"], []).append(
                    {"file": got["file"]["name"], "key": p["key"], "box": p["box"], "checksum": p["checksum"]}
                )
    out = {}
    for leaf in tensors:
        entry = _describe(leaf)
        entry["pieces"] = sorted(pieces.get(leaf.name, []), key=lambda p: p["box"])
        out[leaf.name] = entry
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        "tensors": out,
        "values": values,
    }


# -- atomic replacement ----------------------------------------------------------------------------
def _check_replaceable(path: str, given: str) -> None:
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, METADATA_FILE)) or not os.listdir(path):
            return
    link = f" ({given} links to it)" if os.path.abspath(given) != path else ""
    raise CheckpointError(
        f"refusing to replace {path}{link}: it exists and is not an autopar checkpoint "
        f"(no {METADATA_FILE} in it); remove it or pick another path"
    )


def _swap_into_place(claimed: claim.Claim, final: str) -> None:
    """Put the claimed temporary directory at `final`, with the swap lock held.  The replaced
    checkpoint ends at the claim's tmp (exchange) or old name, for the caller to remove."""
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(claimed.tmp, final)
        _fsync_dir(parent)
        return
    if _exchange(claimed.tmp, final):  # atomic: `final` is the new checkpoint, tmp the old one
        _fsync_dir(parent)
        _crash_point("swapped")
        return
    os.rename(final, claimed.old)
    try:
        _crash_point("old_moved_away")
        os.rename(claimed.tmp, final)
    except Exception:
        os.rename(claimed.old, final)  # never leave `final` without a checkpoint
        raise
    _fsync_dir(parent)
    _crash_point("new_in_place")


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_file(filename: str) -> None:
    fd = os.open(filename, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
