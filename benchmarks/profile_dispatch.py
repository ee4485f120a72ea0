"""Profile autopar's per-op dispatch path (1 rank): cProfile, sorted by tottime.

    python benchmarks/profile_dispatch.py [--op add|mm|both] [--n 20000] [--top 25]
    py-spy record -r 2000 -o /tmp/dispatch.svg -- python benchmarks/profile_dispatch.py --no-cprofile

Prints, per op, the functions with the most self time and each one's share of the
profiled loop's total, plus the loop's us/op with and without the profiler.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402

import autopar as dist  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["add", "mm", "both"], default="both")
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--placement", choices=["R", "S0"], default="R")
    p.add_argument("--no-cprofile", action="store_true", help="just run the loops (for py-spy)")
    args = p.parse_args()
    C.setup()
    world = C.world()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    pl = [dist.Replicate()] if args.placement == "R" else [dist.Shard(0)]
    A = dist.shard_tensor(a, mesh, pl)
    B = dist.shard_tensor(b, mesh, [dist.Replicate()] if args.placement == "S0" else pl)
    ops = {"add": torch.add, "mm": torch.mm}
    names = list(ops) if args.op == "both" else [args.op]
    for name in names:
        op = ops[name]
        for _ in range(200):
            op(A, B)  # warm: decision cached

        def loop():
            for _ in range(args.n):
                op(A, B)

        t0 = time.perf_counter()
        loop()
        plain_us = (time.perf_counter() - t0) / args.n * 1e6
        if args.no_cprofile:
            C.emit({"bench": f"profile_{name}", "us_per_op_unprofiled": round(plain_us, 3)})
            continue
        prof = cProfile.Profile()
        prof.enable()
        loop()
        prof.disable()
        st = pstats.Stats(prof)
        total = st.total_tt
        rows = []
        for (fname, line, func), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((tt, ct, nc, f"{os.path.relpath(fname) if fname.startswith('/') else fname}:{line}({func})"))
        rows.sort(reverse=True)
        if C.rank() == 0:
            print(f"\n=== autopar {name} 64x64 {args.placement}, {args.n} calls: {plain_us:.2f} us/op unprofiled, "
                  f"{total / args.n * 1e6:.2f} us/op under cProfile ===")
            print(f"{'tottime%':>8} {'cum%':>7} {'calls/op':>8}  function")
            for tt, ct, nc, where in rows[: args.top]:
                print(f"{100 * tt / total:7.1f}% {100 * ct / total:6.1f}% {nc / args.n:8.2f}  {where}")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
            print(s.getvalue().split("\n", 6)[-1][:4000])


if __name__ == "__main__":
    C.fail_loudly(main)
