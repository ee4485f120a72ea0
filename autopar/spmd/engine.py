"""Expand single-mesh-dim strategies over a mesh and pick the cheapest per mesh dim.

Cost of a strategy on mesh dim m = bytes the inputs must move to meet it, from the
placements they have now.  Partial->Shard is priced as a full reduction so that a rule's
free choice never turns a Partial input into a Shard (Paddle's auto-parallel rule: a
non-linear op makes a Partial input Replicate); when the strategy is forced (in-place ops)
the reshard itself still uses the cheaper reduce-scatter.  Keeping a Partial input Partial
by gathering another operand is also charged the later reduction of the Partial output (see
`_deferred_reduction`).  Ties go to the strategy that changes fewer inputs (nothing is
sliced or moved without a reason), then to the one whose outputs are sharded more (less
memory for the same traffic), then to the rule's order, all-Replicate first.
"""
from __future__ import annotations

import logging
import warnings

from ..mesh import ProcessMesh
from ..placement import Partial, Replicate, Shard, StridedShard
from ..spec import strided_cuts_valid
from .registry import STRIDED_KERNELS, rule_for
from .strategy import OpCall, OpStrategy, replicated

log = logging.getLogger("autopar.spmd")
_WARNED: set = set()
INPLACE_PENALTY = 1e30
_SPLIT = (Shard, StridedShard)


def conversion_cost(cur, tgt, local_bytes: float, k: int) -> float:
    """Bytes one rank sends to take one input from `cur` to `tgt` on a mesh dim of size k."""
    if tgt is None or cur == tgt or k == 1:
        return 0.0
    tc, tt = type(cur), type(tgt)
    if tc is Replicate:
        return 0.0  # slice or keep-one-term: local
    if tc is Shard or tc is StridedShard:
        if tt is Shard and tc is Shard:
            return local_bytes * (k - 1) / k
        return local_bytes * (k - 1)  # gather (for ->Partial: gather-priced, it bloats memory)
    reduction = 2.0 * local_bytes * (k - 1) / k  # Partial -> anything else: a full reduction
    # ...and a free choice of Shard over Replicate after it must not win on memory
    return reduction + 1.0 if tt is Shard else reduction


def _local_bytes(meta, placements, mesh_shape, skip: int) -> float:
    n = float(meta.nbytes)
    for m, p in enumerate(placements):
        if m != skip and type(p) is Shard:
            n /= mesh_shape[m]
    return n


def _divides(even, call: OpCall, current, mesh_shape, m: int, picks: list) -> bool:
    """Each (operand, dim) in `even` splits evenly over mesh dim m and the other mesh dims
    that shard it: as picked for the mesh dims before m (`picks`), as it is now for the
    rest.  Operand i >= 0 is input i; -1 - j is output j."""
    for i, d in even:
        parts = mesh_shape[m]
        for m2 in range(len(mesh_shape)):
            if m2 == m:
                continue
            if m2 < len(picks):
                p = picks[m2].outputs[-1 - i] if i < 0 else picks[m2].inputs[i]
                p = current[i][m2] if p is None and i >= 0 else p
            else:
                p = current[i][m2] if i >= 0 else None
            if type(p) is Shard and p.dim == d:
                parts *= mesh_shape[m2]
        size = call.inputs[i].shape[d] if i >= 0 else call.outputs[-1 - i].shape[d]
        if size % parts:
            return False
    return True


def candidates(call: OpCall) -> list[OpStrategy]:
    """All-Replicate first, then the rule's strategies (an op with no rule warns once)."""
    base = replicated(len(call.inputs), len(call.outputs))
    rule = rule_for(call.func)
    if rule is None:
        warn_replicated(call.func, "Add a rule in autopar/spmd/.")
        return [base]
    out = [base]
    for s in rule(call):
        if s not in out:
            out.append(s)
    return out


def warn_replicated(func, why: str) -> None:
    """Warn once per op that it runs on replicated inputs (the replicated fallback)."""
    name = str(func)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"autopar: no sharding rule for {name}; its inputs are replicated (correct, but it communicates). {why}",
            stacklevel=5,
        )


def choose(call: OpCall, mesh: ProcessMesh, current: list[tuple], inplace: bool, pinned: tuple = ()):
    """Pick placements per mesh dim.

    `current[i]` is input i's placements now (plain tensors: all Replicate).  Inputs in `pinned`
    must stay as they are, as input 0 of an in-place op (a plain tensor the op writes: it has
    no placement to move to).  Returns (input placements, output placements, kernel name or None).
    Mesh dims are picked one by one; where their StridedShard picks do not combine into valid
    cuts (see `spec.strided_cuts_valid`), the choice is made again without strided strategies.
    """
    strategies = candidates(call)
    chosen = _choose(call, mesh, current, inplace, strategies, True, pinned)
    in_pl, out_pl, _ = chosen
    if any(type(p) is StridedShard for pl in in_pl + out_pl for p in pl) and not all(
        strided_cuts_valid(pl, meta.shape, mesh.shape)
        for pl, meta in zip(in_pl + out_pl, list(call.inputs) + list(call.outputs))
    ):
        plain = [s for s in strategies if not any(type(p) is StridedShard for p in s.inputs + s.outputs)]
        chosen = _choose(call, mesh, current, inplace, plain, False, pinned)
    return chosen


