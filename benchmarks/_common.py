"""Shared helpers for the autopar benchmarks (not part of the library).

Every benchmark runs autopar, the peer (torch DTensor) and a plain-torch baseline in the
same processes, on the same data, with interleaved repetitions (the order of the impls
rotates every repetition), a warmup, and >= 20 timed repetitions.  Timings of one
repetition are taken on every rank and combined as the max over ranks (the job is as slow
as its slowest rank); medians/min/max are over repetitions.

Results are JSON lines on rank 0's stdout:
    {"bench": ..., "impl": "autopar"|"dtensor"|"plain", "ranks": N,
     "median_ms": ..., "min_ms": ..., "max_ms": ..., "bytes_sent_per_rank": ..., ...}
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import autopar  # noqa: E402
from autopar import comm as _ap_comm  # noqa: E402


class BenchFailure(AssertionError):
    """A correctness check inside a benchmark failed: the numbers are not to be trusted."""


def setup(threads: int = 1) -> tuple[int, int]:
    """One thread per rank; start the default process group (shared by autopar and DTensor)."""
    torch.set_num_threads(threads)
    _ap_comm.ensure_initialized()
    return tdist.get_rank(), tdist.get_world_size()


def rank() -> int:
    return tdist.get_rank()


def world() -> int:
    return tdist.get_world_size()


def barrier() -> None:
    if tdist.get_world_size() > 1:
        tdist.barrier()


def check(cond: bool, what: str) -> None:
    if not cond:
        raise BenchFailure(f"[rank {rank()}] correctness check failed: {what}")


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise BenchFailure(f"[rank {rank()}] correctness check failed: {what}: {e}") from None


def add_mlp_sizes(p) -> None:
    """The MLP sizes of Paddle's auto-parallel guide, section 4.2 (w0 hidden x ffn, w1 ffn x hidden, x batch x seq x hidden)."""
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)


def interleaved(
    fns: dict[str, Callable[[], object]],
    reps: int = 30,
    warmup: int = 3,
    inner: int = 1,
    sync: bool = True,
    only_rank0: frozenset = frozenset(),
    before_rep: Callable[[int], None] | None = None,
    cpu: dict | None = None,
    whole: frozenset = frozenset(),
) -> dict[str, list[float]]:
    """Per-call wall seconds of every impl, one list entry per repetition (max over ranks).

    With `cpu` (a dict), the calling thread's CPU seconds per call are put there too, per
    impl: on a loaded shared machine that excludes time the rank spent descheduled, so it
    is the cleaner measure of pure-Python overhead (it also excludes time blocked in comms).

    Each repetition runs every impl once (`inner` calls, time divided by `inner`), in an
    order rotated per repetition; with `sync` all ranks pass a barrier before each timed
    block so they measure the same impl at the same time.  Impls named in `whole` do all
    `inner` units of work in one call (a captured program of `inner` ops): called once,
    their time is still divided by `inner`.  Impls named in `only_rank0` run
    on rank 0 only (single-process baselines) while the other ranks wait in the barrier.
    """
    names = list(fns)
    me = rank()
    times = {n: [] for n in names}
    cpu_times = {n: [] for n in names}
    for r in range(warmup + reps):
        if before_rep is not None:
            before_rep(r)
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            fn = fns[n]
            if sync:
                barrier()
            if n in only_rank0 and me != 0:
                dt = dc = 0.0
            else:
                c0 = time.thread_time()
                t0 = time.perf_counter()
                for _ in range(1 if n in whole else inner):
                    fn()
                dt = (time.perf_counter() - t0) / inner
                dc = (time.thread_time() - c0) / inner
            if r >= warmup:
                times[n].append(dt)
                cpu_times[n].append(dc)
    barrier()
    if cpu is not None:
        cpu.update({n: _max_over_ranks(v) for n, v in cpu_times.items()})
    return {n: _max_over_ranks(v) for n, v in times.items()}


def _max_over_ranks(values: list[float]) -> list[float]:
    if tdist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.tolist()


def stats_ms(seconds: list[float], prefix: str = "") -> dict:
    ms = [s * 1e3 for s in seconds]
    out = {
        f"{prefix}median_ms": round(statistics.median(ms), 6),
        f"{prefix}min_ms": round(min(ms), 6),
        f"{prefix}max_ms": round(max(ms), 6),
    }
    if not prefix:
        out["reps"] = len(ms)
    return out


