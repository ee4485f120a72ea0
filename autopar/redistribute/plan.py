"""Plan a same-mesh reshard as the cheapest sequence of one-mesh-dim steps.

A step changes the placement on a single mesh dim with one collective (or none):

    S->R all_gather, P->R all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all,
    R->S slice, R->P / S->P local (zero or identity fill)

Adjacent all-reduces of the same reduce op on several mesh dims then merge into one
all-reduce over the ranks spanning those dims: fewer collectives and fewer bytes
(2(k1 k2 - 1)/(k1 k2) of the tensor instead of 2(k1-1)/k1 + 2(k2-1)/k2).

Shards nest in mesh-dim order (see spec.py), so a step may add or remove a shard of tensor
dim d on mesh dim m only while no later mesh dim shards d.  The planner runs Dijkstra over
placement tuples with bytes-sent-per-rank as the cost; the result is cached per spec pair.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from functools import lru_cache

from ..placement import Partial, Placement, Replicate, Shard
from ..spec import DistSpec, _itemsize


@dataclass(frozen=True)
class Step:
    """Change mesh dim `mesh_dim` from `src` to `dst` with `kind` (collective or local op);
    `also` lists further mesh dims that the same all-reduce takes from `src` to `dst`."""

    mesh_dim: int
    kind: str
    src: Placement
    dst: Placement
    also: tuple = ()

    @property
    def mesh_dims(self) -> tuple:
        return tuple(sorted((self.mesh_dim,) + self.also))


def step_kind(src: Placement, dst: Placement) -> str:
    if src == dst:
        return "noop"
    if type(src) is Partial:
        if type(dst) is Replicate:
            return "all_reduce"
        if type(dst) is Shard:
            return "reduce_scatter"
        return "repartial"
    if type(src) is Shard:
        if type(dst) is Replicate:
            return "all_gather"
        if type(dst) is Shard:
            return "all_to_all"
        return "shard_to_partial"
    return "slice" if type(dst) is Shard else "to_partial"


def _valid(placements: tuple, mesh_dim: int, src: Placement, dst: Placement) -> bool:
    """A step may touch tensor dim d on mesh dim m only if no later mesh dim shards d."""
    touched = {p.dim for p in (src, dst) if type(p) is Shard}
    if not touched:
        return True
    for p in placements[mesh_dim + 1:]:
        if type(p) is Shard and p.dim in touched:
            return False
    return True


def _local_numel(shape: tuple, mesh_shape: tuple, placements: tuple) -> float:
    """Elements held per rank (average piece) under `placements`."""
    n = 1.0
    for s in shape:
        n *= s
    for m, p in enumerate(placements):
        if type(p) is Shard:
            n /= mesh_shape[m]
    return n


def step_bytes(kind: str, k: int, local_bytes: float) -> float:
    """Bytes one rank sends for `kind` over k ranks, given its local bytes before the step."""
    if k == 1:
        return 0.0
    if kind == "all_gather":
        return local_bytes * (k - 1)
    if kind == "all_reduce":
        return 2.0 * local_bytes * (k - 1) / k
    if kind in ("reduce_scatter", "all_to_all"):
        return local_bytes * (k - 1) / k
    if kind == "repartial":  # reduce fully, then re-partial locally
        return 2.0 * local_bytes * (k - 1) / k
    return 0.0


@lru_cache(maxsize=4096)
def plan_steps(mesh_shape: tuple, shape: tuple, itemsize: int, src: tuple, dst: tuple) -> tuple:
    """Cheapest valid step sequence from placements `src` to `dst` (pure, cached)."""
    if src == dst:
        return ()
    options = []
    for m in range(len(mesh_shape)):
        opts = {src[m], dst[m], Replicate()}
        opts |= {Shard(p.dim) for p in src + dst if type(p) is Shard}
        options.append(opts)
    counter = itertools.count()
    best = {src: 0.0}
    heap = [(0.0, 0, next(counter), src, ())]
    while heap:
        cost, nsteps, _, state, path = heapq.heappop(heap)
        if state == dst:  # steps on mesh dims of size 1 move nothing: drop them
            return _merge_all_reduces(tuple(st for st in path if mesh_shape[st.mesh_dim] > 1))
        if cost > best.get(state, float("inf")):
            continue
        local_bytes = _local_numel(shape, mesh_shape, state) * itemsize
        for m, cur in enumerate(state):
            for nxt in options[m]:
                if nxt == cur or not _valid(state, m, cur, nxt):
                    continue
                if type(nxt) is Partial and nxt != dst[m]:
                    continue  # never invent a partial the target does not ask for
                kind = step_kind(cur, nxt)
                c = cost + step_bytes(kind, mesh_shape[m], local_bytes)
                new_state = state[:m] + (nxt,) + state[m + 1:]
                if c < best.get(new_state, float("inf")) - 1e-9:
                    best[new_state] = c
                    step = Step(m, kind, cur, nxt)
                    heapq.heappush(heap, (c, nsteps + 1, next(counter), new_state, path + (step,)))
    raise AssertionError(f"no reshard path from {src} to {dst}")  # unreachable: via Replicate always works


def _merge_all_reduces(path: tuple) -> tuple:
    """Fold runs of adjacent all-reduces with the same Partial into one multi-dim step."""
    out: list = []
    for st in path:
        prev = out[-1] if out else None
        if st.kind == "all_reduce" and prev is not None and prev.kind == "all_reduce" and prev.src == st.src:
            out[-1] = Step(prev.mesh_dim, "all_reduce", prev.src, prev.dst, prev.also + (st.mesh_dim,))
        else:
            out.append(st)
    return tuple(out)


def group_size(mesh_shape: tuple, st: Step) -> int:
    k = 1
    for m in st.mesh_dims:
        k *= mesh_shape[m]
    return k


def plan(src: DistSpec, dst: DistSpec) -> tuple:
    """Steps turning `src` into `dst` (same mesh, same global meta)."""
    return plan_steps(
        tuple(src.mesh.shape), src.meta.shape, _itemsize(src.meta.dtype), src.placements, dst.placements
    )


def plan_bytes(src: DistSpec, dst: DistSpec) -> float:
    """Bytes a rank sends (on average) to carry out `plan(src, dst)`."""
    total, state = 0.0, src.placements
    mesh_shape = tuple(src.mesh.shape)
    for st in plan(src, dst):
        local = _local_numel(src.meta.shape, mesh_shape, state) * _itemsize(src.meta.dtype)
        total += step_bytes(st.kind, group_size(mesh_shape, st), local)
        for m in st.mesh_dims:
            state = state[:m] + (st.dst,) + state[m + 1:]
    return total
