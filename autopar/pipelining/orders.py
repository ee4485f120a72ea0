"""Pipeline orders: which stage runs which micro-batch's forward or backward, rank by rank.

Pure functions of (ranks, stages, micro-batches), so every rank computes every rank's order
without a message, and a test checks them without processes.  Stage `k` lives on rank
`k % num_ranks`.  Per stage, micro-batches go forward, backward, input-gradient and
weight-gradient in increasing order: the messages of one stage edge are produced in the
order the next stage consumes them.

Actions: `F` forward, `B` whole backward, `I` the backward to the stage input only (what the
previous stage waits for), `W` the rest of the backward (the weights' gradients), which
zero-bubble schedules push into the idle slots.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class Action(NamedTuple):
    """One step of a rank's order: `kind` (F, B, I or W) of micro-batch `mb` on stage `stage`."""

    kind: str
    stage: int
    mb: int

    def label(self, with_stage: bool) -> str:
        return f"{self.kind}{self.mb}" + (f"s{self.stage}" if with_stage else "")


Orders = list  # list[list[Action]]: one order per rank


def fthenb(num_ranks: int, m: int) -> Orders:
    """GPipe: every forward, then every backward (a stage holds all `m` micro-batches).

    >>> [" ".join(a.label(False) for a in row) for row in fthenb(2, 2)]
    ['F0 F1 B0 B1', 'F0 F1 B0 B1']
    """
    return [[Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)] for s in range(num_ranks)]


