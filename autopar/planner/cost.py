"""The cost model: device profiles, compute time and alpha-beta collective times.

Everything here is a pure function of a `DeviceProfile` and sizes, so the planner can
price a thousand-rank layout without touching a device.  GPU profiles come from published
specifications; the "cpu" profile is measured on this machine (`calibrate`, run by
`python -m autopar.plan --calibrate out.json`) and loaded from the JSON it writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
from dataclasses import dataclass
from typing import Union

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator and its links.  Bandwidths are bytes/s in one direction per device
    (what a ring step can push), latencies seconds per message."""

    name: str
    peak_flops_bf16: float  # dense (no sparsity) tensor-core peak, FLOP/s
    peak_flops_fp32: float
    memory_bytes: float
    hbm_bandwidth: float
    intra_bandwidth: float  # within a node (NVLink)
    intra_latency: float
    inter_bandwidth: float  # across nodes (InfiniBand, one NIC per device)
    inter_latency: float
    ranks_per_node: int
    # large GEMMs reach this fraction of peak (cuBLAS bf16 on H100: ~700 of 989 TFLOP/s);
    # each kernel launch adds `kernel_latency`: together the efficiency curve of small GEMMs
    matmul_efficiency: float = 0.7
    kernel_latency: float = 5e-6
    reserved_bytes: float = 4 * GB  # context, library workspaces and communication buffers
    # what a step costs beyond FLOPs and bytes (predict.py): each aten op's host cost (dispatcher,
    # allocation, launch), each DistTensor dispatch (rule cache lookup, unwrap, wrap), each autograd
    # node run in backward; 0 cores: every rank has cores of its own.  The defaults are a GPU
    # host's (a server core ~2x this machine's, which measures 3.2, 12 and <1 us)
    op_latency: float = 5e-6
    dispatch_overhead: float = 10e-6
    autograd_node: float = 5e-6
    # each local region call's boundary beyond its ops (runtime/local_region.py: unwrapping, its
    # autograd Functions, wrapping), forward and backward; a DistTensor dispatch off the rank's
    # mesh (a pipeline's other stages: empty pieces wrapped) beyond its ops.  The defaults: the
    # shipped cpu profile's
    region_forward: float = 22e-6
    region_backward: float = 84e-6
    off_mesh_dispatch: float = 5e-6
    cores: int = 0
    # the host issues ops while the device runs earlier ones (GPUs); False: the host computes them
    # itself (a CPU), so host and compute time add
    host_overlaps: bool = True
    # measured (size, rate) points, ascending: GEMM FLOPs -> FLOP/s, element-wise bytes -> bytes/s;
    # empty: peak * matmul_efficiency and hbm_bandwidth at every size
    gemm_curve: tuple = ()
    memory_curve: tuple = ()
    element_costs: tuple = ()  # (aten op name, seconds per element) of compute-bound element-wise ops
    strided_costs: tuple = ()  # the same on inputs stepping along their last dim (`predict.strided_access`)
    # (ranks per core, latency per ring step, bandwidth) of collectives among ranks that share
    # cores (a peer must be scheduled before a step completes; measured as a round of compute
    # and a collective less the round's compute), ascending; empty: the intra link
    shared_links: tuple = ()
    # (collective, latency per ring step, bandwidth) measured like the intra link's all_reduce;
    # a collective not listed (or on a profile without any) takes the intra link
    op_links: tuple = ()
    # (ranks per core, factor) on each rank's host time where ranks share cores and switch at
    # every collective (caches refilled, switches paid), ascending; empty: 1
    shared_host: tuple = ()
    # (constant, lowest, highest) over the calibration's rounds of the constants `profile_check`
    # measures again: the machine's own spread (its per-op latency moves 1.5-3 us between
    # spells a second apart); empty: the profile's value alone
    check_spread: tuple = ()
    # where and when it was measured (`machine_signature()`, an ISO date); empty: datasheet figures
    calibrated_on: str = ""
    calibrated_at: str = ""

    def peak_flops(self, precision: str) -> float:
        return {"bf16": self.peak_flops_bf16, "fp32": self.peak_flops_fp32}[precision]

    @functools.cached_property
    def per_element_tables(self) -> tuple[dict, dict]:
        """(aten op name -> seconds per element, the same for a strided input: `strided_costs`
        over `element_costs`), built once per profile: every op priced looks one up."""
        plain = dict(self.element_costs)
        return plain, {**plain, **dict(self.strided_costs)}


