"""Step time from a recorded run of the real program: `predict_step(make_step, world_size)`.

The analytic model (model.py) counts a transformer's FLOPs and bytes; on a CPU, or for small
layers anywhere, a step is mostly per-op cost it cannot see: aten's dispatcher, autopar's
DistTensor dispatch, autograd's nodes, the optimizer's per-parameter ops, and ranks that
share cores.  Here every rank of the job runs its step in this process under
`dist.simulate` (real tensors of the rank's shard sizes, no communication) while a dispatch
mode records, in order, each aten op run on plain tensors (with its FLOPs and bytes), each
DistTensor dispatch, each autograd node that runs, and each collective the rank sends
(`comm_log`).  Pricing is pure (`op_time`, `comm_time`, `core_share`, `host_factor`) and uses a
calibrated `DeviceProfile` (`python -m autopar.plan --calibrate`); `job_time` then plays the
ranks' timelines against each other, so a rank waits for the peers of its collectives and
for the sender of what it receives (pipeline bubbles included).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..comm.collectives import gathered_all_reduce
from ..runtime import local_region
from .cost import _RING, DeviceProfile, _Rounds, load_profile, machine_cores, median_time, op_link
from .profile_check import check_profile

aten = torch.ops.aten


# -- pricing (pure) ------------------------------------------------------------------------------
def _interpolate(curve: tuple, x: float) -> float:
    """y at x on a curve of (x, y) points, linear in log-log between points, flat past the ends."""
    xs = [p[0] for p in curve]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def flop_rate(flops: float, profile: DeviceProfile, precision: str = "fp32") -> float:
    """FLOP/s of one GEMM doing `flops`: the profile's measured curve over sizes, or its
    peak times its matmul efficiency where none was measured."""
    if profile.gemm_curve:
        return _interpolate(profile.gemm_curve, flops)
    return profile.peak_flops(precision) * profile.matmul_efficiency


def memory_rate(nbytes: float, profile: DeviceProfile) -> float:
    """Bytes/s an element-wise op moving `nbytes` reaches (caches make small ones faster)."""
    if profile.memory_curve:
        return _interpolate(profile.memory_curve, nbytes)
    return profile.hbm_bandwidth


def op_time(flops: float, nbytes: float, profile: DeviceProfile, precision: str = "fp32", gemm: float = 0,
            name: str = "", elements: int = 0, strided: bool = False) -> float:
    """Seconds for one aten op: its compute or its memory traffic, whichever is slower, plus
    the per-op latency (dispatcher, allocation, kernel launch).  `gemm`: the FLOPs of each of
    the op's matrix products where it does many (batched, attention heads): the rate of that
    size applies.  An element-wise op the profile measured (`element_costs`, by aten `name`)
    also takes its seconds per element times `elements` (its first input's) if that is slower;
    a `strided` one (`strided_access`) its `strided_costs` where the profile measured them.

    >>> from autopar.planner.cost import H100
    >>> round(op_time(2 * 4096**3, 3 * 4096**2 * 4, H100) * 1e3, 3)  # a 4096^3 fp32 GEMM: 46.9 TFLOP/s
    2.935
    """
    compute = flops / flop_rate(gemm or flops, profile, precision) if flops else 0.0
    memory = nbytes / memory_rate(nbytes, profile) if nbytes else 0.0
    per_element = profile.per_element_tables[strided].get(name, 0.0) * elements if elements else 0.0
    return max(compute, memory, per_element) + profile.op_latency


def _piecewise(points: list, x: float) -> tuple:
    """The values at x on ascending (x, values...) points, linear between them, flat outside."""
    if x <= points[0][0]:
        return tuple(points[0][1:])
    for p0, p1 in zip(points, points[1:]):
        if x <= p1[0]:
            f = (x - p0[0]) / (p1[0] - p0[0])
            return tuple(a + f * (b - a) for a, b in zip(p0[1:], p1[1:]))
    return tuple(points[-1][1:])


def shared_link(profile: DeviceProfile, crowding: float) -> tuple[float, float]:
    """(latency per ring step, bandwidth) of collectives when `crowding` ranks share each core:
    the intra link up to 1, then the measured `shared_links`, linear between points."""
    return _piecewise([(1.0, profile.intra_latency, profile.intra_bandwidth)] + list(profile.shared_links), crowding)


def comm_time(op: str, group_size: int, sent: float, received: float, profile: DeviceProfile,
              crowding: float = 1.0) -> float:
    """Seconds for one logged collective or transfer (`comm_log` gives the bytes this rank
    sent and received, the ring's factor included): one link latency per ring step plus the
    larger direction over the link's bandwidth (`shared_link` where ranks share cores), both
    scaled as the profile measured this collective against all_reduce (`op_links`).  A
    pair's small all-reduce on a host profile is priced as the all-gather autopar runs for it
    (`collectives.gathered_all_reduce`).

    >>> from autopar.planner.cost import H100
    >>> comm_time("all_reduce", 8, 2 * 7 / 8 * 1e9, 0, H100)  # as cost.collective_time
    0.003930888888888889
    """
    if group_size <= 1:
        return 0.0
    if op == "all_reduce" and gathered_all_reduce(int(max(sent, received)), group_size, not profile.host_overlaps):
        op = "all_gather"  # what a pair's small all-reduce runs on a host (its bytes: the tensor's)
    latency, bandwidth = op_link(profile, op, *shared_link(profile, crowding))
    steps = _RING[op](group_size)[0] if op in _RING else 1
    return steps * latency + max(sent, received) / bandwidth


def host_factor(crowding: float, profile: DeviceProfile) -> float:
    """How much longer each rank's host work takes where `crowding` processes share each
    core than one process alone on the machine (caches and memory bandwidth shared, and
    past a process per core, switches paid at every collective: the profile's measured
    `shared_host`, linear between its points; a profile without a point at one process per
    core counts none there); 1 for a lone process, or where the profile counts no cores.

    >>> import dataclasses
    >>> from autopar.planner.cost import H100
    >>> switching = dataclasses.replace(H100, cores=2, shared_host=((1.0, 1.1), (2.0, 1.2), (4.0, 1.4)))
    >>> host_factor(0.5, switching), host_factor(1.0, switching), round(host_factor(3.0, switching), 6)
    (1.0, 1.1, 1.3)
    """
    if not profile.cores:
        return 1.0
    points = list(profile.shared_host)
    if not points or points[0][0] > 1.0:
        points.insert(0, (1.0, 1.0))
    return _piecewise([(1.0 / profile.cores, 1.0)] + points, crowding)[0]


def core_share(runnable: float, profile: DeviceProfile) -> float:
    """The share of a core each of `runnable` processes gets: all of one up to the profile's
    cores, then an equal part of them (always 1 where the profile counts no cores: a device
    per rank).

    >>> from autopar.planner.cost import CPU
    >>> core_share(2, CPU), core_share(8, CPU)  # two cores
    (1.0, 0.25)
    """
    if not profile.cores or runnable <= profile.cores:
        return 1.0
    return profile.cores / runnable


def machine_load(seconds: float = 1.0) -> float:
    """Cores' worth of work other programs keep busy on this machine now: the busy share of
    every core over `seconds` (Linux's /proc/stat; 0 elsewhere), measured while this
    process sleeps."""
    import time

    def busy_idle():
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return sum(fields[:8]) - idle, idle  # user..steal

    if not os.path.exists("/proc/stat"):
        return 0.0
    b0, i0 = busy_idle()
    time.sleep(seconds)
    b1, i1 = busy_idle()
    return machine_cores() * (b1 - b0) / max(b1 - b0 + i1 - i0, 1e-9)


# -- recording -----------------------------------------------------------------------------------
# FLOPs of ops torch's flop counter does not list: CPU's attention kernels (same math as flash)
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *a, **kw: sdpa_flop_count(q.shape, k.shape, v.shape),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
}


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op call (0 for ops without a formula: they are priced by bytes).

    >>> a, b = torch.ones(4, 8), torch.ones(8, 3)
    >>> op_flops(torch.ops.aten.mm.default, (a, b), {}, a @ b)
    192
    """
    if func in _EXTRA_FLOPS:
        return int(_EXTRA_FLOPS[func](*args, **kwargs))
    formula = flop_registry.get(func._overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


# ops doing one matrix product per leading index of their output (batch, heads)
_BATCHED = {aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention_backward,
            aten._scaled_dot_product_flash_attention_backward}


def gemm_flops(func, flops: int, out) -> float:
    """FLOPs of each matrix product of an op: a batched one's per batch index (the GEMM rate
    of that size applies), else all of them.

    >>> a = torch.ones(16, 8, 8)
    >>> gemm_flops(torch.ops.aten.bmm.default, 16 * 2 * 8**3, a @ a)
    1024.0
    """
    first = out[0] if isinstance(out, (list, tuple)) else out
    if func._overloadpacket not in _BATCHED or not isinstance(first, torch.Tensor) or first.dim() < 3:
        return float(flops)
    return flops / max(math.prod(first.shape[:-2]), 1)


def _tensors(values, acc: list) -> list:
    """The tensors in nested argument lists, in order (foreach ops take lists)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            acc.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, acc)
    return acc


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs (0 for a view)."""
    returns = func._schema.returns
    if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        return 0
    return sum(t.numel() * t.element_size() for t in _tensors((args, kwargs.values(), (out,)), []))


def strided_access(func, args) -> bool:
    """Whether an op walks memory element by element: an input stepping along its last dim
    (a view such as `x[..., ::2]`: element-wise kernels do not vectorize it, several times
    slower per element), or a cat or stack writing its pieces one element at a time (along
    a last dim of size 1, or a new last dim).

    >>> x = torch.ones(4, 8)
    >>> silu = torch.ops.aten.silu.default
    >>> strided_access(silu, (x[:, ::2],)), strided_access(silu, (x[:2],))
    (True, False)
    >>> strided_access(torch.ops.aten.stack.default, ([x, x], -1)), strided_access(torch.ops.aten.stack.default, ([x, x],))
    (True, False)
    """
    if func in (aten.cat.default, aten.stack.default):
        pieces, dim = args[0], args[1] if len(args) > 1 else 0
        new = func is aten.stack.default  # the pieces gain a dim
        return any(t.numel() > 1 and math.prod(t.shape[dim % (t.dim() + new):]) == 1 for t in pieces if t.dim())
    return any(t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1 for t in _tensors(args, []))


@dataclass
class Recording:
    """One rank's step, in order: ("op", name, flops, bytes, flops of each matrix product,
    elements of its first input, `strided_access`) for an aten op on plain tensors,
    ("dist", whether this rank is on the mesh of its first DistTensor) for a DistTensor
    dispatch (off the mesh, a pipeline's other stages, it only wraps empty pieces), ("node",) for an autograd node first seen running,
    ("region", "forward" or "backward") for a local region call's boundary (its ops are
    recorded as plain ops), ("start", op, ranks) where a collective starts to overlap with
    what follows, and ("comm", CommRecord) for a collective or transfer (an overlapped one
    where it is waited for)."""

    rank: int
    events: list = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(e[0] == kind for e in self.events)

    def flops(self) -> int:
        return sum(e[2] for e in self.events if e[0] == "op")


class _Recorder(TorchDispatchMode):
    """Sees every op of the step.  A mode that handles a DistTensor op runs with itself popped,
    so it calls the DistTensor dispatch back inside itself: the local ops, reshards and
    kernels that dispatch runs are then seen too."""

    def __init__(self, recording: Recording, log=None):
        super().__init__()
        self.recording, self.log, self.seen_comm, self.nodes = recording, log, 0, set()
        self.region_calls = local_region.calls()

    def _note(self, event) -> None:
        """Append `event` after the collectives logged and the local region calls begun since
        the last one (they ran before it)."""
        events = self.recording.events
        while self.log is not None and self.seen_comm < len(self.log.records):
            events.append(("comm", self.log.records[self.seen_comm]))
            self.seen_comm += 1
        calls = local_region.calls()
        for direction, before, now in zip(("forward", "backward"), self.region_calls, calls):
            events.extend([("region", direction)] * (now - before))
        self.region_calls = calls
        if event is not None:
            events.append(event)

    def started(self, op: str, ranks: tuple) -> None:
        """A collective starts here and is waited for later (a `comm.observers.StartObserver`)."""
        self._note(("start", op, ranks))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ..comm.fake import filling
        from ..tensor import dispatch
        from ..tensor.dtensor import DistTensor

        kwargs = kwargs or {}
        if filling():  # simulate's stand-in for bytes a transfer writes: priced with the transfer
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        if node is not None and node not in self.nodes:
            self.nodes.add(node)
            self._note(("node",))
        if DistTensor in types:
            first = next(t for t in _tensors((args, kwargs.values()), []) if type(t) is DistTensor)
            self._note(("dist", dispatch._rank() in first._spec.mesh))
            with self:
                return DistTensor.__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace == "aten":  # c10d's ops are the collectives, priced from comm_log
            flops = op_flops(func, args, kwargs, out)
            first = next(iter(_tensors(args, [])), None)
            self._note(("op", func.name(), flops, op_bytes(func, args, kwargs, out), gemm_flops(func, flops, out),
                        first.numel() if first is not None else 0, strided_access(func, args)))
        return out


def record_step(make_step: Callable[[], Callable[[], object]], world_size: int, rank: int,
                warmup: int = 3, settle: int = 10) -> Recording:
    """Run rank `rank` of a `world_size`-rank job here (`simulate`): `make_step()` builds the
    model and returns the step; the step runs at least `warmup` times and until two steps in
    a row send the same collectives (caches, local-region checks and buckets settle; at most
    `settle` steps), then once more recorded."""
    from ..comm.log import comm_log
    from ..comm.observers import observing_starts
    from ..tools.simulate import simulate

    recording = Recording(rank)
    with simulate(world_size, rank, activations=False):
        step = make_step()
        previous = None
        for i in range(max(warmup, settle)):
            with comm_log() as log:
                step()
            sent = [(r.op, r.ranks, r.bytes) for r in log]
            if i + 1 >= warmup and sent == previous:
                break
            previous = sent
        with comm_log() as log:
            recorder = _Recorder(recording, log)
            with observing_starts(recorder), recorder:
                step()
            recorder._note(None)
    return recording


# -- the job -------------------------------------------------------------------------------------
CATEGORIES = ("compute", "framework", "dispatch", "autograd", "comm", "wait")


@dataclass
class Prediction:
    """Predicted seconds of one step: `total` (the slowest rank's finish), and that rank's
    seconds per category: compute (FLOPs and bytes of aten ops), framework (their per-op
    latency), dispatch (DistTensor dispatches and local regions' boundaries), autograd
    (nodes), comm (collectives' own time), wait (blocked on peers: skew, pipeline bubbles)."""

    total: float
    categories: dict
    rank: int
    recordings: list = field(repr=False, default_factory=list)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.categories.items())
        return f"predicted step {self.total * 1e3:.1f} ms (rank {self.rank}: {parts} ms)"


def _segments(recording: Recording, profile: DeviceProfile, slow: float) -> list:
    """The rank's timeline priced: ("busy", {category: seconds on a core of its own}) for the
    work between two collectives, ("comm", record) for one run to its end where it stands, and
    for one that overlaps what follows, ("start", record, link) where it starts and
    ("collect", record, link) where it is waited for.  Host work takes `slow` times its
    price.  Where the host issues ops while the device runs earlier ones (`host_overlaps`,
    GPUs), the ops between two collectives take the longer of their device time and their
    host time: the host categories keep only what exceeds the device's."""
    out, run = [], []
    started: dict = {}  # (op, ranks) -> positions in `out` of those started, not yet waited for

    def flush():
        if profile.host_overlaps:
            device = sum(t for c, t in run if c == "compute")
            host = sum(t for c, t in run if c != "compute")
            beyond = max(0.0, host - device) / host if host else 0.0
            run[:] = [(c, t if c == "compute" else t * beyond) for c, t in run]
        if run:
            busy = {}
            for category, seconds in run:
                busy[category] = busy.get(category, 0.0) + seconds
            out.append(("busy", busy))
        run.clear()

    for e in recording.events:
        kind = e[0]
        if kind == "op":
            framework = profile.op_latency
            run.append(("compute", (op_time(e[2], e[3], profile, gemm=e[4], name=e[1], elements=e[5], strided=e[6])
                                    - framework) * slow))
            run.append(("framework", framework * slow))
        elif kind == "dist":
            run.append(("dispatch", (profile.dispatch_overhead if len(e) == 1 or e[1] else profile.off_mesh_dispatch) * slow))
        elif kind == "region":
            boundary = profile.region_forward if e[1] == "forward" else profile.region_backward
            run.append(("dispatch", boundary * slow))
        elif kind == "node":
            run.append(("autograd", profile.autograd_node * slow))
        elif kind == "start":
            flush()
            started.setdefault((e[1], e[2]), []).append(len(out))
            out.append(("start", None, len(out)))
        else:
            flush()
            rec = e[1]
            waiting = started.get((rec.op, tuple(rec.ranks)))
            if waiting:  # the oldest started of its kind is the one waited for
                link = waiting.pop(0)
                out[link] = ("start", rec, link)
                out.append(("collect", rec, link))
            else:
                out.append(("comm", rec))
    flush()
    return [s for s in out if s[1] is not None]  # one started and never waited for is not priced


class _Playback:
    """The job's timelines played forward in time.  A rank is running (host work, or the
    latency of posting a send), blocked (at a collective its peers have not reached, or on a
    receive whose send has not started), or in a transfer (a collective all its members
    reached, or a receive after its send started), which ends at a fixed time.  Running
    ranks share the cores (`core_share`, other programs' `load` counted among them); a
    blocked rank or one in a transfer leaves its core to the others.  A collective started
    to overlap later work is in flight from its last member's start, sharing the cores with
    the running ranks, until it has had its price's worth of them; a rank that reaches its
    wait first waits for it."""

    def __init__(self, recordings: list, profile: DeviceProfile, load: float, roles: dict, world: int):
        self.profile, self.load, self.roles = profile, load, roles
        # collectives are priced as measured with this many processes per core
        self.crowding = (world + load) / profile.cores if profile.cores else 1.0
        self.lines = {r.rank: _segments(r, profile, host_factor(self.crowding, profile)) for r in recordings}
        self.weight = dict.fromkeys(self.lines, 0)  # ranks each timeline stands for
        for rank in range(world):
            self.weight[roles.get(rank, rank)] += 1
        self.spent = {r: dict.fromkeys(CATEGORIES, 0.0) for r in self.lines}
        self.pos = dict.fromkeys(self.lines, 0)
        # rank -> ["run", left, total, {category: seconds}] | ["until", end] | ["collective", key]
        #         | ["flight", key] | ["recv"] | ["done"]
        self.state: dict = {}
        self.finish: dict = {}
        self.now = 0.0
        self.arrived: dict = {}  # collective key -> ranks arrived
        self.ends: dict = {}  # collective key -> when its transfer ends (all members arrived)
        self.flights: dict = {}  # key of a started collective in flight -> [seconds left on a core, ranks]
        self.links: dict = {}  # (rank, link of a started collective) -> its key
        self.sent: dict = {}  # transfer key -> send start
        self.count: dict = {}  # (rank, key without index) -> how many seen

    def _run(self, r, categories: dict) -> None:
        total = sum(categories.values())
        self.state[r] = ["run", total, total, categories]

    def _take(self, r) -> None:
        """Rank `r` starts its next segment (or finishes)."""
        line = self.lines[r]
        if self.pos[r] == len(line):
            self.state[r], self.finish[r] = ["done"], self.now
            return
        seg = line[self.pos[r]]
        if seg[0] == "busy":
            return self._run(r, dict(seg[1]))
        if seg[0] == "start":  # the rank goes on while the bytes move
            self.links[(r, seg[2])] = self._arrive(r, seg[1], started=True)
            self.pos[r] += 1
            return self._take(r)
        if seg[0] == "collect":
            return self._collect(r, self.links.pop((r, seg[2])))
        rec = seg[1]
        if rec.op not in ("send", "recv"):
            return self._collect(r, self._arrive(r, rec))
        cost = comm_time(rec.op, len(rec.ranks), rec.bytes, rec.recv_bytes, self.profile, self.crowding)
        members = self._members(rec)
        base = ("p2p", members)
        n = self.count.get((r, base), 0)
        within_role = len(members) == 1  # nobody to wait for
        if rec.op == "recv" and not within_role and (members, n) not in self.sent:
            self.state[r] = ["recv"]  # taken again once its send has started
            return
        self.count[(r, base)] = n + 1
        if within_role:
            self.state[r] = ["until", self.now + cost]
        elif rec.op == "send":  # sends do not wait: posting one costs the link's latency
            self.sent[(members, n)] = self.now
            self._run(r, {"comm": shared_link(self.profile, self.crowding)[0]})
        else:
            self.state[r] = ["until", max(self.now, self.sent[(members, n)] + cost)]

    def _members(self, rec) -> tuple:
        """The timelines (roles) among the ranks of `rec`, in order."""
        return tuple(dict.fromkeys(self.roles.get(x, x) for x in rec.ranks))

    def _arrive(self, r, rec, started: bool = False) -> tuple:
        """Rank `r` reaches collective `rec`; the last of its members starts the transfer.
        One the members wait at ends at a fixed time (priced as calibrated, their cores left
        to it); one `started` to overlap their work is in flight, sharing the cores with the
        running ranks (gloo's threads move the bytes on the host's cores; a profile without
        cores counts a device per rank, which moves them alongside).  Returns the
        collective's key."""
        members = self._members(rec)
        base = (rec.op, members)
        key = (base, self.count.get((r, base), 0))
        self.count[(r, base)] = key[1] + 1
        present = self.arrived.setdefault(key, [])
        present.append(r)
        if len(present) == len(members):
            cost = comm_time(rec.op, len(rec.ranks), rec.bytes, rec.recv_bytes, self.profile, self.crowding)
            if started:
                self.flights[key] = [cost, sum(self.weight[m] for m in members)]
            else:
                self.ends[key] = self.now + cost
            for m in present:
                if self.state.get(m) == ["collective", key]:
                    self.state[m] = ["flight", key] if started else ["until", self.ends[key]]
        return key

    def _collect(self, r, key) -> None:
        """Rank `r` needs collective `key` done: it waits for its peers, then for the transfer."""
        end = self.ends.get(key)  # None until its last member arrives (or while it is in flight)
        if key in self.flights:
            self.state[r] = ["flight", key]
        elif end is None:
            self.state[r] = ["collective", key]
        elif not self._ended(end):
            self.state[r] = ["until", end]
        else:
            self.pos[r] += 1
            self._take(r)

    def _ended(self, end: float) -> bool:
        return end <= self.now * (1 + 1e-12) + 1e-15  # rounding of the clock's sums

    def _advance(self) -> None:
        """Move time to the next end of a running segment or a transfer."""
        running = [r for r, s in self.state.items() if s[0] == "run"]
        runnable = sum(self.weight[r] for r in running) + sum(f[1] for f in self.flights.values())
        share = core_share(self.load + runnable, self.profile)
        ends = [self.state[r][1] / share for r in running] + [f[0] / share for f in self.flights.values()]
        ends += [s[1] - self.now for s in self.state.values() if s[0] == "until"]
        if not ends:
            stuck = {r: self.lines[r][self.pos[r]][1] for r, s in self.state.items() if s[0] != "done"}
            raise RuntimeError(f"predict: the ranks' collectives do not match; each waits on {stuck}")
        dt = max(min(ends), 0.0)
        self.now += dt
        done = []
        for r, s in self.state.items():
            if s[0] == "run":
                for category, seconds in s[3].items():
                    self.spent[r][category] += dt * seconds / s[2]
                s[1] -= dt * share
                if s[1] <= 1e-12 * max(s[2], 1.0):
                    done.append(r)
            elif s[0] == "until":
                self.spent[r]["comm"] += dt
                if self._ended(s[1]):
                    done.append(r)
            elif s[0] == "flight":
                self.spent[r]["comm"] += dt
            elif s[0] != "done":
                self.spent[r]["wait"] += dt
        for key, flight in list(self.flights.items()):
            flight[0] -= dt * share
            if flight[0] <= 1e-12:
                del self.flights[key]
                self.ends[key] = self.now
                done += [r for r, s in self.state.items() if s == ["flight", key]]
        for r in done:
            self.pos[r] += 1
            self._take(r)

    def play(self) -> Prediction:
        for r in self.lines:
            self._take(r)
        while any(s[0] != "done" for s in self.state.values()):
            for r, s in list(self.state.items()):  # a receive whose send has started since
                if s[0] == "recv":
                    self._take(r)
            if any(s[0] != "done" for s in self.state.values()):
                self._advance()
        last = max(self.finish, key=self.finish.get)
        return Prediction(self.finish[last], self.spent[last], last, [])


def job_time(recordings: list, profile: DeviceProfile, load: float = 0.0, roles: Optional[dict] = None,
             world_size: Optional[int] = None) -> Prediction:
    """Play every rank's priced timeline (`_Playback`): a collective ends `comm_time` after
    its last member arrives; a receive ends `comm_time` after the matching send started
    (sends do not wait).  Where the ranks (and `load`: see `machine_load`) outnumber the
    profile's cores, the running ones share them and each does more host work
    (`host_factor`), and collectives take the `shared_link` of as many processes per core.

    `roles` ({rank: the recorded rank that stands for it}) plays a job from one recording
    per role (`representative_ranks`): a collective waits for the roles among its members
    and a transfer between two ranks of one role for nobody (each rank of a role does the
    same at the same time), priced for the real group; `world_size` is the job's ranks."""
    world = world_size or len(recordings)
    prediction = _Playback(recordings, profile, load, roles or {}, world).play()
    prediction.recordings = list(recordings)
    return prediction


def predict_step(make_step: Callable[[], Callable[[], object]], world_size: int,
                 device: Union[str, DeviceProfile] = "cpu", warmup: int = 3, load: float = 0.0,
                 mesh=None) -> Prediction:
    """Predict one step of a `world_size`-rank job on `device` by running every rank here
    under `simulate` (small worlds) and pricing what it ran.  `make_step()` is called inside each
    simulated rank and builds the model, returning the step callable.  `load`: cores' worth
    of other programs' work sharing the machine (`machine_load()` measures it now).

    >>> import torch, autopar as dist
    >>> def make_step():
    ...     mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    ...     model = torch.nn.Linear(64, 64)
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     model, opt = dist.parallelize(model, opt, mesh, {"dp_config": {"sharding_level": 0}})
    ...     x = torch.randn(32, 64)
    ...     def step():
    ...         model(x).sum().backward(); opt.step(); opt.zero_grad()
    ...     return step
    >>> p = predict_step(make_step, 2)  # doctest: +SKIP
    >>> 0 < p.total < 1, sorted(p.categories) == sorted(dist.planner.predict.CATEGORIES)  # doctest: +SKIP
    (True, True)

    (Skipped where docstrings run inside a job; tests/test_predict.py runs it in a plain process.)

    With `mesh` (the job's), only one rank per role runs (`dist.representative_ranks`), so a
    large job built on the meta device is priced from its stages' first ranks.
    """
    profile = load_profile(device)
    check_profile(profile)  # a cpu profile made elsewhere warns, saying what moved
    if mesh is None:
        return job_time([record_step(make_step, world_size, r, warmup) for r in range(world_size)], profile, load)
    from ..tools.simulate import rank_roles

    roles = rank_roles(mesh)
    recordings = [record_step(make_step, world_size, r, warmup) for r in sorted(set(roles.values()))]
    return job_time(recordings, profile, load, roles, world_size)


# -- calibration -----------------------------------------------------------------------------------
def _reference_model(width: int = 16):
    """A small MLP block: layer norm, a GELU MLP (two Linears a Megatron plan splits)."""
    return torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width))


def _host_times(runs: dict, rounds: int, steps: int) -> dict:
    """{key: seconds of one call of its step}: the steps take turns for `rounds` rounds, each
    timed as the median of its rounds' medians of `steps` calls, in this thread's CPU time
    (a shared machine's preemptions are not ours).  Taking turns keeps a slow or fast spell
    of the machine from landing on one step alone; the median over rounds is the machine's
    usual speed, which the steps it predicts run at (the least is its fastest spell's)."""
    taken = _Rounds({key: functools.partial(median_time, step, steps, time.thread_time) for key, step in runs.items()})
    taken.take(rounds)
    return taken.medians()


def _training_step(model, opt, x):
    """One training step of `model` on `x` (a sum loss), as a function."""
    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def _split_reference(ranks: list):
    """(model, optimizer): the reference block under a Megatron plan (its two Linears split)
    on a mesh of `ranks`, inside the caller's `simulate`."""
    from ..api.parallelize import parallelize
    from ..api.plans import ColWiseParallel, RowWiseParallel
    from ..mesh import ProcessMesh

    model = _reference_model()
    plan = {"1": ColWiseParallel(), "3": RowWiseParallel()}
    return parallelize(model, torch.optim.AdamW(model.parameters()), ProcessMesh(ranks, dim_names=["mp"]),
                       {"mp_config": {"parallelize_plan": plan}})


def framework_costs(profile: DeviceProfile, rounds: int = 7, steps: int = 9) -> tuple[float, float, float]:
    """(seconds per aten op, per autograd node, per DistTensor dispatch) of host work beyond
    the ops' compute, measured on training steps of a small MLP block (tiny tensors, so the
    host work dominates) priced with `profile`'s rates: its forward without gradients gives
    the per-op cost (Python, modules, dispatcher, allocation); a plain training step (AdamW)
    the per-node cost; the same step on a 2-rank Megatron split (one rank simulated) the
    per-dispatch cost.  The three are timed taking turns (`_host_times`): measured one after
    the other, a spell of the machine's other work on one of them moved cost between the
    per-op and the per-node constants (7 and 48 us on one calibration, 11 and 3 on the next)."""
    from ..tools.simulate import simulate

    profile = dataclasses.replace(profile, op_latency=0.0)
    x = torch.randn(4, 16)

    def forward(model):
        def step():
            with torch.no_grad():
                model(x)
        return step

    with simulate(2, 0):
        plain = _reference_model()
        runs = {"op": forward(plain), "node": _training_step(plain, torch.optim.AdamW(plain.parameters()), x),
                "dist": _training_step(*_split_reference([0, 1]), x)}
        for step in runs.values():
            for _ in range(2):  # warm-up: the optimizer's states, a local region's verification
                step()
        seconds = _host_times(runs, rounds, steps)
        priced = {key: _price(step, profile, "compute") for key, step in runs.items()}
    op_rec, node_rec, dist_rec = (priced[key][1] for key in ("op", "node", "dist"))
    op = max(seconds["op"] - priced["op"][0], 0.0) / op_rec.count("op")
    node_time = seconds["node"] - priced["node"][0] - op * node_rec.count("op")
    node = max(node_time, 0.0) / max(node_rec.count("node"), 1)
    busy = priced["dist"][0] + op * dist_rec.count("op") + node * dist_rec.count("node")
    return op, node, max(seconds["dist"] - busy, 0.0) / max(dist_rec.count("dist"), 1)


def off_mesh_costs(profile: DeviceProfile) -> float:
    """Seconds per DistTensor dispatch off this rank's mesh (a pipeline's other stages: the
    op only wraps empty pieces) beyond the ops it runs: the Megatron-split training step of
    `framework_costs` on a mesh of the other rank (rank 0 of 2 simulated), less its price on
    `profile` (ops, nodes), per dispatch."""
    from ..tools.simulate import simulate

    with simulate(2, 0):
        step = _training_step(*_split_reference([1]), torch.randn(4, 16))
        for _ in range(2):
            step()
        seconds = _host_times({"off mesh": step}, 5, 9)["off mesh"]
        priced, rec = _price(step, dataclasses.replace(profile, off_mesh_dispatch=0.0))
    dispatches = rec.events.count(("dist", False))
    if not dispatches:
        raise RuntimeError("off_mesh_costs: the reference step dispatched nothing off its mesh")
    return max(seconds - priced, 0.0) / dispatches


class _RegionBlock(torch.nn.Module):
    """A residual MLP block (layer norm, two Linears, GELU): enough ops that data parallel
    runs it as a local region."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * 0.5


def _price(step, profile: DeviceProfile, category: Optional[str] = None) -> tuple[float, Recording]:
    """(the host price of one call of `step` on `profile`, of one category or of all, its
    recording)."""
    recording = Recording(0)
    recorder = _Recorder(recording)
    with recorder:
        step()
    recorder._note(None)
    busy = [s[1] for s in _segments(recording, profile, 1.0) if s[0] == "busy"]
    return sum(c.get(category, 0.0) if category else sum(c.values()) for c in busy), recording


def region_costs(profile: DeviceProfile, counts: tuple = (2, 10), rounds: int = 15, steps: int = 5) -> tuple[float, float]:
    """(seconds per local region call's forward boundary, per its backward boundary): the
    host work a region call adds beyond the ops it runs (unwrapping, its autograd Functions,
    wrapping; in backward the gradients' placing and landing), which dispatches no op.
    Measured as the growth, from `counts[0]` to `counts[1]` blocks (`_RegionBlock`, tiny
    tensors), of a data-parallel rank's time less its price (simulated: `simulate(2, 0)`),
    less the same growth of the blocks run as plain torch: first for the forward (with
    gradients, graph dropped), then for forward and backward.  The eight steps take turns
    for `rounds` rounds, each timed as the median of its rounds' medians of `steps` calls,
    in this thread's CPU time (`_host_times`).  `profile` prices the ops, nodes and dispatches (its
    own region costs are not used)."""
    from ..api.parallelize import parallelize
    from ..api.tensors import shard_tensor
    from ..mesh import ProcessMesh
    from ..placement import Shard
    from ..tools.simulate import simulate

    profile = dataclasses.replace(profile, region_forward=0.0, region_backward=0.0)

    def variants(blocks, x) -> dict:
        def forward():
            h = x
            for block in blocks:
                h = block(h)
            return h

        def training():
            forward().sum().backward()
            for p in blocks.parameters():
                p.grad = None
        return {"forward": forward, "training": training}

    with simulate(2, 0):
        mesh = ProcessMesh([0, 1], dim_names=["dp"])
        runs = {}  # (as regions?, blocks, part) -> step
        for k in counts:
            torch.manual_seed(0)
            plain = torch.nn.ModuleList(_RegionBlock(16) for _ in range(k))
            runs.update({(False, k, part): step for part, step in variants(plain, torch.randn(4, 16)).items()})
            regions = torch.nn.ModuleList(_RegionBlock(16) for _ in range(k))
            parallelize(regions, None, mesh, {"dp_config": {"sharding_level": 0}})
            x = shard_tensor(torch.randn(8, 16), mesh, [Shard(0)])
            runs.update({(True, k, part): step for part, step in variants(regions, x).items()})
        seconds = _host_times(runs, rounds, steps)
        priced = {key: _price(step, profile) for key, step in runs.items()}
    unpriced = {key: seconds[key] - priced[key][0] for key in runs}
    low, high = counts

    def growth(part: str) -> float:
        return (unpriced[(True, high, part)] - unpriced[(True, low, part)]
                - unpriced[(False, high, part)] + unpriced[(False, low, part)])

    def calls(direction: str) -> int:
        return sum(s * priced[(True, k, "training")][1].events.count(("region", direction))
                   for s, k in ((1, high), (-1, low)))

    forward_calls, backward_calls = calls("forward"), calls("backward")
    if min(forward_calls, backward_calls) <= 0:
        raise RuntimeError("region_costs: the reference blocks did not run as local regions")
    forward = max(growth("forward"), 0.0) / forward_calls
    return forward, max(growth("training") - forward * forward_calls, 0.0) / backward_calls
