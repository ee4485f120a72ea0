"""Per-op overhead: 64x64 `add` and `mm` through autopar vs torch DTensor vs plain tensors.

    python -m autopar.launch --nproc_per_node 1 benchmarks/bench_dispatch.py
    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_dispatch.py

(`python benchmarks/bench_dispatch.py` is a world of one, like --nproc_per_node 1.)

Placements (mesh = all ranks, 1-D):
  R   : both operands Replicate                      -> local op on the full 64x64
  S0  : add: both Shard(0); mm: A Shard(0), B Replicate -> local op on a (64/k)x64 piece,
        output Shard(0), no communication in either library
Impls, interleaved per repetition: `plain` (the full 64x64 op on torch tensors),
`plain_local` (the same op on this rank's local pieces: what the distributed op computes),
`autopar`, `dtensor`, `autopar_module`: the same loop of ops as the forward of a module
given to `dist.shard_layer` (after its first call, a verified local region: the ops run on
the local pieces as plain torch ops; one call runs all `--inner` ops), and `autopar_static`:
the same loop as a `dist.to_static` program (captured once, then replayed in predict mode).
`dispatch_floor` is no library: a tensor subclass whose `__torch_dispatch__` only unwraps
its operands, runs the C++ op (by autopar's quickest route, `op_call.fast_op`) and wraps the
result (no spec, no cache, no rule).  It is the
least any `__torch_dispatch__` subclass (autopar's dynamic mode, DTensor) pays per op: the
C++ -> Python entry and one wrapper allocation.
Each repetition is `--inner` ops in a loop; us/op = time / inner.

Also checks: results equal the plain op; no communication; and the "second call does no
planning" claim: `autopar.tensor.dispatch.decide` is wrapped with a counter, it must run on the
first call of each (op, specs) and never inside the timed loops.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate as DR, Shard as DS, distribute_tensor  # noqa: E402

import autopar as dist  # noqa: E402
import autopar.tensor.dispatch as ap_dispatch  # noqa: E402
from autopar.tensor.op_call import fast_op  # noqa: E402

DECIDE_CALLS = [0]
_orig_decide = ap_dispatch.decide


def _counting_decide(*args, **kwargs):
    DECIDE_CALLS[0] += 1
    return _orig_decide(*args, **kwargs)


ap_dispatch.decide = _counting_decide  # dispatch() looks `decide` up in its module globals


class _Floor(torch.Tensor):
    """The cheapest possible `__torch_dispatch__` wrapper: unwrap, run the op by its quickest
    route (the Python binding that reaches it, as autopar does: `op_call.fast_op`), wrap."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _calls: dict = {}

    @staticmethod
    def __new__(cls, local):
        r = torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype, device=local.device)
        r._local = local
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        local = [a._local if type(a) is _Floor else a for a in args]
        call = cls._calls.get(func)
        if call is None:
            call = cls._calls[func] = fast_op(func, local, {})
        return _Floor(call(*local))


