"""The planner: the fastest layout that fits, and the `parallelize` config that runs it.

It enumerates the shapes (dp x cp x tp x pp = world with tp inside a node and dividing the
heads and kv heads, context parallel by ring or all-to-all where the sequence is long
enough to split, expert parallel over the whole dp dividing the experts, pp at most the layers,
micro-batch size, ZeRO level, sequence parallel, the interleaving degree of the pipeline),
and for each solves one small integer program with HiGHS: how many layers
each pipeline stage gets and how many of them it recomputes, minimising the 1F1B step
time subject to every stage's memory.  Stages differ (the first holds the embedding and
the most micro-batches in flight, the last the LM head and logits), so uneven splits and
per-stage recompute are real choices.  Shapes are visited by a lower bound on their step
time and skipped once the bound passes the runner-up; the solver itself prunes what cannot
beat the runner-up or the shape's degrees' best.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

from .cost import DeviceProfile, load_profile
from .model import Affine, Estimate, Layout, Shape, TransformerSpec, all_terms, evaluate, state_bytes_floor

_NO_SOLVER = "the planner needs HiGHS: pip install 'autopar[plan]' (or pip install highspy)"


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


# the settings `fixed` may pin, by the names users know them by -> Shape's field
_FIXED = {"dp": "dp", "tp": "tp", "mp": "tp", "pp": "pp", "zero": "zero", "sharding_level": "zero",
          "micro_batch": "micro_batch", "sequence_parallel": "sequence_parallel", "vpp": "vpp",
          "vpp_degree": "vpp", "cp": "cp", "sep": "cp", "cp_mode": "cp_mode", "ep": "ep"}
VPP_DEGREES = (1, 2, 4)  # chunks per pipeline stage tried (interleaved 1F1B beyond 1)
# context parallel leaves each rank at least this many tokens of a sequence: shorter blocks
# make attention's GEMMs too small to hide the ring, and 128K tokens still split 64 ways
CP_MIN_TOKENS = 2048


def cp_options(spec: TransformerSpec, tp: int, ranks: int, pinned: Optional[int] = None) -> list:
    """(cp, mode) pairs for a sequence split over cp of `ranks` ranks: the ring needs 2 cp
    equal chunks (each rank a head and a tail chunk), all-to-all the heads and kv heads of
    a tp rank to divide by cp.  A `pinned` cp is tried however short its blocks."""
    out = [(1, "ring")]
    for cp in _divisors(ranks)[1:]:
        if spec.seq // cp < CP_MIN_TOKENS and cp != pinned:
            continue
        if spec.seq % (2 * cp) == 0:
            out.append((cp, "ring"))
        if (spec.heads // tp) % cp == 0 and (spec.kv_heads // tp) % cp == 0 and spec.seq % cp == 0:
            out.append((cp, "all2all"))
    return out


def ep_options(spec: TransformerSpec, dp: int) -> list:
    """Expert-parallel degrees the config can run: the experts split over the whole mesh dim
    "dp" (`ExpertParallel` folds on "dp" where the mesh has no "ep"), where dp divides them."""
    return [1] + ([dp] if dp > 1 and spec.experts and spec.experts % dp == 0 else [])


def shapes(spec: TransformerSpec, world: int, global_batch: int, profile: DeviceProfile,
           precision: str = "bf16", fixed: Optional[dict] = None) -> list:
    """Every Shape worth pricing.  `fixed` pins any of dp/tp/pp/cp/cp_mode/ep/zero/micro_batch/
    sequence_parallel/vpp.  Interleaving needs pp > 1, a multiple of pp micro-batches and
    pp x vpp <= layers."""
    fixed = fixed or {}
    unknown = sorted(set(fixed) - set(_FIXED))
    if unknown:
        raise ValueError(f"plan: cannot fix {unknown}; known settings: {sorted(_FIXED)}")
    out = []
    for tp in _divisors(world):
        if tp > profile.ranks_per_node or spec.heads % tp or spec.kv_heads % tp:
            continue
        for cp, mode in cp_options(spec, tp, world // tp, fixed.get("cp", fixed.get("sep"))):
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > spec.layers or global_batch % dp:
                    continue
                for ep, b in itertools.product(ep_options(spec, dp), _divisors(global_batch // dp)):
                    m = global_batch // (dp * b)
                    vpps = [v for v in VPP_DEGREES if v == 1 or (pp > 1 and m % pp == 0 and pp * v <= spec.layers)]
                    for zero, sp, v in itertools.product(range(4), (False, True) if tp > 1 else (False,), vpps):
                        shape = Shape(dp, tp, pp, b, m, zero, sp, precision, v, cp, mode, ep)
                        if all(getattr(shape, _FIXED[k]) == x for k, x in fixed.items()):
                            out.append(shape)
    return out


def lower_bound(terms: list, shape: Shape, layers: int) -> float:
    """A step time no split or recompute of `shape` beats (recompute only adds time, memory
    is ignored).  A layer costs the same on every stage: the slowest stage is at least the
    average, and the end of the step at least the stage with the largest fixed part holding
    one layer, or the least fixed part holding an even share."""
    total = sum(sum(v.c for v in t.micro_time.values()) for t in terms)
    total += layers * sum(v.per_layer for v in terms[0].micro_time.values())
    fixed_end = [sum(v.c for v in t.end_time.values()) for t in terms]
    per_layer_end = sum(v.per_layer for v in terms[0].end_time.values())
    end = max(max(fixed_end) + per_layer_end, min(fixed_end) + per_layer_end * layers / shape.pp)
    m, v = shape.micro_batches, shape.vpp
    return (m - 1 / v) * total / shape.pp + total / v + end


SOLVE_SECONDS = 5.0  # per integer program; past it the best split found so far is taken
GAP = 1e-7  # relative optimality gap at which HiGHS may stop


def solve_split(terms: list, shape: Shape, layers: int, memory_limit: float,
                cutoff: float = math.inf) -> tuple[Optional[tuple], bool]:
    """((stage_layers, recompute), proven optimal) minimising the step time with every
    stage's memory within `memory_limit`; (None, proven) if nothing fits, nothing was found
    in SOLVE_SECONDS, or nothing is faster than `cutoff` (the solver prunes by it: a shape
    that cannot beat the layouts found before it is proven so without its optimum; the
    program's step time is at most the evaluated one, so nothing it prunes would have).
    Variables: k_s >= 1 layers per chunk (n_s = vpp k_s layers per stage) and
    0 <= r_s <= n_s recomputed layers per stage (integers), T >= each stage's
    micro-batch time, E >= each stage's end-of-step time; minimise
    (m - 1/vpp) T + sum_s time_s / vpp + E (`model.pipeline_time`)."""
    highspy, h = _highs()
    pp, v = shape.pp, shape.vpp
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", GAP)
    h.setOptionValue("time_limit", SOLVE_SECONDS)
    if cutoff < math.inf:
        h.setOptionValue("objective_bound", cutoff)
    k = [h.addIntegral(lb=1, ub=layers // v) for _ in range(pp)]
    n = [v * x for x in k]
    r = [h.addIntegral(lb=0, ub=layers) for _ in range(pp)]
    big_t, big_e = h.addVariable(lb=0.0), h.addVariable(lb=0.0)
    objective = (shape.micro_batches - 1 / v) * big_t + big_e
    h.addConstr(sum(n) == layers)
    for s, t in enumerate(terms):
        micro = _total(t.micro_time)
        end = _total(t.end_time)
        memory = _total(t.memory)
        objective = objective + (micro.per_layer * n[s] + micro.per_recompute * r[s]) * (1 / v)
        h.addConstr(r[s] <= n[s])
        h.addConstr(big_t >= micro.c + micro.per_layer * n[s] + micro.per_recompute * r[s])
        h.addConstr(big_e >= end.c + end.per_layer * n[s] + end.per_recompute * r[s])
        scale = 1.0 / memory_limit  # memory rows in units of the limit
        h.addConstr(memory.per_layer * scale * n[s] + memory.per_recompute * scale * r[s] <= 1.0 - memory.c * scale)
    h.minimize(objective)
    status = h.getModelStatus()
    proven = status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible)
    if status != highspy.HighsModelStatus.kOptimal and h.getInfo().primal_solution_status != 2:  # none feasible
        return None, proven
    values = h.getSolution().col_value
    stage_layers = tuple(v * round(values[x.index]) for x in k)
    recompute = tuple(round(values[x.index]) for x in r)
    return (stage_layers, recompute), proven


def _highs():
    """(highspy, a fresh solver), its banner kept off stdout (it would spoil --json)."""
    try:
        import highspy
    except ImportError:  # pragma: no cover - the extra is part of the test install
        raise ImportError(_NO_SOLVER) from None
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        return highspy, highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _total(table: dict) -> Affine:
    return sum(table.values(), Affine())


def _rank(est: Estimate) -> tuple:
    """Faster first; within a nanosecond, less memory first."""
    return round(est.step_time, 9), est.peak_memory


@dataclass
class SearchResult:
    best: Estimate
    runner_up: Optional[Estimate]
    searched: int  # shapes enumerated
    solved: int  # integer programs solved (the others were bounded out)
    bounded: int
    infeasible: int = 0
    cut_off: int = 0  # integer programs that found no split fitting and faster than those found before
    unproven: int = 0  # integer programs stopped at SOLVE_SECONDS (their best split so far taken)
    too_big: int = 0  # shapes whose parameters and states alone overflow the memory: never priced


def search(spec: TransformerSpec, world: int, global_batch: int, device="h100",
           memory_per_rank: Optional[float] = None, precision: str = "bf16",
           fixed: Optional[dict] = None) -> SearchResult:
    """The fastest layout of `spec` on `world` ranks of `device` within `memory_per_rank`
    bytes (default: the device's memory), and the fastest with other dp/tp/pp degrees."""
    profile = load_profile(device)
    limit = profile.memory_bytes if memory_per_rank is None else memory_per_rank
    candidates = []
    too_big = 0
    enumerated = shapes(spec, world, global_batch, profile, precision, fixed)
    for shape in enumerated:
        if state_bytes_floor(spec, shape) > limit:
            too_big += 1  # its states alone overflow the fullest stage
            continue
        terms = all_terms(spec, profile, shape)
        candidates.append((lower_bound(terms, shape, spec.layers), shape, terms))
    if not enumerated:
        raise ValueError(
            f"no dp x cp x tp x pp layout of {world} ranks suits this model and batch: tp must divide "
            f"heads={spec.heads} and kv_heads={spec.kv_heads} within {profile.ranks_per_node} ranks per node, "
            f"pp <= layers={spec.layers}, dp must divide global_batch={global_batch}"
            + (f", ep is 1 or dp (ExpertParallel splits the experts over the whole \"dp\") and divides "
               f"experts={spec.experts}" if spec.experts else "")
            + (f", and {fixed}" if fixed else "")
        )
    candidates.sort(key=lambda c: c[0])
    best: dict = {}  # degrees -> their fastest Estimate (ties: the one needing less memory)
    solved = infeasible = cut_off = unproven = 0
    for bound, shape, terms in candidates:
        ranked = sorted(best.values(), key=_rank)
        if len(ranked) >= 2 and bound >= ranked[1].step_time:
            break  # neither the best nor the runner-up can change
        degrees = (shape.dp, shape.cp, shape.tp, shape.pp, shape.ep)
        if degrees in best and bound >= best[degrees].step_time:
            continue  # cannot improve its degrees' best
        # no use unless faster than the runner-up and than its degrees' best (a nanosecond
        # more: `_rank`'s ties go to the one needing less memory)
        cutoff = min(ranked[1].step_time if len(ranked) >= 2 else math.inf,
                     best[degrees].step_time if degrees in best else math.inf) + 1e-9
        solved += 1
        split, proven = solve_split(terms, shape, spec.layers, limit, cutoff)
        unproven += not proven
        if split is None:
            if cutoff < math.inf:
                cut_off += 1
            else:
                infeasible += 1
            continue
        est = evaluate(spec, profile, Layout(shape, *split), limit)
        if degrees not in best or _rank(est) < _rank(best[degrees]):
            best[degrees] = est
    found = sorted(best.values(), key=_rank)
    if not found:
        raise ValueError(
            f"nothing fits: no layout of this model on {world} ranks of {profile.name} stays within "
            f"{limit / 1e9:.1f} GB per rank (tried {len(enumerated)} shapes, recompute and uneven stages included)"
        )
    return SearchResult(
        best=found[0], runner_up=found[1] if len(found) > 1 else None,
        searched=len(enumerated), solved=solved, bounded=len(candidates) - solved, infeasible=infeasible,
        cut_off=cut_off, unproven=unproven, too_big=too_big,
    )
