"""The checkpoint's on-disk description: file names, metadata.json, and what goes in it.

A checkpoint is a directory:

    metadata.json           written by rank 0: every tensor's global shape, dtype, the mesh and
                            placements it was saved with, its pieces (file, key, global box,
                            crc32), each data file's size, the non-tensor values, and a
                            sha256 of all that (an edit that keeps the JSON valid, such as
                            two swapped boxes, would otherwise load wrong rows silently)
    rank00000.safetensors   the pieces rank 0 wrote (only ranks that wrote something have one)
    rank00003.safetensors   ...

Boxes are [[start, stop], ...] per tensor dim, in global coordinates.  Non-tensor values are
JSON with two tags: {"__tuple__": [...]} and {"__dict__": [[key, value], ...]} (a dict with
non-str keys), so `betas=(0.9, 0.999)` comes back a tuple.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from typing import Any, Sequence

import torch

from ..mesh import ProcessMesh
from ..placement import Partial, Placement, Replicate, Shard

FORMAT = "autopar-checkpoint"
VERSION = 2  # 2: the metadata carries its own checksum (version 1 files are read without it)
METADATA_FILE = "metadata.json"

Box = list  # [[start, stop], ...]


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


_RANK_FILE = re.compile(r"^rank\d{5,}\.safetensors$")


# -- boxes -------------------------------------------------------------------------------------
def volume(box: Sequence[Sequence[int]]) -> int:
    return math.prod(b - a for a, b in box)


def intersect(x: Sequence[Sequence[int]], y: Sequence[Sequence[int]]):
    """The common box of `x` and `y`, or None when they do not overlap (0-d boxes always do)."""
    out = [[max(a, c), min(b, d)] for (a, b), (c, d) in zip(x, y)]
    return None if any(a >= b for a, b in out) else out


def contains(outer, inner) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


# -- checksums ---------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as stored (row-major, little-endian), without a copy when contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def checksum(t: torch.Tensor) -> str:
    return f"crc32:{zlib.crc32(tensor_bytes(t)) & 0xFFFFFFFF:08x}"


# -- dtypes, meshes, placements -----------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def describe_mesh(mesh: ProcessMesh | None):
    if mesh is None:
        return None
    return {"shape": mesh.shape, "process_ids": mesh.process_ids, "dim_names": mesh.dim_names}


def parse_mesh(d) -> ProcessMesh:
    import numpy as np

    return ProcessMesh(np.array(d["process_ids"]).reshape(d["shape"]).tolist(), d["dim_names"])


def describe_placement(p: Placement) -> dict:
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim}
    if isinstance(p, Partial):
        return {"type": "partial", "reduce_type": p.reduce_type.value}
    return {"type": "replicate"}


def parse_placement(d) -> Placement:
    kind = d.get("type")
    if kind == "shard":
        return Shard(int(d["dim"]))
    if kind == "partial":
        return Partial(d["reduce_type"])
    if kind == "replicate":
        return Replicate()
    raise ValueError(f"unknown placement {d!r}")


# -- non-tensor values ---------------------------------------------------------------------------
def encode_value(v: Any, where: str):
    """JSON form of a non-tensor leaf; raises TypeError naming `where` for what JSON cannot hold."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [encode_value(x, where) for x in v]
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x, where) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in v):
            return {k: encode_value(x, where) for k, x in v.items()}
        return {"__dict__": [[encode_value(k, where), encode_value(x, where)] for k, x in v.items()]}
    raise TypeError(
        f"state dict entry {where!r} holds a {type(v).__name__}, which a checkpoint cannot store "
        f"(tensors and JSON-like values only: None, bool, int, float, str, list, tuple, dict)"
    )


def decode_value(v):
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(decode_value(x) for x in v["__tuple__"])
        if set(v) == {"__dict__"}:
            return {_hashable(decode_value(k)): decode_value(x) for k, x in v["__dict__"]}
        return {k: decode_value(x) for k, x in v.items()}
    return v


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


# -- the metadata file ---------------------------------------------------------------------------
def metadata_checksum(meta: dict) -> str:
    """sha256 of the metadata's canonical JSON, its own checksum left out."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def write_metadata(directory: str, meta: dict) -> None:
    path = os.path.join(directory, METADATA_FILE)
    meta = {**meta, "checksum": metadata_checksum(meta)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class MetadataError(ValueError):
    pass


def read_metadata(directory: str) -> dict:
    """Parse and validate metadata.json; raises MetadataError saying what is wrong."""
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MetadataError(f"checkpoint metadata {path} is not valid JSON ({e}): the file is corrupted") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise MetadataError(f"{path} is not an autopar checkpoint metadata file (no format {FORMAT!r})")
    if meta.get("version") not in (1, VERSION):
        raise MetadataError(f"{path} has checkpoint format version {meta.get('version')!r}; this autopar reads 1 and {VERSION}")
    if meta["version"] >= 2 and meta.get("checksum") != metadata_checksum(meta):
        raise MetadataError(
            f"checkpoint metadata {path} does not match its checksum: it was edited or corrupted after it was "
            f"written, and its tensor layout cannot be trusted"
        )
    try:
        _validate(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise MetadataError(f"checkpoint metadata {path} is malformed: {e}") from None
    return meta


def _int_list(x, what):
    if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise ValueError(f"{what} must be a list of ints, got {x!r}")
    return x


def _validate(meta: dict) -> None:
    files = meta["files"]
    if not isinstance(files, dict):
        raise TypeError("'files' must be an object")
    for name, info in files.items():
        if not _RANK_FILE.match(name):
            raise ValueError(f"bad data file name {name!r}")
        if not isinstance(info.get("size"), int):
            raise ValueError(f"data file {name!r} has no size")
    tensors = meta["tensors"]
    if not isinstance(tensors, dict):
        raise TypeError("'tensors' must be an object")
    for name, e in tensors.items():
        where = f"tensor {name!r}"
        shape = _int_list(e["shape"], f"{where}: shape")
        if any(s < 0 for s in shape):
            raise ValueError(f"{where}: negative size in shape {shape}")
        parse_dtype(e["dtype"])
        if not isinstance(e["path"], list):
            raise TypeError(f"{where}: path must be a list")
        total = 0
        for p in e["pieces"]:
            if p["file"] not in files:
                raise ValueError(f"{where}: piece in unknown file {p['file']!r}")
            if not isinstance(p["key"], str) or not isinstance(p["checksum"], str):
                raise TypeError(f"{where}: piece key and checksum must be strings")
            box = p["box"]
            if not isinstance(box, list) or len(box) != len(shape):
                raise ValueError(f"{where}: piece box {box!r} does not match shape {shape}")
            for (a, b), s in zip((_int_list(d, f"{where}: box") for d in box), shape):
                if not 0 <= a < b <= s:
                    raise ValueError(f"{where}: piece box {box} lies outside shape {shape}")
            total += volume(box)
        if total != math.prod(shape):
            raise ValueError(
                f"{where}: its pieces hold {total} elements but shape {shape} has {math.prod(shape)}"
            )
    values = meta["values"]
    if not isinstance(values, dict) or not all(isinstance(v.get("path"), list) and "value" in v for v in values.values()):
        raise TypeError("'values' must map names to {path, value}")