# NVIDIA datasheets: H100 SXM5 989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 80 GB HBM3 at
# 3.35 TB/s, NVLink 4 900 GB/s bidirectional; ConnectX-7 400 Gb/s per GPU.  H200: the
# same chip with 141 GB HBM3e at 4.8 TB/s.  A100 SXM 80GB: 312 TFLOP/s BF16, 19.5 FP32,
# 2.0 TB/s, NVLink 3 600 GB/s bidirectional, 200 Gb/s HDR per GPU.
H100 = DeviceProfile(
    name="h100", peak_flops_bf16=989e12, peak_flops_fp32=67e12, memory_bytes=80 * GB,
    hbm_bandwidth=3.35e12, intra_bandwidth=450 * GB, intra_latency=3e-6,
    inter_bandwidth=400e9 / 8, inter_latency=6e-6, ranks_per_node=8,
)
H200 = dataclasses.replace(H100, name="h200", memory_bytes=141 * GB, hbm_bandwidth=4.8e12)
A100 = DeviceProfile(
    name="a100", peak_flops_bf16=312e12, peak_flops_fp32=19.5e12, memory_bytes=80 * GB,
    hbm_bandwidth=2.0e12, intra_bandwidth=300 * GB, intra_latency=3e-6,
    inter_bandwidth=200e9 / 8, inter_latency=6e-6, ranks_per_node=8,
)
_ONE_MACHINE = 1 << 16  # the cpu profile's ranks all share this machine
# `python -m autopar.plan --calibrate` on the development machine (one thread per rank, gloo
# over loopback, the machine otherwise idle); every rank of a job must plan with the same numbers, so "cpu" is this
# fixed profile unless $AUTOPAR_CPU_PROFILE names a file measured on yours
CPU = DeviceProfile(
    name="cpu", peak_flops_bf16=1.07e11, peak_flops_fp32=1.07e11, memory_bytes=25e9, hbm_bandwidth=5.68e10,
    intra_bandwidth=1.51e9, intra_latency=7.37e-4, inter_bandwidth=1.51e9, inter_latency=7.37e-4,
    ranks_per_node=_ONE_MACHINE, matmul_efficiency=1.0, kernel_latency=9.48e-7, reserved_bytes=0.0,
    op_latency=3.01e-6, dispatch_overhead=1.12e-5, autograd_node=0.0, cores=2,
    gemm_curve=((1.02e3, 1.75e9), (8.19e3, 6.48e9), (6.55e4, 3.32e10), (5.24e5, 6.55e10),
                (4.19e6, 8.56e10), (3.36e7, 9.99e10), (2.68e8, 1.07e11)),
    memory_curve=((1.23e4, 1.52e10), (4.92e4, 2.79e10), (1.97e5, 4.29e10), (7.86e5, 5.4e10),
                  (3.15e6, 5.17e10), (1.26e7, 5.68e10), (5.03e7, 4.46e10), (2.01e8, 6.58e9)),
    element_costs=(("aten::exp", 6.27e-10), ("aten::log", 7.85e-10), ("aten::sqrt", 3.84e-10), ("aten::rsqrt", 2.49e-10),
                   ("aten::sigmoid", 2.67e-10), ("aten::tanh", 2.12e-9), ("aten::silu", 2.72e-10),
                   ("aten::gelu", 4.95e-10), ("aten::silu_backward", 2.94e-10), ("aten::gelu_backward", 5.35e-10),
                   ("aten::tanh_backward", 1.53e-10), ("aten::sigmoid_backward", 1.54e-10),
                   ("aten::pow.Tensor_Scalar", 1.72e-10), ("aten::mean.dim", 1.26e-10),
                   ("aten::sum.dim_IntList", 1.21e-10), ("aten::_softmax", 4.32e-10),
                   ("aten::_log_softmax", 4.19e-10), ("aten::_softmax_backward_data", 1.51e-10),
                   ("aten::_log_softmax_backward_data", 2.87e-10)),
    strided_costs=(("aten::exp", 9.65e-10), ("aten::log", 1.12e-9), ("aten::sqrt", 7.23e-10), ("aten::rsqrt", 5.2e-10),
                   ("aten::sigmoid", 1.83e-9), ("aten::tanh", 2.46e-9), ("aten::silu", 1.86e-9),
                   ("aten::gelu", 5.98e-9), ("aten::silu_backward", 2.2e-9), ("aten::gelu_backward", 7.97e-9),
                   ("aten::tanh_backward", 4.05e-10), ("aten::sigmoid_backward", 3.92e-10),
                   ("aten::pow.Tensor_Scalar", 3.45e-10), ("aten::mean.dim", 2.53e-10),
                   ("aten::sum.dim_IntList", 2.58e-10), ("aten::_softmax", 7.77e-10),
                   ("aten::_log_softmax", 7.35e-10), ("aten::_softmax_backward_data", 7.95e-10),
                   ("aten::_log_softmax_backward_data", 9.09e-10), ("aten::mul.Tensor", 3.85e-10),
                   ("aten::add.Tensor", 4.06e-10), ("aten::stack", 6.79e-10), ("aten::cat", 6.71e-10)),
    shared_links=((2.0, 1.01e-3, 1.35e9), (4.0, 1.48e-3, 5.91e8)),
    shared_host=((1.0, 1.08), (2.0, 1.2), (4.0, 1.32)),
    op_links=(("all_gather", 9.25e-4, 1.53e9), ("all_to_all", 7.28e-4, 1.89e9)),
    host_overlaps=False, calibrated_on="the development machine (2 cores, 24 GiB; its processor not recorded)",
    calibrated_at="2026-11-25",
    # measured later (2026-11-28) on a second machine of the same kind (Intel Xeon, 2 cores,
    # 24 GiB), whose host work costs twice this one's (op_latency 5.9 against 3.0 us, dispatch 23
    # against 11, in its calibration benchmarks/results/cpu_profile.8fad37c.json): half of what
    # `predict.region_costs` and `predict.off_mesh_costs` measured there (45, 168 and 9.5 us)
    region_forward=2.2e-5, region_backward=8.4e-5, off_mesh_dispatch=4.8e-6,
)
PROFILES = {p.name: p for p in (H100, H200, A100)}
# constants a cpu profile file calibrated before they were measured takes: those measured on the
# second machine against its profile (benchmarks/results/cpu_profile.8fad37c.json), 2026-11-28
_MEASURED_LATER = {"region_forward": 4.5e-5, "region_backward": 1.68e-4, "off_mesh_dispatch": 9.5e-6}
CPU_PROFILE_ENV = "AUTOPAR_CPU_PROFILE"  # path of a calibrated profile JSON for "cpu"