def _choose(
    call: OpCall, mesh: ProcessMesh, current: list[tuple], inplace: bool, strategies: list, strided: bool, pinned: tuple
):
    mesh_shape = mesh.shape
    picks = []
    for m, k in enumerate(mesh_shape):
        if k == 1:  # one rank holds everything: placements are labels, inputs never move
            picks.append(_label_only(strategies, current, m, len(call.outputs)))
            continue
        best, best_cost = None, None
        for s in strategies + (strided_variants(call, strategies, current, m, k) if strided else []):
            if s.even and not _divides(s.even, call, current, mesh_shape, m, picks):
                continue
            cost, changes, gathers = 0.0, 0, False
            for i, tgt in enumerate(s.inputs):
                cur = current[i][m]
                if tgt is None or tgt == cur:
                    continue
                changes += 1
                gathers = gathers or (type(cur) is Shard and type(tgt) is Replicate)
                c = conversion_cost(cur, tgt, _local_bytes(call.inputs[i], current[i], mesh_shape, m), k)
                if (inplace and i == 0) or i in pinned:
                    c += INPLACE_PENALTY
                cost += c
            if gathers and any(type(current[i][m]) is Partial and t == current[i][m] for i, t in enumerate(s.inputs)):
                cost += _deferred_reduction(call, s, mesh_shape, m)
            key = (round(cost, 3), changes, -sum(type(o) in _SPLIT for o in s.outputs))
            if best_cost is None or key < best_cost:
                best, best_cost = s, key
        picks.append(best)
    n_in, n_out = len(call.inputs), len(call.outputs)
    in_pl = [
        tuple(current[i][m] if picks[m].inputs[i] is None else picks[m].inputs[i] for m in range(len(picks)))
        for i in range(n_in)
    ]
    out_pl = [tuple(picks[m].outputs[j] for m in range(len(picks))) for j in range(n_out)]
    kernels = {s.kernel for s in picks if s.kernel}
    if len(kernels) > 1:
        raise AssertionError(f"rule for {call.func} mixes kernels {kernels} across mesh dims")
    return in_pl, out_pl, (kernels.pop() if kernels else None)


def strided_variants(call: OpCall, strategies: list, current: list, m: int, k: int) -> list[OpStrategy]:
    """A rule's Shard strategies read with StridedShard, where an input is strided on mesh
    dim m: a strategy that splits one index space (every operand it shards has the strided
    input's size there: the same letter of an einsum, a pointwise dim, a batch dim) splits
    it blockwise just as well, so each of those Shards becomes the same StridedShard.  A
    strategy running a kernel qualifies where the kernel says so (`STRIDED_KERNELS`)."""
    out: list = []
    for i, placements in enumerate(current):
        p = placements[m]
        if type(p) is not StridedShard:
            continue
        n = call.inputs[i].shape[p.dim]
        if n % p.split_factor or (n // p.split_factor) % k:
            continue
        for s in strategies:
            if any(type(t) is StridedShard for t in s.inputs + s.outputs):
                continue  # the rule's own strided strategy already says how blocks map
            strided_ok = s.kernel is None or STRIDED_KERNELS.get(s.kernel, _never)(call, s)
            if strided_ok and s.inputs[i] == Shard(p.dim):
                v = _as_strided(call, s, n, p.split_factor)
                if v is not None and v not in out:
                    out.append(v)
    return out


def _as_strided(call: OpCall, s: OpStrategy, n: int, f: int):
    def convert(placements, metas):
        new = []
        for t, meta in zip(placements, metas):
            if type(t) is Shard:
                if meta.shape[t.dim] != n:
                    return None
                t = StridedShard(t.dim, f)
            new.append(t)
        return tuple(new)

    ins, outs = convert(s.inputs, call.inputs), convert(s.outputs, call.outputs)
    return None if ins is None or outs is None else OpStrategy(outs, ins, s.kernel)


def _never(*_) -> bool:
    return False


def _deferred_reduction(call: OpCall, s: OpStrategy, mesh_shape, m: int) -> float:
    """What keeping a Partial input Partial costs when it takes gathering another operand:
    the Partial outputs still need their reduction later, and the input is usually reduced
    anyway for its other consumers (a backward's grad_output feeds both the input and the
    weight gradient), so the gather is extra.  Priced as reducing each Partial output."""
    k = mesh_shape[m]
    return sum(
        2.0 * call.outputs[j].nbytes * (k - 1) / k for j, o in enumerate(s.outputs) if type(o) is Partial
    )


def _label_only(strategies, current, m: int, n_out: int) -> OpStrategy:
    """On a mesh dim of size 1: the rule's outputs for the inputs as they are (a state made
    like a Shard(0) parameter says Shard(0)), else Replicate; no input is converted."""
    n_in = len(current)
    for s in strategies:
        if not s.kernel and all(t is None or t == current[i][m] for i, t in enumerate(s.inputs)):
            return OpStrategy(s.outputs, (None,) * n_in)
    return OpStrategy((Replicate(),) * n_out, (None,) * n_in)


def explain(call: OpCall) -> list[OpStrategy]:
    """The strategies the engine weighs for `call` (for debugging and docs)."""
    return candidates(call)