def one_f_one_b(num_ranks: int, m: int) -> Orders:
    """1F1B: stage s runs p-1-s forwards ahead, then alternates forward and backward, so it
    holds at most p - s micro-batches' activations.

    >>> [" ".join(a.label(False) for a in row) for row in one_f_one_b(2, 3)]
    ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    orders = []
    for s in range(num_ranks):
        warmup = min(num_ranks - 1 - s, m)
        row = [Action("F", s, i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action("F", s, warmup + i), Action("B", s, i)]
        row += [Action("B", s, i) for i in range(m - warmup, m)]
        orders.append(row)
    return orders


def _interleaved_step(kind: str, r: int, k: int, p: int, v: int) -> Action:
    """Rank r's k-th forward (`kind` F) or backward (B or I) in the interleaved order of p ranks
    with v stages each: micro-batches in groups of p per stage, the stages forward r, r+p, ...
    and backward in reverse."""
    chunk = (k // p) % v
    if kind != "F":
        chunk = v - 1 - chunk
    return Action(kind, chunk * p + r, (k // (p * v)) * p + k % p)


def interleaved(num_ranks: int, v: int, m: int) -> Orders:
    """Interleaved 1F1B (virtual pipeline, Megatron's order): each rank holds `v` stages
    (r, r+p, ...) and runs micro-batches in groups of p per stage, which cuts the bubble v times.
    Needs `m` to be a multiple of p.

    >>> [" ".join(a.label(True) for a in row) for row in interleaved(2, 2, 2)][0]
    'F0s0 F1s0 F0s2 F1s2 B0s2 B1s2 B0s0 B1s0'
    """
    p, total = num_ranks, m * v
    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        row = [_interleaved_step("F", r, k, p, v) for k in range(warmup)]
        for k in range(total - warmup):
            row += [_interleaved_step("F", r, warmup + k, p, v), _interleaved_step("B", r, k, p, v)]
        row += [_interleaved_step("B", r, k, p, v) for k in range(total - warmup, total)]
        orders.append(row)
    return orders


def zbh1(num_ranks: int, m: int) -> Orders:
    """ZB-H1 (zero bubble, Qi et al. 2023): 1F1B with each backward split into I (input
    gradient, on the critical path) and W (weight gradient), the W's placed into the slots
    1F1B leaves idle; `zbvpp` with one stage per rank.  With equal F, I and W times the bubble
    is (p-1) units instead of 1F1B's 3(p-1).

    >>> " ".join(a.label(False) for a in zbh1(2, 3)[0])
    'F0 F1 I0 W0 F2 I1 W1 I2 W2'
    """
    return zbvpp(num_ranks, 1, m)


def zbvpp(num_ranks: int, v: int, m: int) -> Orders:
    """Zero bubble over a virtual pipeline: interleaved 1F1B's forwards and input gradients
    (in its stage and micro-batch sequence) with the weight gradients placed into the idle
    slots.  Built by a list scheduler over unit-time F, I and W: a rank runs its next forward
    when fewer than p-1-r + (v-1)p are ahead of its I's and fewer than the first rank's peak
    hold activations, else its next I once ready, else its oldest W.  Every rank then holds at
    most 1F1B's first stage's activations (v = 1) or fewer than interleaved 1F1B's first rank
    (v > 1), and the bubble is about a third of interleaved 1F1B's (`simulate`).  Needs `m` to be a multiple of p.

    >>> print(format_orders(zbvpp(2, 2, 2)))
    rank 0: F0s0 F1s0 F0s2 F1s2 I0s2 W0s2 I1s2 I0s0 I1s0 W1s2 W0s0 W1s0
    rank 1: F0s1 F1s1 F0s3 I0s3 F1s3 I1s3 I0s1 I1s1 W0s3 W1s3 W0s1 W1s1
    """
    p, n, total = num_ranks, num_ranks * v, m * v
    ahead = [min(p - r - 1 + (v - 1) * p, total) for r in range(p)]
    held_cap = ahead[0] + 1
    finished: dict = {}  # action -> the time it finished
    nf, ni, nw, free = [0] * p, [0] * p, [0] * p, [0] * p
    waiting_w: list[list] = [[] for _ in range(p)]  # I's whose W has not run, oldest first
    orders: Orders = [[] for _ in range(p)]
    t = 0

    def ready(kind: str, stage: int, mb: int) -> bool:
        """The action finished by now (time `t`)."""
        return finished.get(Action(kind, stage, mb), t + 1) <= t

    while any(x < total for x in nw):
        for r in range(p):
            if free[r] > t:
                continue
            a = None
            if nf[r] < total and nf[r] - ni[r] <= ahead[r] and nf[r] - nw[r] < held_cap:
                f = _interleaved_step("F", r, nf[r], p, v)
                if f.stage == 0 or ready("F", f.stage - 1, f.mb):
                    a, nf[r] = f, nf[r] + 1
            if a is None and ni[r] < total:
                i = _interleaved_step("I", r, ni[r], p, v)
                if ready("F", i.stage, i.mb) and (i.stage == n - 1 or ready("I", i.stage + 1, i.mb)):
                    a, ni[r] = i, ni[r] + 1
                    waiting_w[r].append(i)
            if a is None and waiting_w[r]:
                i = waiting_w[r].pop(0)
                a, nw[r] = Action("W", i.stage, i.mb), nw[r] + 1
            if a is None:
                continue
            finished[a] = t + 1
            orders[r].append(a)
            free[r] = t + 1
        t += 1
    return orders


ONE_STAGE_PER_RANK = {"FThenB": fthenb, "1F1B": one_f_one_b, "ZBH1": zbh1}


def schedule_orders(mode: str, num_ranks: int, m: int, vpp: int = 1) -> Orders:
    """The orders of the schedule `mode` names (pp_config's and Strategy.pipeline's
    schedule_mode, `api.parallelize.SCHEDULE_MODES`): VPP and ZBVPP over `vpp` stages per rank,
    the others over one."""
    if mode == "VPP":
        return interleaved(num_ranks, vpp, m)
    if mode == "ZBVPP":
        return zbvpp(num_ranks, vpp, m)
    return ONE_STAGE_PER_RANK[mode](num_ranks, m)


# -- checking an order ------------------------------------------------------------------------
class Simulation(NamedTuple):
    """An order played with fixed action times and instant messages."""

    makespan: float
    busy: list  # per rank
    peak_in_flight: dict  # stage -> most micro-batches holding activations at once

    @property
    def bubble(self) -> float:
        """The idle share of all ranks' time (1F1B: (p-1)/(m+p-1) with B = 2F)."""
        return 1 - sum(self.busy) / (self.makespan * len(self.busy))


COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _needs(a: Action, num_stages: int) -> list[Action]:
    """The actions (on any rank) whose results `a` reads."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage else []
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    deps = [Action("F", a.stage, a.mb)]
    if a.stage < num_stages - 1:
        deps.append(Action(a.kind, a.stage + 1, a.mb))  # B after B, I after I (both send the input gradient)
    return deps


def simulate(orders: Orders, num_stages: int, costs: dict = COSTS) -> Simulation:
    """Play `orders`; raises ValueError if some rank would wait forever (the orders
    deadlock, or an action reads one that no rank runs).

    >>> round(simulate(one_f_one_b(4, 8), 4).bubble, 4)  # (p-1)/(m+p-1) = 3/11
    0.2727
    """
    done: dict = {}
    position = [0] * len(orders)
    clock = [0.0] * len(orders)
    live: dict = {}
    peak: dict = {}
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(orders):
            while position[r] < len(row):
                a = row[position[r]]
                deps = _needs(a, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[a] = start + costs[a.kind]
                position[r] += 1
                progress = True
                if a.kind == "F":
                    live[a.stage] = live.get(a.stage, 0) + 1
                    peak[a.stage] = max(peak.get(a.stage, 0), live[a.stage])
                elif a.kind in "BW":
                    live[a.stage] -= 1
    stuck = [(r, row[position[r]]) for r, row in enumerate(orders) if position[r] < len(row)]
    if stuck:
        waits = "; ".join(f"rank {r} waits at {a} for {[d for d in _needs(a, num_stages) if d not in done]}"
                          for r, a in stuck)
        raise ValueError(f"pipeline order deadlocks: {waits}")
    busy = [sum(costs[a.kind] for a in row) for row in orders]
    return Simulation(max(clock), busy, peak)


def peak_held(orders: Orders) -> list:
    """Per rank, the most stage-micro-batches whose activations it holds at once (a forward
    keeps them until its B, or its W when the backward is split): the memory a schedule
    costs, in units of one stage's activations for one micro-batch.

    >>> peak_held(one_f_one_b(4, 8)), peak_held(interleaved(2, 2, 4))
    ([4, 3, 2, 1], [5, 3])
    """
    peaks = []
    for row in orders:
        held = peak = 0
        for a in row:
            held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def format_orders(orders: Orders) -> str:
    """One row per rank: `rank 0: F0 F1 B0 ...` (with the stage, `F0s2`, when a rank holds several).

    >>> print(format_orders(one_f_one_b(2, 2)))
    rank 0: F0 F1 B0 B1
    rank 1: F0 B0 F1 B1
    """
    multi = any(len({a.stage for a in row}) > 1 for row in orders)
    return "\n".join(f"rank {r}: " + " ".join(a.label(multi) for a in row) for r, row in enumerate(orders))
