"""What removing redundant copies in the reshard executor would save (an experiment, NOT library code).

    python -m autopar.launch --nproc_per_node 4 benchmarks/proto_reshard.py

In this process only, swaps two step functions of `autopar.reshard.execute` for copy-lean
variants and times them against the shipped ones and the raw collective (2048x2048 fp32):
  S(0)->R  : shipped all_gather gathers into one buffer, chunks it and torch.cat's the chunks
             back (a second full-size allocation + copy); the variant returns the buffer.
  S(0)->S(1): shipped all_to_all packs with reshape (copy) + cat (copy) and unpacks with cat
             (copy); the variant packs with one cat of the column blocks and, when the
             gather dim is 0, uses the received buffer as the result (no unpack copy).
Both variants are checked against the shipped result.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import autopar as dist  # noqa: E402
from autopar import comm  # noqa: E402
from autopar.reshard import execute as ex  # noqa: E402

SHIPPED = dict(ex._RUN)


def all_gather_lean(local, step, ranks, me, pieces, *rest):
    sizes = [b - a for a, b in pieces]
    if step.src.dim == 0 and len(set(sizes)) == 1:
        parts = comm.all_gather(local, ranks)  # chunks of one contiguous buffer
        base = parts[0]
        full = base.as_strided((sum(p.shape[0] for p in parts),) + tuple(base.shape[1:]), base.stride(),
                               base.storage_offset())
        return full
    return SHIPPED["all_gather"](local, step, ranks, me, pieces, *rest)


def all_to_all_lean(local, step, ranks, me, pieces, *rest):
    i, j = step.src.dim, step.dst.dim
    src_pieces, dst_pieces = pieces
    even = len({b - a for a, b in dst_pieces}) == 1 and len({b - a for a, b in src_pieces}) == 1
    if not (i == 0 and j == 1 and local.dim() == 2 and even):
        return SHIPPED["all_to_all"](local, step, ranks, me, pieces, *rest)
    blocks = [local.narrow(1, a, b - a) for a, b in dst_pieces]
    packed = torch.cat(blocks, dim=0)  # one copy: block l (rows x cols_l) for member l, in order
    rows = local.shape[0]
    out = comm.all_to_all(packed, [rows] * len(ranks), [b - a for a, b in src_pieces], ranks)
    return out  # received row blocks stacked along dim 0 = my S(1) piece


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    rank, k = C.setup()
    n = args.n
    mesh = dist.ProcessMesh(list(range(k)))
    full = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    for src, dst, name, lean in (
        (dist.Shard(0), dist.Replicate(), "all_gather", all_gather_lean),
        (dist.Shard(0), dist.Shard(1), "all_to_all", all_to_all_lean),
    ):
        X = dist.shard_tensor(full, mesh, [src])
        want = dist.reshard(X, mesh, [dst]).local_value().clone()

        def shipped():
            return dist.reshard(X, mesh, [dst])

        def variant():
            ex._RUN[name] = lean
            try:
                return dist.reshard(X, mesh, [dst])
            finally:
                ex._RUN[name] = SHIPPED[name]

        C.assert_close(variant().local_value(), want, f"lean {name}", rtol=0, atol=0)
        loc = X.local_value().contiguous()
        if name == "all_gather":
            raw = lambda: tdist.all_gather_single(torch.empty(n, n), loc)  # noqa: E731
        else:
            packed = torch.cat([c.reshape(-1) for c in loc.chunk(k, dim=1)])
            raw = lambda: tdist.all_to_all_single(torch.empty_like(packed), packed)  # noqa: E731
        times = C.interleaved({"shipped": shipped, "copy_lean_proto": variant, "raw": raw}, reps=args.reps, warmup=3)
        st = {k_: C.stats_ms(v) for k_, v in times.items()}
        for impl, s in st.items():
            C.emit({"bench": f"proto_reshard_{src}->{dst}".replace("()", ""), "impl": impl, "ranks": k, **s,
                    "ratio_vs_shipped": round(s["median_ms"] / st["shipped"]["median_ms"], 3)})


if __name__ == "__main__":
    C.fail_loudly(main)
