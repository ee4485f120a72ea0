"""Nested state dicts <-> leaves addressed by key paths ("state.0.exp_avg").

A state dict is a mapping whose values are tensors, nested mappings, lists/tuples that hold
tensors (walked item by item), or anything else: a *value leaf* (ints, floats, strings, None,
lists of them such as an optimizer's `param_groups`), stored as JSON.  Keys are str or int;
a leaf's name is its path joined with dots, and two leaves may not share a name.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

import torch

Path = tuple  # of str | int


class Leaf(NamedTuple):
    path: Path
    name: str
    value: Any

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)


def path_name(path: Path) -> str:
    return ".".join(str(p) for p in path)


def _holds_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def _walk(obj, path: Path, out: list[Leaf]) -> None:
    """Append the leaves under `obj` to `out` (a list, not generators: a save walks every leaf
    of a model's and an optimizer's state dicts each time)."""
    if isinstance(obj, torch.Tensor):
        out.append(Leaf(path, path_name(path), obj))
    elif isinstance(obj, Mapping):  # an empty dict has no leaves (a fresh optimizer's state)
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(
                    f"state dict key {k!r} under {path_name(path) or '<root>'!r} must be a str or an int"
                )
            _walk(v, path + (k,), out)
    elif isinstance(obj, (list, tuple)) and _holds_tensor(obj):
        for i, v in enumerate(obj):
            _walk(v, path + (i,), out)
    else:
        out.append(Leaf(path, path_name(path), obj))


def flatten(state_dict: Mapping) -> list[Leaf]:
    """Every leaf of `state_dict` in its iteration order; raises on clashing names."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict must be a mapping, got {type(state_dict).__name__}")
    leaves: list[Leaf] = []
    _walk(state_dict, (), leaves)
    names: dict[str, Path] = {}
    for leaf in leaves:
        other = names.setdefault(leaf.name, leaf.path)
        if other != leaf.path:
            raise ValueError(
                f"state dict keys {list(other)} and {list(leaf.path)} both flatten to {leaf.name!r}"
            )
    return leaves


_MISSING = object()


def lookup(root, path: Path):
    """(depth, object): how many components of `path` exist in `root`, and the deepest one."""
    obj = root
    for depth, key in enumerate(path):
        child = _MISSING
        if isinstance(obj, Mapping):
            child = obj.get(key, _MISSING)
        elif isinstance(obj, (list, tuple)) and isinstance(key, int) and 0 <= key < len(obj):
            child = obj[key]
        if child is _MISSING:
            return depth, obj
        obj = child
    return len(path), obj


def can_create(root, path: Path) -> bool:
    """Whether a saved entry the target lacks should be created in it.

    Yes when the deepest existing container on its path is a dict that is empty or keyed by
    ints: an optimizer's per-parameter `state` (empty before the first step) or a state dict
    left empty to receive everything.  Other extra entries (a model state dict's unexpected
    keys) are not loaded.
    """
    depth, obj = lookup(root, path)
    if depth == len(path) or not isinstance(obj, MutableMapping):
        return False
    return all(isinstance(k, int) and not isinstance(k, bool) for k in obj)


def set_path(root, path: Path, value) -> None:
    """Put `value` at `path` in `root`, creating dicts for missing levels (tuples are rebuilt)."""
    _set(root, path, value)


def _set(obj, path: Path, value):
    key = path[0]
    if len(path) == 1:
        child = value
    else:
        depth, current = lookup(obj, path[:1])
        child = _set(current if depth == 1 else {}, path[1:], value)
    if isinstance(obj, tuple):
        items = list(obj)
        items[key] = child
        return type(obj)._make(items) if hasattr(type(obj), "_make") else type(obj)(items)
    obj[key] = child
    return obj
