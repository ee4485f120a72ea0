"""load_state_dict: read a checkpoint into the tensors of a state dict, in place, resharding to
whatever mesh and placements they have now.

Every rank works out the box of its local piece under the target placements, reads only the
overlapping parts of the saved pieces (safetensors slices, not whole files) into new buffers,
and checks on the way: metadata parses, every requested entry is there with the saved global
shape and dtype, each data file exists with the recorded size, each piece has the recorded
shape and dtype, and its crc32 matches.  A piece read whole is checked by its reader; a piece
every reader only slices is read whole and checked by one of them (chosen by piece), so every
piece touched is verified once without each rank reading it all.  Then all ranks agree (one
all-gather of their errors): on any error the same CheckpointError is raised everywhere and
no target is touched; otherwise the buffers are copied into the targets.
"""
from __future__ import annotations

import contextlib
import glob
import os
import warnings
from typing import Any

import numpy as np
import torch

from ..comm import current_device
from ..tensor.dtensor import DistTensor
from ..placement import Partial, ReduceType
from ..redistribute import redistribute_local
from ..spec import DistSpec, TensorMeta
from . import sync
from .errors import Problems
from .flatten import can_create, flatten, set_path
from .metadata import (
    METADATA_FILE,
    MetadataError,
    checksum,
    contains,
    decode_value,
    intersect,
    parse_dtype,
    parse_mesh,
    parse_placement,
    read_metadata,
    volume,
)
from .save import wait_for_saves


def load_state_dict(state_dict, path) -> None:
    """Load the checkpoint at `path` into `state_dict` in place, collectively over the job.

    Tensors keep their objects: a DistTensor gets its local piece of the saved global value
    under its current mesh/placements (Partial targets: the value on the first coordinate,
    zeros elsewhere for sum); a plain tensor gets the whole value.  Non-tensor values (step
    counters, `param_groups`) are written back into the dict.  Saved entries the state dict
    lacks are added where the nearest existing dict is empty or keyed by ints - a fresh
    optimizer's `state` - under the saved mesh/placements when that mesh fits this job, else
    as plain tensors; so `sd = opt.state_dict(); load_state_dict(sd, p); opt.load_state_dict(sd)`
    works.  A symlinked `path` is followed.  Raises CheckpointError on every rank, with
    nothing changed, if anything does not check out; CheckpointNotFoundError (a
    FileNotFoundError) only when no rank finds a directory with metadata at `path` - a damaged
    checkpoint, or one only some ranks see, is never mistaken for a missing one.  An
    asynchronous save still running finishes first (a load sees every save made before it;
    that save's error is raised here if nobody has seen it).
    """
    wait_for_saves()
    rank, world = sync.world()
    given = os.fspath(path)
    problems = Problems()
    plan = None
    try:
        plan = _Loader(state_dict, os.path.realpath(given), rank, world, problems).plan()
    except Exception as e:
        problems.add(f"rank {rank}: {type(e).__name__}: {e}")
    sync.agree(problems, f"load_state_dict({given!r})", "nothing in the state dict was changed")
    plan.commit(state_dict)


class _Job:
    """One tensor to fill: an existing target, or a saved entry to create (`target` None)."""

    def __init__(self, name: str, entry: dict, target: torch.Tensor | None, spec: DistSpec | None):
        self.name, self.entry, self.target, self.spec = name, entry, target, spec
        self.staged: torch.Tensor | None = None


class _Plan:
    def __init__(self, jobs: list[_Job], assigns: list[tuple[tuple, Any]]):
        self.jobs, self.assigns = jobs, assigns

    def commit(self, state_dict) -> None:
        with torch.no_grad():
            for job in self.jobs:
                t = job.target
                if t is None:
                    value = job.staged if job.spec is None else DistTensor(job.staged.to(current_device()), job.spec)
                    set_path(state_dict, tuple(job.entry["path"]), value)
                elif isinstance(t, DistTensor):
                    staged = job.staged
                    if job.spec.strided_dims():  # read as boxes (see _stage), then cut into blocks
                        whole = job.spec.without_partial()
                        staged = redistribute_local(staged, whole.as_boxes(), whole)
                    if t._local.numel():
                        t._local.copy_(staged)
                else:
                    t.copy_(job.staged)
        for p, value in self.assigns:
            set_path(state_dict, p, value)


