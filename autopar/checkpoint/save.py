"""save_state_dict: every rank writes its own pieces; rank 0 writes the metadata and swaps the
finished checkpoint into place.

Steps (each `agree` is one small all-gather that also acts as a barrier, and raises the same
error on every rank when any rank had one):

1. flatten the state dict; agree that every rank has the same entries (names, shapes,
   dtypes, meshes, placements) and on rank 0's name for the temporary directory
   `.<name>.tmp-<token>` next to `path` (same filesystem, so renames are atomic);
2. reduce Partial tensors (the checkpoint holds global values), write this rank's pieces -
   for each distinct box only the lowest rank holding it writes - into
   `rankNNNNN.safetensors`, fsync it, checksum every piece; agree (on failure the temporary
   directory is removed and `path` was never touched);
3. rank 0 writes metadata.json, fsyncs, and swaps the directory in: an atomic exchange
   (renameat2 RENAME_EXCHANGE) where the OS has one, else rename old away / rename new in /
   delete old (a crash between those two renames leaves the old checkpoint at
   `.<name>.old-<token>`, which load_state_dict falls back to); agree once more so no
   rank returns before the checkpoint is in place.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import time
import uuid

import numpy as np
import torch

from ..dtensor import DistTensor
from ..placement import Partial, Replicate
from ..reshard import redistribute_local
from . import sync
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
    previous checkpoint at `path` stays intact until the new one is complete.

    >>> import torch, tempfile, os, autopar as dist
    >>> from autopar.checkpoint import save_state_dict, load_state_dict
    >>> d = tempfile.mkdtemp()
    >>> save_state_dict({"w": torch.arange(4.), "step": 3}, os.path.join(d, "ckpt"))
    >>> sd = {"w": torch.zeros(4), "step": 0}
    >>> load_state_dict(sd, os.path.join(d, "ckpt")); sd
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    """
    rank, world = sync.world()
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    what = f"save_state_dict({path!r})"
    untouched = f"the checkpoint at {path} is unchanged"

    # 1. entries, agreement on them and on the temporary directory -------------------------
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
            _check_replaceable(path)
            mine["token"] = f"{uuid.uuid4().hex[:12]}"
    except Exception as e:
        problems.add(f"rank {rank}: {_err(e)}")
    first = sync.agree(problems, what, "nothing was written; " + untouched, mine)
    digests = {d["digest"] for d in first}
    if len(digests) > 1:
        groups: dict = {}
        for r, d in enumerate(first):
            groups.setdefault((d["digest"], d["entries"]), []).append(r)
        desc = "; ".join(f"ranks {rs} have {n} entries (digest {dg[:8]})" for (dg, n), rs in groups.items())
        raise CheckpointError(
            f"{what} failed; nothing was written: the state dicts differ across ranks ({desc}). "
            f"Every rank must pass the same keys, shapes, dtypes, meshes and placements."
        )
    token = first[0]["token"]
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    tensors = [l for l in leaves if l.is_tensor]

    # 2. this rank's pieces ------------------------------------------------------------------
    problems = Problems()
    records, file_info = [], None
    try:
        pieces = _my_pieces(tensors, rank)  # collective for Partial tensors: same order everywhere
        os.makedirs(tmp, exist_ok=True)
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
        problems.add(f"rank {rank} writing its pieces into {tmp}: {_err(e)}")
    cleanup = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if rank == 0 else (lambda: None)
    gathered = sync.agree(problems, what, untouched, {"file": file_info, "pieces": records}, on_failure=cleanup)

    # 3. metadata and the swap (rank 0) ------------------------------------------------------
    problems = Problems()
    if rank == 0:
        try:
            meta = _build_metadata(tensors, values, gathered, world)
            write_metadata(tmp, meta)
            _fsync_dir(tmp)
            _crash_point("metadata_written")
            _swap_into_place(tmp, path, token)
            _remove_leftovers(parent, base)
        except Exception as e:
            problems.add(f"rank 0 putting the checkpoint in place: {_err(e)}")
            shutil.rmtree(tmp, ignore_errors=True)
    sync.agree(problems, what, untouched)


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
def _check_replaceable(path: str) -> None:
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        if os.path.isfile(os.path.join(path, METADATA_FILE)) or not os.listdir(path):
            return
    raise CheckpointError(
        f"refusing to replace {path}: it exists and is not an autopar checkpoint "
        f"(no {METADATA_FILE} in it); remove it or pick another path"
    )


def _swap_into_place(tmp: str, final: str, token: str) -> None:
    parent, base = os.path.split(final)
    if not os.path.lexists(final):
        os.rename(tmp, final)
        _fsync_dir(parent)
        return
    if _exchange(tmp, final):  # atomic: `final` is the new checkpoint, `tmp` the old one
        _fsync_dir(parent)
        _crash_point("swapped")
        shutil.rmtree(tmp)
        return
    old = os.path.join(parent, f".{base}.old-{token}")
    os.rename(final, old)
    try:
        _crash_point("old_moved_away")
        os.rename(tmp, final)
    except Exception:
        os.rename(old, final)  # never leave `final` without a checkpoint
        raise
    _fsync_dir(parent)
    _crash_point("new_in_place")
    shutil.rmtree(old)


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


def _remove_leftovers(parent: str, base: str) -> None:
    """Temporary and old directories that crashed saves of this path left behind."""
    stem = os.path.join(parent, "." + glob.escape(base))
    for leftover in glob.glob(stem + ".tmp-*") + glob.glob(stem + ".old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


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