def load_profile(device: Union[str, DeviceProfile]) -> DeviceProfile:
    """A profile by name ("h100", "h200", "a100", "cpu"), from a JSON file, or as given.
    "cpu" reads $AUTOPAR_CPU_PROFILE when set."""
    if isinstance(device, DeviceProfile):
        return device
    if device in PROFILES:
        return PROFILES[device]
    if device == "cpu":
        path = os.environ.get(CPU_PROFILE_ENV)
        return load_profile(path) if path else CPU
    if os.path.exists(device):
        with open(device) as f:
            fields = json.load(f)
        for curve in ("gemm_curve", "memory_curve", "element_costs", "strided_costs", "shared_links", "shared_host",
                      "op_links", "check_spread"):
            fields[curve] = tuple(tuple(p) for p in fields.get(curve, ()))
        if fields.get("name") == "cpu":  # a file from before these were calibrated
            for name, value in _MEASURED_LATER.items():
                fields.setdefault(name, value)
        return DeviceProfile(**fields)
    raise ValueError(f"unknown device {device!r}: use one of {sorted(PROFILES) + ['cpu']} or a profile JSON file")


# -- compute -----------------------------------------------------------------------------------
def matmul_time(flops: float, kernels: int, profile: DeviceProfile, precision: str = "bf16") -> float:
    """Seconds for `kernels` GEMMs doing `flops` in all."""
    return flops / (profile.peak_flops(precision) * profile.matmul_efficiency) + kernels * profile.kernel_latency