class _Loader:
    def __init__(self, state_dict, path: str, rank: int, world: int, problems: Problems):
        self.state_dict, self.path, self.rank, self.world = state_dict, path, rank, world
        self.problems = problems
        self.has_group = world > 1 or sync.has_group()

    def plan(self) -> _Plan | None:
        leaves = flatten(self.state_dict)
        root = self._resolve()
        if root is None:
            return None
        try:
            meta = read_metadata(root)
        except MetadataError as e:
            self.problems.add(str(e))
            return None
        except FileNotFoundError as e:  # gone since _resolve saw it
            self.problems.not_found(f"no checkpoint at {root}: {e}")
            return None
        except OSError as e:  # there, but unreadable: not a checkpoint to start over without
            self.problems.add(f"cannot read checkpoint metadata in {root}: {e}")
            return None
        saved_t, saved_v = meta["tensors"], meta["values"]
        jobs, assigns, asked = [], [], set()
        for leaf in leaves:
            asked.add(leaf.name)
            if leaf.is_tensor:
                entry = saved_t.get(leaf.name)
                if entry is None:
                    self._missing(leaf.name, "tensor", root, saved_t, saved_v)
                elif self._matches(leaf.name, leaf.value, entry):
                    spec = leaf.value._spec if isinstance(leaf.value, DistTensor) else None
                    jobs.append(_Job(leaf.name, entry, leaf.value, spec))
            else:
                entry = saved_v.get(leaf.name)
                if entry is None:
                    self._missing(leaf.name, "value", root, saved_t, saved_v)
                else:
                    assigns.append((leaf.path, decode_value(entry["value"])))
        for name, entry in saved_t.items():
            if name not in asked and can_create(self.state_dict, tuple(entry["path"])):
                jobs.append(_Job(name, entry, None, self._created_spec(entry)))
        for name, entry in saved_v.items():
            if name not in asked and can_create(self.state_dict, tuple(entry["path"])):
                assigns.append((tuple(entry["path"]), decode_value(entry["value"])))
        if self.problems:
            return None
        with _Files(root, meta, self.problems) as files:
            for job in jobs:
                job.staged = self._stage(job, files)
        return _Plan(jobs, assigns)

    # -- checks --------------------------------------------------------------------------------
    def _resolve(self) -> str | None:
        path = self.path
        if os.path.isfile(os.path.join(path, METADATA_FILE)):
            return path
        if not os.path.exists(path):
            # a save that crashed between its two renames leaves the old checkpoint here
            parent, base = os.path.split(path)
            olds = [d for d in glob.glob(os.path.join(parent, "." + glob.escape(base) + ".old-*"))
                    if os.path.isfile(os.path.join(d, METADATA_FILE))]
            if olds:
                old = max(olds, key=os.path.getmtime)
                warnings.warn(f"no checkpoint at {path}; loading {old}, left there by an interrupted save")
                return old
            self.problems.not_found(f"no checkpoint at {path}: the path does not exist")
        elif os.path.isdir(path) and glob.glob(os.path.join(glob.escape(path), "rank*.safetensors")):
            # a save puts metadata.json in before the directory: this one was damaged since
            self.problems.add(f"the checkpoint at {path} has data files but no {METADATA_FILE}: it is damaged")
        elif os.path.isdir(path):
            self.problems.not_found(f"no checkpoint at {path}: the directory has no {METADATA_FILE}")
        else:
            self.problems.not_found(f"no checkpoint at {path}: it is a file, not a checkpoint directory")
        return None

    def _missing(self, name, kind, root, saved_t, saved_v) -> None:
        if name in saved_t or name in saved_v:
            held = "a tensor" if name in saved_t else "a non-tensor value"
            self.problems.add(f"{kind} {name!r}: the checkpoint at {root} holds {held} under that key")
            return
        known = sorted(list(saved_t) + list(saved_v))
        sample = ", ".join(repr(k) for k in known[:8]) + (", ..." if len(known) > 8 else "")
        self.problems.add(
            f"{kind} {name!r} is not in the checkpoint at {root} ({len(known)} entries: {sample})"
        )

    def _matches(self, name: str, t: torch.Tensor, entry: dict) -> bool:
        shape, dtype = list(entry["shape"]), parse_dtype(entry["dtype"])
        if list(t.shape) != shape or t.dtype != dtype:
            self.problems.add(
                f"tensor {name!r}: the checkpoint has shape {shape} ({entry['dtype']}) but the target has "
                f"shape {list(t.shape)} ({str(t.dtype).removeprefix('torch.')})"
            )
            return False
        return True

    def _created_spec(self, entry: dict) -> DistSpec | None:
        """Saved mesh/placements when they fit this job; None (a plain tensor) otherwise."""
        if entry.get("mesh") is None or not self.has_group:
            return None
        mesh = parse_mesh(entry["mesh"])
        if max(mesh.process_ids) >= self.world:
            return None
        placements = [parse_placement(p) for p in entry["placements"]]
        return DistSpec(mesh, placements, TensorMeta.contiguous(entry["shape"], parse_dtype(entry["dtype"])))

    # -- reading -------------------------------------------------------------------------------
    def _stage(self, job: _Job, files: "_Files") -> torch.Tensor | None:
        entry, spec = job.entry, job.spec
        if spec is not None and spec.strided_dims():
            if spec.partial_dims():
                self.problems.add(f"tensor {job.name!r}: loading into {list(spec.placements)} (strided and "
                                  f"partial at once) is not supported; load it replicated and reshard")
                return None
            spec = spec.as_boxes()  # the pieces of the same sizes that are boxes; commit cuts them into blocks
        dtype = parse_dtype(entry["dtype"])
        full = [[0, s] for s in entry["shape"]]
        if spec is None:
            need = full
            needs = None  # every rank reads every piece whole
            local_shape = tuple(entry["shape"])
        else:
            coord = spec.mesh.coordinate(self.rank)
            if coord is None:
                return torch.empty(0, dtype=dtype)
            whole = spec.without_partial()
            local_shape = whole.local_shape(coord)
            if job.target is not None and tuple(job.target._local.shape) != local_shape:
                self.problems.add(
                    f"tensor {job.name!r}: rank {self.rank} holds a piece of shape {list(job.target._local.shape)} "
                    f"but {list(spec.placements)} on {spec.mesh} gives it {list(local_shape)}"
                )
                return None
            need = _need_box(spec, whole, coord)
            if need is None:  # a sum-Partial term off the first coordinate
                return torch.zeros(local_shape, dtype=dtype)
            needs = None
        staged = torch.empty(local_shape, dtype=dtype)
        covered = 0
        for i, piece in enumerate(entry["pieces"]):
            inter = intersect(need, piece["box"])
            if inter is None:
                continue
            whole_piece = contains(need, piece["box"])
            verify = whole_piece
            if not whole_piece:
                if needs is None:
                    needs = _all_needs(spec)
                verify = _verifier(needs, piece["box"], i) == self.rank
            in_piece = [[a - p0, b - p0] for (a, b), (p0, _) in zip(inter, piece["box"])]
            data = files.read(job.name, entry, piece, None if verify else in_piece, verify)
            if data is None:
                continue
            if verify and not whole_piece:
                data = data[_slices(in_piece)]
            staged[_slices([[a - n0, b - n0] for (a, b), (n0, _) in zip(inter, need)])] = data
            covered += volume(inter)
        if covered != volume(need) and not self.problems:
            self.problems.add(
                f"tensor {job.name!r}: the saved pieces cover {covered} of the {volume(need)} elements "
                f"rank {self.rank} needs (box {need}): the checkpoint metadata is inconsistent"
            )
        return staged


