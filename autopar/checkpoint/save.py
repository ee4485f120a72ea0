"""save_state_dict: every rank writes its own pieces; rank 0 writes the metadata and swaps the
finished checkpoint into place.

Steps (each `agree` is one small all-gather that also acts as a barrier, and raises the same
error on every rank when any rank had one):

1. flatten the state dict; rank 0 claims this save's names next to `path` (same filesystem,
   so renames are atomic; see claim.py): its lock file `.<name>.lock-<token>`, flock-ed for
   the whole save, then the temporary directory `.<name>.tmp-<token>`; agree on the token;
2. agree that every rank has the same entries (names, shapes, dtypes, meshes, placements)
   and sees rank 0's lock file and directory (a path on a disk of each node's own is caught
   here, before anything is written);
3. reduce Partial tensors (the checkpoint holds global values), write this rank's pieces -
   for each distinct box only the lowest rank holding it writes - into
   `rankNNNNN.safetensors`, fsync it, checksum every piece; agree (on failure the temporary
   directory is removed and `path` was never touched);
4. rank 0 checks every file the ranks reported is there with its size, writes metadata.json,
   fsyncs, and swaps the directory in, one swap of `path` at a time: an atomic exchange
   (renameat2 RENAME_EXCHANGE) where the OS has one, else rename old away / rename new in
   (a crash between those two renames leaves the old checkpoint at `.<name>.old-<token>`,
   which load_state_dict falls back to); then it removes the replaced checkpoint and the
   leftovers of other saves that are provably over; agree once more so no rank returns
   before the checkpoint is in place.

`path` is resolved (symlinks followed) first: saving to `latest -> step_10` replaces step_10.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid

import numpy as np
import torch

from ..tensor.dtensor import DistTensor
from ..placement import Partial, Replicate
from ..redistribute import redistribute_local
from . import claim, sync
from .errors import CheckpointError, Problems
from .flatten import Leaf, flatten
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


def save_state_dict(state_dict, path) -> None:
    """Save a (nested) state dict of DistTensors, plain tensors and JSON-like values to the
    directory `path`, collectively: every rank of the job must call it with the same entries.

    Each rank writes only its own pieces (a replicated piece once, by its lowest holder;
    Partial tensors reduced first); plain tensors count as replicated on every rank.  The
    previous checkpoint at `path` stays intact until the new one is complete.  `path` must be
    on a filesystem all ranks share; a symlink is followed (the directory it points to is
    replaced, the link kept).

    >>> import torch, tempfile, os, autopar as dist
    >>> from autopar.checkpoint import save_state_dict, load_state_dict
    >>> d = tempfile.mkdtemp()
    >>> save_state_dict({"w": torch.arange(4.), "step": 3}, os.path.join(d, "ckpt"))
    >>> sd = {"w": torch.zeros(4), "step": 0}
    >>> load_state_dict(sd, os.path.join(d, "ckpt")); sd
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    """
    rank, world = sync.world()
    given = os.fspath(path)
    path = os.path.realpath(given)
    parent, base = os.path.split(path)
    what = f"save_state_dict({given!r})"
    untouched = f"the checkpoint at {given} is unchanged"
    nothing = "nothing was written; " + untouched
    mine_claim: claim.Claim | None = None
    try:
        # 1. entries; rank 0 claims the temporary names ---------------------------------------
        problems = Problems()
        leaves: list[Leaf] = []
        values: dict = {}
        mine = {"digest": None, "entries": 0, "token": None}
        try:
            leaves = flatten(state_dict)
            mine["digest"], mine["entries"] = _digest(leaves)
            if rank == 0:
                values = {
                    l.name: {"path": list(l.path), "value": encode_value(l.value, l.name)}
                    for l in leaves if not l.is_tensor
                }
                _check_replaceable(path, given)
                mine["token"] = uuid.uuid4().hex[:12]
                mine_claim = claim.Claim(parent, base, mine["token"])
        except Exception as e:
            problems.add(f"rank {rank}: {_err(e)}")
        abandon = mine_claim.abandon if mine_claim is not None else (lambda: None)
        first = sync.agree(problems, what, nothing, mine, on_failure=abandon)
        token = first[0]["token"]
        _, tmp, _ = claim.names(parent, base, token)

        # 2. the same entries everywhere, and every rank sees rank 0's directory -------------------
        problems = Problems()
        if len({d["digest"] for d in first}) > 1:
            if rank == 0:
                problems.add(_differ(first))
        elif rank != 0:
            blind = claim.unseen(parent, base, token)
            if blind:
                problems.add(blind)
        sync.agree(problems, what, nothing, on_failure=abandon)
        tensors = [l for l in leaves if l.is_tensor]

        # 3. this rank's pieces --------------------------------------------------------------------
        problems = Problems()
        records, file_info = [], None
        try:
            pieces = _my_pieces(tensors, rank)  # collective for Partial tensors: same order everywhere
            if pieces:
                fname = rank_file(rank)
                payload = {}
                for name, box, data in pieces:
                    payload[name] = data
                    records.append({"name": name, "key": name, "box": box, "checksum": checksum(data)})
                _write_rank_file(payload, os.path.join(tmp, fname))
                file_info = {"name": fname, "size": os.path.getsize(os.path.join(tmp, fname))}
            _crash_point("files_written")
        except Exception as e:
            problems.add(f"rank {rank} writing its pieces into {tmp}: {_err_in(e, tmp)}")
        gathered = sync.agree(problems, what, untouched, {"file": file_info, "pieces": records}, on_failure=abandon)

        # 4. rank 0: every file there, metadata, the swap --------------------------------------------
        problems = Problems()
        if rank == 0:
            try:
                _check_files(tmp, gathered)
                write_metadata(tmp, _build_metadata(tensors, values, gathered, world))
                _fsync_dir(tmp)
                _crash_point("metadata_written")
                with claim.swap_lock(parent, base):
                    _swap_into_place(mine_claim, path)
            except Exception as e:
                problems.add(f"rank 0 putting the checkpoint in place: {_err_in(e, tmp)}")
                mine_claim.abandon()
            else:  # the new checkpoint is in place: what follows is tidying up
                shutil.rmtree(mine_claim.tmp, ignore_errors=True)
                shutil.rmtree(mine_claim.old, ignore_errors=True)
                claim.remove_leftovers(parent, base, token)
                mine_claim.finish()
        sync.agree(problems, what, untouched)
    finally:
        if mine_claim is not None:
            mine_claim.release()


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
def _my_pieces(tensors: list[Leaf], rank: int) -> list[tuple[str, list, torch.Tensor]]:
    """(name, global box, CPU data) of every piece this rank writes."""
    out = []
    seen_storage: set = set()
    with torch.no_grad():
        for leaf in tensors:
            got = _piece(leaf.value, rank)
            if got is None:
                continue
            box, data = got
            data = data.detach().to("cpu").contiguous()
            storage = data.untyped_storage()
            # safetensors refuses tensors sharing memory (tied weights, views of one buffer)
            if storage.data_ptr() in seen_storage or storage.nbytes() != data.numel() * data.element_size():
                data = data.clone()
            seen_storage.add(data.untyped_storage().data_ptr())
            out.append((leaf.name, box, data))
    return out


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
    writer = min(int(r) for c, r in np.ndenumerate(spec.mesh.mesh) if spec.local_box(c) == spec.local_box(coord))
    return (box, local) if writer == rank else None


def _write_rank_file(tensors: dict, filename: str) -> None:
    """Write one rank's pieces and make them durable (tests replace this to simulate crashes)."""
    from safetensors.torch import save_file

    save_file(tensors, filename, metadata={"format": "pt", "writer": "autopar"})
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
    desc = [_describe(l) if l.is_tensor else {"path": list(l.path)} for l in leaves]
    text = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), len(leaves)


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