def emit(record: dict) -> None:
    if rank() == 0:
        print(json.dumps(record), flush=True)


def _git(*args) -> str:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "?"


def autopar_version() -> dict:
    """Which autopar was measured.  run_all.sh measures a snapshot of HEAD (the library is
    edited in parallel) and marks it with SNAPSHOT_COMMIT; otherwise the working tree's
    commit and its uncommitted changes under autopar/ are recorded."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(autopar.__file__)))
    marker = os.path.join(root, "SNAPSHOT_COMMIT")
    if os.path.exists(marker):
        with open(marker) as f:
            return {"autopar_commit": f.read().strip(), "autopar_from": root, "autopar_uncommitted": []}
    return {
        "autopar_commit": _git("rev-parse", "--short", "HEAD"),
        "autopar_from": root,
        "autopar_uncommitted": _git("status", "--porcelain", "--", "autopar").splitlines(),
    }


def env_info() -> dict:
    """Where and on what these numbers were taken."""
    return {
        **autopar_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


# -- DTensor communication accounting -------------------------------------------------------
# CommDebugMode counts DTensor's collectives but not their sizes; this mode records both and
# prices each collective with the same bandwidth-optimal formula autopar's comm_log uses, so
# the two byte counts are comparable.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class CausalLMLoss(torch.nn.Module):
    """A HuggingFace causal LM's loss on `ids` (labels = ids, HF shifts them) as the module's
    output: the form `dist.to_static(model, None, lambda loss: loss, opt)` captures."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def _group_size(name) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (autopar or DTensor pieces, plain tensors, None)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        elif autopar.is_dist_tensor(t):
            t = t._local
        total += _nbytes(t)
    return total


class TorchCommCounter(TorchDispatchMode):
    """Collectives DTensor issues below it: [(op name, bytes sent by this rank, group size)]."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in ("_c10d_functional", "c10d_functional", "_dtensor") and name != "wait_tensor" \
                and not name.startswith("_"):
            self.records.append(self._price(name, args))
        elif ns == "c10d" and not name.startswith("_") and name not in ("barrier", "monitored_barrier"):
            self.records.append((name, -1, -1))  # legacy path: counted, size unknown
        return func(*args, **kwargs)

    @staticmethod
    def _price(name: str, args) -> tuple[str, int, int]:
        x = args[0]
        if name == "all_gather_into_tensor":
            k = int(args[1])
            return name, _nbytes(x) * (k - 1), k
        if name == "all_reduce":
            k = _group_size(args[2])
            return name, 2 * (k - 1) * _nbytes(x) // k, k
        if name == "reduce_scatter_tensor":
            k = int(args[2])
            return name, (k - 1) * _nbytes(x) // k, k
        if name == "all_to_all_single":
            k = _group_size(args[3])
            return name, (k - 1) * _nbytes(x) // k, k
        if name == "broadcast":
            k = _group_size(args[2])
            return name, _nbytes(x) * (k - 1), k
        if name == "shard_dim_alltoall":
            return name, -1, -1
        return name, -1, -1

    def total_bytes(self) -> int:
        return sum(b for _, b, _ in self.records if b > 0)

    def ops(self) -> list[str]:
        return [n for n, _, _ in self.records]


def rule_warnings() -> list[str]:
    """Ops autopar warned "no sharding rule for ..." about in this process (its once-per-op set)."""
    from autopar.spmd import engine

    return sorted(engine._WARNED)


def fail_loudly(fn: Callable[[], None]) -> None:
    """Run main; on a failed check print it and exit non-zero (the launcher stops the job)."""
    try:
        fn()
    except BenchFailure as e:
        print(f"BENCH FAILURE: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    # Leave together and tear down every group, then exit without running interpreter
    # teardown: with autopar's own gloo sub-groups still alive, a rank whose peers already
    # exited can abort in gloo's threads ("terminate called without an active exception").
    if tdist.is_initialized():
        tdist.barrier()
        from autopar.comm import backend

        default = tdist.distributed_c10d._get_default_group()
        for pg in list(getattr(backend, "_GROUPS", {}).values()):
            if pg is not default and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except Exception:
                    pass
        tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