def _slices(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def _need_box(spec: DistSpec, whole: DistSpec, coord) -> list | None:
    """The global box a mesh coordinate reads; None for a sum-Partial term that stays zero."""
    for m, p in enumerate(spec.placements):
        if type(p) is Partial and p.reduce_type is ReduceType.SUM and coord[m] != 0:
            return None
    return [list(b) for b in whole.local_box(coord)]


def _all_needs(spec: DistSpec) -> list[tuple[int, list | None]]:
    whole = spec.without_partial()
    return [(int(r), _need_box(spec, whole, c)) for c, r in np.ndenumerate(spec.mesh.mesh)]


def _verifier(needs, box, index: int) -> int | None:
    """Who reads a piece whole to check it: nobody extra when some rank needs all of it anyway,
    else one of the ranks that slice it, spread over pieces."""
    touching = []
    for r, need in needs:
        if need is None or intersect(need, box) is None:
            continue
        if contains(need, box):
            return None
        touching.append(r)
    return touching[index % len(touching)] if touching else None


class _Files:
    """Open data files on demand; check each one's existence and size once."""

    def __init__(self, root: str, meta: dict, problems: Problems):
        self.root, self.meta, self.problems = root, meta, problems
        self.handles: dict = {}
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def _handle(self, fname: str, name: str):
        if fname in self.handles:
            return self.handles[fname]
        from safetensors import safe_open

        path = os.path.join(self.root, fname)
        handle = None
        expected = self.meta["files"][fname]["size"]
        if not os.path.isfile(path):
            self.problems.add(f"tensor {name!r}: data file {path} is missing")
        elif os.path.getsize(path) != expected:
            self.problems.add(
                f"tensor {name!r}: data file {path} has {os.path.getsize(path)} bytes but the checkpoint "
                f"recorded {expected}: it is truncated or was overwritten"
            )
        else:
            try:
                handle = self.stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except Exception as e:
                self.problems.add(f"tensor {name!r}: data file {path} is not a readable safetensors file ({e})")
        self.handles[fname] = handle
        return handle

    def read(self, name: str, entry: dict, piece: dict, region, verify: bool) -> torch.Tensor | None:
        """The piece whole (`region` None) or its `region` (box relative to the piece)."""
        handle = self._handle(piece["file"], name)
        if handle is None:
            return None
        path = os.path.join(self.root, piece["file"])
        where = f"tensor {name!r}: piece {piece['box']} (key {piece['key']!r}) in {path}"
        try:
            sl = handle.get_slice(piece["key"])
            shape = [b - a for a, b in piece["box"]]
            if list(sl.get_shape()) != shape:
                self.problems.add(f"{where} has shape {list(sl.get_shape())}, expected {shape}: the file is corrupted")
                return None
            data = handle.get_tensor(piece["key"]) if region is None else sl[_slices(region)]
        except Exception as e:
            self.problems.add(f"{where} cannot be read ({type(e).__name__}: {e}): the file is corrupted")
            return None
        if data.dtype != parse_dtype(entry["dtype"]):
            self.problems.add(f"{where} has dtype {data.dtype}, expected {entry['dtype']}: the file is corrupted")
            return None
        if verify:
            got = checksum(data)
            if got != piece["checksum"]:
                self.problems.add(
                    f"{where}: checksum mismatch (saved {piece['checksum']}, read {got}): the file is corrupted"
                )
                return None
        return data