def memory_bound_time(nbytes: float, profile: DeviceProfile) -> float:
    """Seconds for element-wise kernels moving `nbytes` through device memory."""
    return nbytes / profile.hbm_bandwidth


# -- collectives -------------------------------------------------------------------------------
# (latency steps, bandwidth factor) of a ring over n ranks; `nbytes` is the whole tensor
# (all_gather: the gathered result; reduce_scatter and all_reduce: the input)
_RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),
    "send": lambda n: (1, 1.0),
}
COLLECTIVES = tuple(_RING)


def link(profile: DeviceProfile, group_size: int, stride: int) -> tuple[float, float]:
    """(latency, bandwidth) of a group of `group_size` ranks `stride` apart in rank order:
    NVLink if they share a node (ranks fill nodes in order), else the inter-node network."""
    if group_size * stride <= profile.ranks_per_node:
        return profile.intra_latency, profile.intra_bandwidth
    return profile.inter_latency, profile.inter_bandwidth


def op_link(profile: DeviceProfile, op: str, latency: float, bandwidth: float) -> tuple[float, float]:
    """(latency, bandwidth) of collective `op` on a link measured as (latency, bandwidth) for
    all_reduce: scaled as the profile measured `op` against all_reduce (`op_links`; gloo's
    all-to-all is slower per byte on this machine), unchanged where it did not.  A host
    profile's reduce_scatter is the all-to-all autopar runs for it (`collectives.reduce_scatter`:
    the same bytes, the sum a local op)."""
    if op == "reduce_scatter" and not profile.host_overlaps:
        op = "all_to_all"
    for name, op_latency, op_bandwidth in profile.op_links:
        if name == op:
            return latency * op_latency / profile.intra_latency, bandwidth * op_bandwidth / profile.intra_bandwidth
    return latency, bandwidth


def collective_time(op: str, nbytes: float, group_size: int, profile: DeviceProfile, stride: int = 1) -> float:
    """Seconds for one collective `op` on `nbytes` over `group_size` ranks (alpha-beta ring).

    >>> collective_time("all_reduce", 1e9, 8, H100)  # 2*7/8 GB at 450 GB/s + 14 hops
    0.003930888888888889
    """
    if group_size == 1:
        return 0.0
    if op not in _RING:
        raise ValueError(f"no cost model for collective {op!r}; known: {list(_RING)}")
    steps, factor = _RING[op](group_size)
    alpha, bandwidth = op_link(profile, op, *link(profile, group_size, stride))
    return steps * alpha + factor * nbytes / bandwidth