class _Loop(torch.nn.Module):
    """`inner` applications of `op` (what the static impl captures and replays)."""

    def __init__(self, op, inner):
        super().__init__()
        self.op, self.inner = op, inner

    def forward(self, a, b):
        out = None
        for _ in range(self.inner):
            out = self.op(a, b)
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    rank, world = C.setup()
    warnings.simplefilter("default")
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    dmesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a = torch.randn(args.n, args.n)
    b = torch.randn(args.n, args.n)
    C.emit({"bench": "env", **C.env_info(), "ranks": world})

    ops = {"add": torch.add, "mm": torch.mm}
    for op_name, op in ops.items():
        for pl_name in ("R", "S0"):
            if pl_name == "R":
                ap_pl, dt_pl = ([dist.Replicate()], [dist.Replicate()]), ([DR()], [DR()])
            elif op_name == "add":
                ap_pl, dt_pl = ([dist.Shard(0)], [dist.Shard(0)]), ([DS(0)], [DS(0)])
            else:
                ap_pl, dt_pl = ([dist.Shard(0)], [dist.Replicate()]), ([DS(0)], [DR()])
            A = dist.shard_tensor(a, mesh, ap_pl[0])
            B = dist.shard_tensor(b, mesh, ap_pl[1])
            DA = distribute_tensor(a, dmesh, dt_pl[0])
            DB = distribute_tensor(b, dmesh, dt_pl[1])
            la, lb = A.local_value(), B.local_value()
            FA, FB = _Floor(la), _Floor(lb)
            C.check(torch.equal(la, DA.to_local()) and torch.equal(lb, DB.to_local()),
                    f"{op_name}/{pl_name}: autopar and DTensor local pieces differ")

            # --- correctness, communication and planning (untimed) ---------------------
            want = op(a, b)
            before = DECIDE_CALLS[0]
            with dist.comm_log() as log:
                out = op(A, B)
                first_calls = DECIDE_CALLS[0] - before
                out2 = op(A, B)
                second_calls = DECIDE_CALLS[0] - before - first_calls
            C.check(first_calls >= 1, f"{op_name}/{pl_name}: first call did not plan (decide calls {first_calls})")
            C.check(second_calls == 0, f"{op_name}/{pl_name}: second call planned again ({second_calls} decide calls)")
            C.check(len(log) == 0, f"{op_name}/{pl_name}: autopar communicated: {list(log)}")
            ap_out_pl = [str(x) for x in out.placements]
            C.assert_close(out2.local_value(), op(la, lb), f"{op_name}/{pl_name} autopar local piece")
            C.assert_close(out.full_value(), want, f"{op_name}/{pl_name} autopar result")
            counter = C.TorchCommCounter()
            with counter:
                dout = op(DA, DB)
            C.check(not counter.records, f"{op_name}/{pl_name}: DTensor communicated: {counter.records}")
            dt_out_pl = [str(x) for x in dout.placements]
            C.assert_close(dout.full_tensor(), want, f"{op_name}/{pl_name} DTensor result")
            C.assert_close(op(FA, FB)._local, op(la, lb), f"{op_name}/{pl_name} dispatch floor result")

            static = dist.to_static(_Loop(op, args.inner)).predict()
            C.assert_close(static(A, B).full_value(), want, f"{op_name}/{pl_name} autopar static result")
            module = dist.shard_layer(_Loop(op, args.inner), mesh)
            C.assert_close(module(A, B).full_value(), want, f"{op_name}/{pl_name} autopar module result")
            C.check(list(module.forward.regions.values()) != [None],
                    f"{op_name}/{pl_name}: the module did not become a local region")
            fns = {
                "plain": lambda: op(a, b),
                "plain_local": lambda: op(la, lb),
                "autopar": lambda: op(A, B),
                "dtensor": lambda: op(DA, DB),
                "autopar_module": lambda: module(A, B),
                "autopar_static": lambda: static(A, B),
                "dispatch_floor": lambda: op(FA, FB),
            }
            before = DECIDE_CALLS[0]
            cpu: dict = {}
            times = C.interleaved(fns, reps=args.reps, warmup=args.warmup, inner=args.inner, cpu=cpu,
                                  whole=frozenset({"autopar_module", "autopar_static"}))
            timed_decides = DECIDE_CALLS[0] - before
            C.check(timed_decides == 0, f"{op_name}/{pl_name}: {timed_decides} decide calls inside the timed loops")

            st = {k: {**C.stats_ms(v), **C.stats_ms(cpu[k], "cpu_")} for k, v in times.items()}
            us = {k: s["median_ms"] * 1e3 for k, s in st.items()}
            cus = {k: s["cpu_median_ms"] * 1e3 for k, s in st.items()}
            bench = f"dispatch_{op_name}_{args.n}x{args.n}_{pl_name}"
            for impl in ("plain", "plain_local", "autopar", "dtensor", "autopar_module", "autopar_static",
                         "dispatch_floor"):
                rec = {
                    "bench": bench,
                    "impl": "plain" if impl.startswith("plain") else impl,
                    "variant": impl,
                    "ranks": world,
                    **st[impl],
                    "us_per_op": round(us[impl], 3),
                    "cpu_us_per_op": round(cus[impl], 3),
                    "bytes_sent_per_rank": 0,
                    "inner": args.inner,
                }
                if impl in ("autopar", "dtensor", "autopar_module", "autopar_static", "dispatch_floor"):
                    rec["overhead_us_vs_plain"] = round(us[impl] - us["plain"], 3)
                    rec["overhead_us_vs_plain_local"] = round(us[impl] - us["plain_local"], 3)
                    rec["ratio_vs_plain"] = round(us[impl] / us["plain"], 3)
                    rec["cpu_overhead_us_vs_plain"] = round(cus[impl] - cus["plain"], 3)
                    rec["cpu_overhead_us_vs_plain_local"] = round(cus[impl] - cus["plain_local"], 3)
                    rec["cpu_ratio_vs_plain"] = round(cus[impl] / cus["plain"], 3)
                    rec["out_placements"] = dt_out_pl if impl == "dtensor" else ap_out_pl
                if impl in ("autopar", "autopar_module", "autopar_static", "dispatch_floor"):
                    rec["ratio_vs_dtensor"] = round(us[impl] / us["dtensor"], 3)
                    rec["cpu_ratio_vs_dtensor"] = round(cus[impl] / cus["dtensor"], 3)
                    rec["overhead_ratio_vs_dtensor"] = round((us[impl] - us["plain"]) / (us["dtensor"] - us["plain"]), 3)
                if impl == "autopar":
                    rec["decide_calls_first_call"] = first_calls
                    rec["decide_calls_second_call"] = second_calls
                    rec["decide_calls_timed_loops"] = timed_decides
                    rec["timed_calls"] = (args.reps + args.warmup) * args.inner
                C.emit(rec)
    C.emit({"bench": "rules_missing", "ranks": world, "ops": C.rule_warnings()})


if __name__ == "__main__":
    C.fail_loudly(main)
