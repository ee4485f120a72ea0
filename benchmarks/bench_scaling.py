"""autopar TP MLP scaling: step time and per-rank bytes vs ranks and width.

    python -m autopar.launch --nproc_per_node 1 benchmarks/bench_scaling.py
    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_scaling.py
    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_scaling.py

The tensor-parallel MLP of bench_tp_mlp.py (z = (x @ w0) @ w1, w0 Shard(1), w1 Shard(0) over all
ranks, loss = z.mean(), AdamW lr 1e-3), at each width in --widths (hidden h, ffn 4h; the
default 512 = half the guide's, 1024 = the guide's), x 4x128xh.  The world size is the launch's
(one launch per rank count).  Each width: autopar and the single-process step on rank 0
(`plain`, the other ranks wait), interleaved; losses checked against plain (rtol 1e-5,
atol 1e-5).  Reports step time (max over ranks) and per-rank parameter + AdamW state bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import autopar as dist  # noqa: E402
from bench_tp_mlp import Runner, SeedMlp, nbytes_local, opt_state_bytes  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="512,1024")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("default")
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["x"])
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    for h in (int(w) for w in args.widths.split(",")):
        ffn = 4 * h
        gen = torch.Generator().manual_seed(2024)
        w0 = torch.randn(h, ffn, generator=gen) * h ** -0.5
        w1 = torch.randn(ffn, h, generator=gen) * ffn ** -0.5
        batches = [torch.rand(args.batch, args.seq, h, generator=gen) for _ in range(4)]
        ap = Runner("autopar", SeedMlp(w0, w1, mesh), batches)
        plain = Runner("plain", SeedMlp(w0, w1, None), batches)
        if rank != 0:
            plain.step = lambda: None
        times = C.interleaved({"autopar": ap.step, "plain": plain.step}, reps=args.reps, warmup=args.warmup,
                              only_rank0=frozenset({"plain"}))
        max_rel = None
        if rank == 0:
            C.assert_close(torch.tensor(ap.losses), torch.tensor(plain.losses), f"width {h}: autopar vs plain losses")
            max_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ap.losses, plain.losses))
        t = torch.tensor([nbytes_local(ap.model.parameters()), opt_state_bytes(ap.opt)], dtype=torch.int64)
        if k > 1:
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        full = (w0.numel() + w1.numel()) * 4
        sa, sp = C.stats_ms(times["autopar"]), C.stats_ms(times["plain"])
        C.emit({"bench": "scaling_tp_mlp", "impl": "autopar", "ranks": k, "hidden": h, "ffn": ffn, **sa,
                "plain_median_ms": sp["median_ms"], "plain_min_ms": sp["min_ms"], "plain_max_ms": sp["max_ms"],
                "ratio_vs_plain": round(sa["median_ms"] / sp["median_ms"], 3),
                "param_bytes_per_rank": int(t[0]), "optim_state_bytes_per_rank": int(t[1]),
                "param_plus_state_bytes_per_rank": int(t[0] + t[1]),
                "bytes_ratio_vs_plain": round(int(t[0] + t[1]) / (3 * full), 3),
                "steps_checked": len(ap.losses), "max_rel_loss_diff_vs_plain": max_rel})
    C.emit({"bench": "rules_missing", "ranks": k, "ops": C.rule_warnings()})


if __name__ == "__main__":
    C.fail_loudly(main)