# -- calibration -------------------------------------------------------------------------------
def _fit_line(xs: list, ys: list) -> tuple[float, float]:
    """y = a*x + b by least squares on the relative error (small and large sizes count
    alike), a and b kept positive."""
    w = [1.0 / (y * y) for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    a = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max(a, 1e-30), max((sy - a * sx) / sw, 1e-9)


def _collective(op: str, t, world: int):
    """A call of gloo's `op` on `t` (the whole tensor, as `_RING` counts it) among `world` ranks."""
    import torch
    import torch.distributed as tdist

    piece = t[: t.numel() // world]
    # torch 2.13 renamed the tensor forms (*_single); older releases have only the old names
    if op == "all_gather":
        gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
        return lambda: gather(t, piece)
    if op == "all_to_all":
        out = torch.empty_like(t)
        return lambda: tdist.all_to_all_single(out, t)
    return lambda: tdist.all_reduce(t)


def _gemms(a) -> None:
    """The compute of a calibration round: three 256^3 GEMMs (about a millisecond here)."""
    import torch

    for _ in range(3):
        torch.mm(a, a)


def _measure_collective(rank: int, world: int, port: int, ops: tuple, sizes: list, out, samples: int = 192) -> None:
    """Rank 0 puts {op: for each size, the mean seconds of collective `op` called after a
    round's compute (`_gemms`)} for each of `ops`, on one process group.  In a training step
    a collective follows compute, and gloo's threads have gone to sleep by then (back-to-back
    calls find them awake, 3-5x faster).  The mean, not the median: a step pays every call,
    and one call in five or so waits a scheduler slice (milliseconds) for a core, which the
    median never shows.  After compute, not alone: a rank whose turn on a shared core comes
    late makes the others wait at the collective, which the call's time counts.  The call is
    timed from the end of this rank's compute, as the ranks run it (a compute timed apart, in
    the calibrating process, subtracted from the round gave the links whatever the ranks'
    own compute took beyond it: 1.3 to 2.7 ms per all-gather step between two
    calibrations).  The sizes and ops take turns, round by round: a slow spell of the
    machine (seconds) then slows them all alike instead of bending the latency-bandwidth
    line at the size it fell on."""
    import time

    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    a = torch.randn(256, 256)
    calls = [_collective(op, torch.ones(n // 4), world) for op in ops for n in sizes]
    for call in calls:
        _gemms(a)
        call()
    tdist.barrier()
    spent = [0.0] * len(calls)
    for _ in range(samples):
        for i, call in enumerate(calls):
            _gemms(a)
            t0 = time.perf_counter()
            call()
            spent[i] += time.perf_counter() - t0
    tdist.barrier()
    if rank == 0:
        times = [max(s / samples, 1e-7) for s in spent]
        out.put({op: times[k * len(sizes):(k + 1) * len(sizes)] for k, op in enumerate(ops)})
    tdist.destroy_process_group()


def median_time(fn, repeats: int = 7, clock=None) -> float:
    """Median seconds of `fn` over `repeats` calls after one untimed call (per-op costs and
    steps: the machine as it runs, other work included), on `clock` (default
    `time.perf_counter`)."""
    import statistics
    import time

    clock = clock or time.perf_counter
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _per_call(fn, calls: int = 400) -> float:
    """Seconds per call of `fn`, called `calls` times in a loop."""
    def loop():
        for _ in range(calls):
            fn()
    return median_time(loop) / calls


def _cold_call(make_args, func, nbytes: int, working_set: int, repeats: int = 5) -> float:
    """Seconds of one `func(*args)`, the argument tuples (`nbytes` each, from `make_args()`)
    cycled through `working_set` bytes: a training step's operands come from memory, not
    from the caches a repeated call would keep them in (and outputs are allocated each call).
    The median of `repeats` loops over them."""
    calls = [make_args() for _ in range(max(2, working_set // nbytes))]
    count = max(min(len(calls), 4096), 64)

    def loop():
        for i in range(count):
            func(*calls[i % len(calls)])
    return median_time(loop, repeats) / count


class _Rounds:
    """Measures taken in rounds, every measure once per round in turn (`take`), each the
    median of its rounds (`medians`): a shared machine's speed moves by a fifth between two
    timings seconds apart (a 512^3 GEMM at 83 and 122 GFLOP/s within a minute) and keeps a
    fast or slow spell for minutes, so a rate timed once is that moment's; rounds spread
    over a calibration give its usual one."""

    def __init__(self, measures: dict):
        self.measures = measures
        self.taken: dict = {key: [] for key in measures}

    def take(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            for key, measure in self.measures.items():
                self.taken[key].append(measure())

    def medians(self) -> dict:
        import statistics

        return {key: statistics.median(values) for key, values in self.taken.items()}


# element-wise ops that compute more per element than they move (transcendentals, reductions
# along a row): their seconds per element are measured on (256, 1024) fp32 inputs
_ELEMENT_OPS = {
    "aten::exp": lambda x: (x,), "aten::log": lambda x: (x,), "aten::sqrt": lambda x: (x,),
    "aten::rsqrt": lambda x: (x,), "aten::sigmoid": lambda x: (x,), "aten::tanh": lambda x: (x,),
    "aten::silu": lambda x: (x,), "aten::gelu": lambda x: (x,), "aten::silu_backward": lambda x: (x, x),
    "aten::gelu_backward": lambda x: (x, x), "aten::tanh_backward": lambda x: (x, x),
    "aten::sigmoid_backward": lambda x: (x, x), "aten::pow.Tensor_Scalar": lambda x: (x, 2),
    "aten::mean.dim": lambda x: (x, [-1]), "aten::sum.dim_IntList": lambda x: (x, [-1]),
    "aten::_softmax": lambda x: (x, -1, False), "aten::_log_softmax": lambda x: (x, -1, False),
    "aten::_softmax_backward_data": lambda x: (x, x, -1, x.dtype),
    "aten::_log_softmax_backward_data": lambda x: (x, x, -1, x.dtype),
}


# ops also timed on inputs stepping along their last dim (`predict.strided_access`): the
# element-wise ones above, the common arithmetic, and a stack or cat along a new last dim
_STRIDED_OPS = dict(_ELEMENT_OPS, **{
    "aten::mul.Tensor": lambda x: (x, x), "aten::add.Tensor": lambda x: (x, x),
    "aten::stack": lambda x: ([x, x], -1), "aten::cat": lambda x: ([x.unsqueeze(-1), x.unsqueeze(-1)], -1),
})


_ELEMENT_ROWS, _ELEMENT_COLS = 256, 1024  # the element-wise ops' inputs


def _element_measures(working_set: int, ops: dict = _ELEMENT_OPS, step: int = 1) -> dict:
    """{op name: a measure of its seconds per call on (_ELEMENT_ROWS, _ELEMENT_COLS) inputs
    (every `step`-th element of a row), cycled through `working_set` bytes as in
    `_cold_call`}, taken in `_Rounds`."""
    import torch

    nbytes = _ELEMENT_ROWS * _ELEMENT_COLS * 4 * step
    xs = [(torch.rand(_ELEMENT_ROWS, _ELEMENT_COLS * step) + 0.5)[:, ::step] for _ in range(max(2, working_set // nbytes))]
    measures = {}
    for name, make_args in ops.items():
        packet, _, overload = name[len("aten::"):].partition(".")
        func = getattr(getattr(torch.ops.aten, packet), overload or "default")
        calls = [make_args(x) for x in xs]

        def loop(func=func, calls=calls):
            for args in calls:
                func(*args)
        measures[name] = lambda loop=loop, n=len(calls): median_time(loop, 1) / n
    return measures


def _element_costs(seconds: dict, op: float) -> tuple:
    """((op name, seconds per element of its first input), ...) from the per-call `seconds`
    of `_element_measures`, less the per-op latency `op`."""
    return tuple((name, max(s - op, 0.0) / (_ELEMENT_ROWS * _ELEMENT_COLS)) for name, s in seconds.items())


def _net(seconds: float, op: float) -> float:
    """A small op's own seconds: less the per-op latency `op`, which noise (or caches warmer
    than when `op` was measured) can make exceed it; never under half of what was measured."""
    return max(seconds - op, seconds / 2)


def _curve(sizes: list, work, time_of) -> tuple:
    """((size, rate), ...) ascending, the rate being work(size) / time_of(size)."""
    return tuple((float(work(n)), work(n) / time_of(n)) for n in sizes)


def _measure_host(rank: int, world: int, port: int, out) -> None:
    """Rank 0 puts the ranks' mean thread seconds per round of a small step's host work
    (three 256^3 GEMMs and twenty adds over a 16 MB working set) ending in an all_reduce."""
    import time

    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flag, xs = torch.ones(16), [torch.randn(256, 256) for _ in range(64)]

    def rounds(n):
        for i in range(n):
            for j in range(3):
                torch.mm(xs[(3 * i + j) % 64], xs[(3 * i + j + 1) % 64])
            for j in range(20):
                torch.add(xs[(i + j) % 64], 1.0)
            tdist.all_reduce(flag)

    rounds(10)
    t0 = time.thread_time()
    rounds(300)
    mean = torch.tensor([(time.thread_time() - t0) / 300 / world], dtype=torch.float64)
    tdist.all_reduce(mean)
    if rank == 0:
        out.put(mean.item())
    tdist.destroy_process_group()


def _spawn(target, world: int, *args, timeout: float = 300.0):
    """Rank 0's answer of `target(rank, world, port, *args, queue)` run on `world` spawned ranks;
    a rank that dies, or no answer in `timeout` seconds, raises at once (the others are
    stopped) instead of waiting."""
    import queue as queues
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    answer = None
    try:
        while True:
            try:
                answer = queue.get(timeout=1.0)
                break
            except queues.Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"calibration: spawned rank {failed[0][0]} of {world} exited with code "
                                       f"{failed[0][1]} while measuring {target.__name__}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"calibration: {target.__name__} on {world} ranks gave no answer in "
                                       f"{timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30 if answer is not None else 0)  # after a failure, stop the rest now
            if p.is_alive():
                p.kill()
                p.join()
    return answer


@contextlib.contextmanager
def _one_thread():
    """torch on one thread inside, as each rank runs (then the caller's setting again)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gloo_link(world: int, ops: tuple = ("all_reduce",)) -> dict:
    """{op: (latency per ring step, bandwidth)} of gloo's `ops` on `world` local ranks,
    measured on one set of spawned ranks."""
    sizes = [1 << k for k in range(8, 24, 2)]
    measured = _spawn(_measure_collective, world, ops, sizes)
    links = {}
    for op, times in measured.items():
        steps, factor = _RING[op](world)
        per_byte, fixed = _fit_line([factor * s for s in sizes], times)
        fixed = min(fixed, times[0])
        # noise can flatten the fitted slope to nothing: the largest message bounds the bandwidth
        largest = factor * sizes[-1] / max(times[-1] - fixed, times[-1] / 2)
        links[op] = (fixed / steps, min(1.0 / per_byte, largest))
    return links


def _host_measures(worlds: list) -> dict:
    """`_Rounds` measures of a rank's host seconds among `w` ranks over one rank's alone, for
    each `w` of `worlds`: ranks busy side by side share caches and memory bandwidth, and beyond
    a rank per core, switch.  Each round runs one rank alone, then each `w` against that run
    (back to back, in the same spell of the machine); one run moves 5-10%, and the ratio of
    four ranks on two cores 1.09-1.37 between calibrations minutes apart when taken in one
    place, so its rounds are spread like the rates'."""
    alone: list = []
    measures = {("host", "alone"): lambda: alone.append(_spawn(_measure_host, 1)) or 1.0}
    measures.update({("host", w): lambda w=w: _spawn(_measure_host, w) / alone[-1] for w in worlds})
    return measures


GEMM_SIDES = (8, 16, 32, 64, 128, 256, 512)  # the GEMM rate curve's square sides
CHECKED_GEMM = 128  # the side of the GEMM whose rate `profile_check` measures again
MEMORY_SIZES = tuple(1 << k for k in range(10, 25, 2))  # the memory rate curve's element counts


def checked_gemm_rate(seconds: float, op: float) -> float:
    """FLOP/s of a CHECKED_GEMM-sided GEMM that took `seconds`, net of the per-op latency
    `op`: as the calibration's rounds and `profile_check` both derive it."""
    return 2.0 * CHECKED_GEMM**3 / _net(seconds, op)


def calibrate(world: int = 2, crowding: tuple = (2, 4), working_set: int = 1 << 26, rounds: int = 5) -> DeviceProfile:
    """Measure this machine (one thread per rank, as the ranks run): a GEMM FLOP-rate curve
    and an element-wise memory-rate curve over sizes, the per-element cost of compute-bound
    element-wise ops (and of element-wise ops on strided inputs), its cores, gloo all_reduce latency and bandwidth on `world` ranks, and
    from small training steps the per-op, per-autograd-node and per-DistTensor-dispatch host
    costs (`predict.framework_costs`), a local region call's boundary, forward and backward
    (`predict.region_costs`), and a dispatch off the rank's mesh (`predict.off_mesh_costs`).  Collectives are timed as a step meets them, after
    compute and averaged (`_measure_collective`); all_gather and all_to_all
    like all_reduce (`op_links`); all_reduce also on `crowding` times as many ranks as cores
    (`shared_links`), and a small step's host time with all cores busy and so crowded, against
    one rank alone (`shared_host`); element-wise inputs cycle through `working_set` bytes.
    The rates and host factors are each the median of `rounds` timings taking turns, spread
    over the calibration (`_Rounds`)."""
    import torch

    from .predict import framework_costs, off_mesh_costs, region_costs

    a, b = torch.ones(1), torch.ones(1)
    measures = {"op": lambda: _per_call(lambda: torch.add(a, b))}
    for n in GEMM_SIDES:
        measures["gemm", n] = lambda n=n: _cold_call(lambda: (torch.randn(n, n), torch.randn(n, n)), torch.mm,
                                                     8 * n * n, working_set // 2, repeats=1)
    for n in MEMORY_SIZES:
        measures["memory", n] = lambda n=n: _cold_call(lambda: (torch.ones(n), torch.ones(n)), torch.add,
                                                       8 * n, working_set, repeats=1)
    with _one_thread():
        for kind, ops, step in (("element", _ELEMENT_OPS, 1), ("strided", _STRIDED_OPS, 2)):
            measures.update({(kind, name): m for name, m in _element_measures(working_set, ops, step).items()})
    cores = machine_cores()
    crowded = sorted(w for w in {cores * k for k in crowding} if w > cores)
    measures.update(_host_measures([cores] + crowded))
    rates = _Rounds(measures)
    # the rounds spread over the calibration: one after each of its spawned link
    # measurements (a minute or more each), the rest first
    later = min(rounds - 1, 2)

    def take_rates(count: int) -> None:
        with _one_thread():
            rates.take(count)

    take_rates(rounds - later)
    # gloo's other collectives against all_reduce (its all-to-all is slower; a host
    # reduce-scatter runs as an all-to-all)
    links = _gloo_link(world, ("all_reduce", "all_gather", "all_to_all"))
    take_rates(int(later > 0))
    latency, bandwidth = links["all_reduce"]
    # ranks sharing cores are never faster than ranks with a core each (a noisy fit can say so)
    shared = tuple((w / cores, max(lat, latency), min(bw, bandwidth))
                   for w in crowded for lat, bw in [_gloo_link(w)["all_reduce"]])
    take_rates(int(later > 1))
    seconds = rates.medians()
    host = tuple((w / cores, max(1.0, seconds["host", w])) for w in [cores] + crowded)
    checked_rates = list(map(checked_gemm_rate, rates.taken["gemm", CHECKED_GEMM], rates.taken["op"]))
    spread = (("kernel_latency", min(rates.taken["op"]), max(rates.taken["op"])),
              ("gemm_rate", min(checked_rates), max(checked_rates)))
    op = seconds["op"]  # provisional (`framework_costs` below): the rates are net of it
    gemm = _curve(GEMM_SIDES, lambda n: 2.0 * n**3, lambda n: _net(seconds["gemm", n], op))
    memory = _curve(MEMORY_SIZES, lambda n: 3.0 * n * 4, lambda n: _net(seconds["memory", n], op))
    elements = _element_costs({name: seconds["element", name] for name in _ELEMENT_OPS}, op)
    strided = _element_costs({name: seconds["strided", name] for name in _STRIDED_OPS}, op)
    ops = tuple((op, *links[op]) for op in ("all_gather", "all_to_all"))
    peak = max(rate for _, rate in gemm)
    profile = DeviceProfile(
        name="cpu", peak_flops_bf16=peak, peak_flops_fp32=peak, memory_bytes=float(_total_memory()),
        hbm_bandwidth=max(rate for _, rate in memory), intra_bandwidth=bandwidth, intra_latency=latency,
        inter_bandwidth=bandwidth, inter_latency=latency, ranks_per_node=_ONE_MACHINE,
        matmul_efficiency=1.0, kernel_latency=op, reserved_bytes=0.0, op_latency=op,
        cores=cores, gemm_curve=gemm, memory_curve=memory, element_costs=elements, strided_costs=strided,
        shared_links=shared, shared_host=host, op_links=ops, check_spread=spread, host_overlaps=False,
        **calibration_stamp(),
    )
    with _one_thread():
        op, node, dispatch = framework_costs(profile)
        profile = dataclasses.replace(profile, op_latency=op, dispatch_overhead=dispatch, autograd_node=node)
        forward, backward = region_costs(profile)
        off_mesh = off_mesh_costs(profile)
    return dataclasses.replace(profile, region_forward=forward, region_backward=backward, off_mesh_dispatch=off_mesh)


def machine_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_signature() -> str:
    """This machine in a line: its processor, cores and memory."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {_total_memory() / 2**30:.0f} GiB"


def calibration_stamp() -> dict:
    """The `calibrated_on` / `calibrated_at` fields of a profile measured here and now."""
    return {"calibrated_on": machine_signature(), "calibrated_at": datetime.date.today().isoformat()}


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(profile), f, indent=1)
