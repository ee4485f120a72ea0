"""Reshard cost: autopar vs torch DTensor vs the raw collective, 2048x2048 fp32 on 4 ranks.

    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_reshard.py

Same-mesh transitions on a 1-D mesh of all ranks:  S(0)->R, S(0)->S(1), P->R, P->S(0), R->S(0).
  autopar: `autopar.reshard(x, mesh, [dst])`; bytes from `autopar.comm_log()`.
  dtensor: `x.redistribute(mesh, [dst])`; bytes from a dispatch mode that records the
           collectives DTensor issues and prices them with the same bandwidth-optimal
           formulas comm_log uses (all-gather: piece x (k-1); all-reduce: 2(k-1)/k;
           reduce-scatter and all-to-all: (k-1)/k of the input); collective counts are
           cross-checked with torch's CommDebugMode.
  plain:   the one raw torch.distributed collective the transition needs, on pre-packed
           input buffers, into a freshly allocated output (all_gather_single /
           all_to_all_single / all_reduce on a fresh copy / reduce_scatter_single / a local
           narrow+clone): the floor for this machine.
  min:     the least bytes a rank must send for the transition (bandwidth-optimal).
Cross-mesh (autopar only; DTensor cannot reshard between meshes): first half of the ranks ->
second half, S(0)->S(0), S(0)->S(1), R->R; plain = the same point-to-point transfers with
batch_isend_irecv.  Timings: per call, max over ranks, median/min/max over repetitions.
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
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.distributed.tensor import Partial as DP, Replicate as DR, Shard as DS  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import autopar as dist  # noqa: E402

MiB = 1 << 20


def ap_pl(name):
    return {"R": dist.Replicate(), "S0": dist.Shard(0), "S1": dist.Shard(1), "P": dist.Partial()}[name]


def dt_pl(name):
    return {"R": DR(), "S0": DS(0), "S1": DS(1), "P": DP()}[name]


def piece(full: torch.Tensor, name: str, idx: int, k: int) -> torch.Tensor:
    if name == "R":
        return full
    dim = 0 if name == "S0" else 1
    return full.chunk(k, dim=dim)[idx]


def min_bytes(src: str, dst: str, nbytes: int, k: int) -> int:
    """Least bytes one rank must send (bandwidth-optimal) for the same-mesh transition."""
    if src == "S0" and dst == "R":
        return nbytes * (k - 1) // k
    if src == "S0" and dst == "S1":
        return nbytes // k * (k - 1) // k
    if src == "P" and dst == "R":
        return 2 * nbytes * (k - 1) // k
    if src == "P" and dst.startswith("S"):
        return nbytes * (k - 1) // k
    return 0


def gather_ints(x: int) -> list[int]:
    t = torch.zeros(C.world(), dtype=torch.int64)
    t[C.rank()] = x
    tdist.all_reduce(t)
    return t.tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("once")
    if k < 2:
        raise SystemExit("bench_reshard needs >= 2 ranks: python -m autopar.launch --nproc_per_node 4 ...")
    n = args.n
    nbytes = n * n * 4
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["x"])
    dmesh = init_device_mesh("cpu", (k,))
    gen = torch.Generator().manual_seed(1234)
    full = torch.randn(n, n, generator=gen)
    terms = [torch.randn(n, n, generator=gen) for _ in range(k)]  # Partial: rank r holds terms[r]
    psum = torch.stack(terms).sum(0)
    C.emit({"bench": "env", **C.env_info(), "ranks": k, "shape": [n, n], "dtype": "float32"})

    cases = [("S0", "R"), ("S0", "S1"), ("P", "R"), ("P", "S0"), ("R", "S0")]
    for src, dst in cases:
        want_full = psum if src == "P" else full
        want_local = piece(want_full, dst, rank, k).contiguous()
        if src == "P":
            X = dist.dtensor_from_local(terms[rank].clone(), mesh, [dist.Partial()], shape=[n, n])
            DX = DTensor.from_local(terms[rank].clone(), dmesh, [DP()], run_check=False)
        else:
            X = dist.shard_tensor(full, mesh, [ap_pl(src)])
            DX = distribute_tensor(full, dmesh, [dt_pl(src)])
        C.check(torch.equal(X.local_value(), DX.to_local()), f"{src}->{dst}: source pieces differ")

        # raw collective baseline on pre-packed buffers
        src_local = X.local_value().contiguous()
        # (each call allocates its output, as any out-of-place reshard must)
        if (src, dst) == ("S0", "R"):
            plain = lambda: tdist.all_gather_single(torch.empty(n, n), src_local)  # noqa: E731
        elif (src, dst) == ("S0", "S1"):
            packed = torch.cat([c.reshape(-1) for c in src_local.chunk(k, dim=1)])
            plain = lambda: tdist.all_to_all_single(torch.empty_like(packed), packed)  # noqa: E731
        elif (src, dst) == ("P", "R"):
            def plain():
                buf = src_local.clone()
                tdist.all_reduce(buf)
                return buf
        elif (src, dst) == ("P", "S0"):
            plain = lambda: tdist.reduce_scatter_single(torch.empty(n // k, n), src_local)  # noqa: E731
        else:
            plain = lambda: src_local.narrow(0, rank * (n // k), n // k).clone()  # noqa: E731

        # correctness + bytes (untimed)
        with dist.comm_log() as log:
            Y = dist.reshard(X, mesh, [ap_pl(dst)])
        C.assert_close(Y.local_value(), want_local, f"autopar {src}->{dst}", rtol=1e-5, atol=1e-4)
        counter, cdm = C.TorchCommCounter(), CommDebugMode()
        with cdm, counter:
            DY = DX.redistribute(dmesh, [dt_pl(dst)])
        dy_local = DY.to_local()
        C.assert_close(dy_local, want_local, f"dtensor {src}->{dst}", rtol=1e-5, atol=1e-4)
        C.check(len(counter.records) == cdm.get_total_counts(),
                f"{src}->{dst}: byte counter saw {counter.records}, CommDebugMode {dict(cdm.get_comm_counts())}")
        C.check(all(b >= 0 for _, b, _ in counter.records), f"{src}->{dst}: unpriced DTensor collective {counter.records}")
        ap_bytes, dt_bytes = gather_ints(log.total_bytes()), gather_ints(counter.total_bytes())
        minb = min_bytes(src, dst, nbytes, k)

        fns = {
            "autopar": lambda: dist.reshard(X, mesh, [ap_pl(dst)]),
            "dtensor": lambda: DX.redistribute(dmesh, [dt_pl(dst)]),
            "plain": plain,
        }
        times = C.interleaved(fns, reps=args.reps, warmup=args.warmup)
        st = {k_: C.stats_ms(v) for k_, v in times.items()}
        bench = f"reshard_{src}->{dst}"
        common = {"ranks": k, "shape": [n, n], "min_bytes_per_rank": minb}
        C.emit({"bench": bench, "impl": "autopar", **common, **st["autopar"],
                "bytes_sent_per_rank": max(ap_bytes), "bytes_sent_each_rank": ap_bytes,
                "collectives": log.ops(),
                "ratio_vs_dtensor": round(st["autopar"]["median_ms"] / st["dtensor"]["median_ms"], 3),
                "ratio_vs_plain": round(st["autopar"]["median_ms"] / st["plain"]["median_ms"], 3)})
        C.emit({"bench": bench, "impl": "dtensor", **common, **st["dtensor"],
                "bytes_sent_per_rank": max(dt_bytes), "bytes_sent_each_rank": dt_bytes,
                "collectives": counter.ops(),
                "ratio_vs_plain": round(st["dtensor"]["median_ms"] / st["plain"]["median_ms"], 3)})
        C.emit({"bench": bench, "impl": "plain", "variant": "raw_collective", **common, **st["plain"],
                "bytes_sent_per_rank": minb})
        del X, DX, Y, DY

    small_overhead(args, k, rank, mesh, dmesh)
    if k >= 4 and k % 2 == 0:
        cross_mesh(full, args, k, rank)
    C.emit({"bench": "rules_missing", "ranks": k, "ops": C.rule_warnings()})


def small_overhead(args, k, rank, mesh, dmesh, n=64, inner=20):
    """Fixed per-call cost: reshard a 64x64 tensor (R->S(0) is local, S(0)->R one small all-gather)."""
    small = torch.randn(n, n, generator=torch.Generator().manual_seed(7))
    for src, dst in (("R", "S0"), ("S0", "R")):
        X = dist.shard_tensor(small, mesh, [ap_pl(src)])
        DX = distribute_tensor(small, dmesh, [dt_pl(src)])
        want = piece(small, dst, rank, k).contiguous()
        C.assert_close(dist.reshard(X, mesh, [ap_pl(dst)]).local_value(), want, f"small autopar {src}->{dst}")
        C.assert_close(DX.redistribute(dmesh, [dt_pl(dst)]).to_local(), want, f"small dtensor {src}->{dst}")
        src_local = X.local_value().contiguous()
        if src == "R":
            plain = lambda: src_local.narrow(0, rank * (n // k), n // k).clone()  # noqa: E731
        else:
            plain = lambda: tdist.all_gather_single(torch.empty(n, n), src_local)  # noqa: E731
        fns = {
            "autopar": lambda: dist.reshard(X, mesh, [ap_pl(dst)]),
            "dtensor": lambda: DX.redistribute(dmesh, [dt_pl(dst)]),
            "plain": plain,
        }
        times = C.interleaved(fns, reps=max(args.reps, 30), warmup=args.warmup, inner=inner)
        st = {k_: C.stats_ms(v) for k_, v in times.items()}
        bench = f"reshard_small_{n}x{n}_{src}->{dst}"
        for impl in fns:
            rec = {"bench": bench, "impl": impl, "ranks": k, "shape": [n, n], **st[impl],
                   "us_per_call": round(st[impl]["median_ms"] * 1e3, 2), "inner": inner}
            if impl == "autopar":
                rec["ratio_vs_dtensor"] = round(st["autopar"]["median_ms"] / st["dtensor"]["median_ms"], 3)
            if impl != "plain":
                rec["overhead_us_vs_plain"] = round((st[impl]["median_ms"] - st["plain"]["median_ms"]) * 1e3, 2)
            C.emit(rec)


def cross_mesh(full, args, k, rank):
    n = full.shape[0]
    h = k // 2
    m_src = dist.ProcessMesh(list(range(h)), dim_names=["x"])
    m_dst = dist.ProcessMesh(list(range(h, k)), dim_names=["x"])
    for src, dst in (("S0", "S0"), ("S0", "S1"), ("R", "R")):
        X = dist.shard_tensor(full, m_src, [ap_pl(src)])
        want_local = piece(full, dst, rank - h, h).contiguous() if rank >= h else None

        # plain: the same point-to-point transfers with batch_isend_irecv (fresh receive buffers)
        if rank < h:
            loc = X.local_value()
            if dst == "S1" and src == "S0":
                sends = [(loc.chunk(h, dim=1)[j].contiguous(), h + j) for j in range(h)]
            else:
                sends = [(loc.contiguous(), h + rank)]
            recv_shapes = []
        else:
            j = rank - h
            if dst == "S1" and src == "S0":
                recv_shapes = [((n // h, n // h), i) for i in range(h)]
            elif src == "S0":
                recv_shapes = [((n // h, n), j)]
            else:
                recv_shapes = [((n, n), j)]
            sends = []

        def plain():
            recvs = [(torch.empty(shape), p) for shape, p in recv_shapes]
            ops = [tdist.P2POp(tdist.isend, t, p) for t, p in sends]
            ops += [tdist.P2POp(tdist.irecv, t, p) for t, p in recvs]
            for w in tdist.batch_isend_irecv(ops):
                w.wait()
            return recvs

        recvs = plain()
        if rank >= h:
            got = torch.cat([b for b, _ in recvs], dim=0)  # source pieces are row blocks
            C.assert_close(got, want_local, f"plain cross-mesh {src}->{dst}", rtol=0, atol=0)
        with dist.comm_log() as log:
            Y = dist.reshard(X, m_dst, [ap_pl(dst)])
        if rank >= h:
            C.assert_close(Y.local_value(), want_local, f"autopar cross-mesh {src}->{dst}", rtol=0, atol=0)
        else:
            C.check(Y.local_value().numel() == 0, f"cross-mesh {src}->{dst}: off-mesh rank holds data")
        ap_bytes = gather_ints(log.total_bytes())
        plain_bytes = gather_ints(sum(t.numel() * 4 for t, _ in sends))
        fns = {"autopar": lambda: dist.reshard(X, m_dst, [ap_pl(dst)]), "plain": plain}
        times = C.interleaved(fns, reps=args.reps, warmup=args.warmup)
        st = {k_: C.stats_ms(v) for k_, v in times.items()}
        bench = f"reshard_cross_mesh_{src}{list(range(h))}->{dst}{list(range(h, k))}"
        common = {"ranks": k, "shape": [n, n], "min_bytes_per_rank": max(plain_bytes)}
        C.emit({"bench": bench, "impl": "autopar", **common, **st["autopar"],
                "bytes_sent_per_rank": max(ap_bytes), "bytes_sent_each_rank": ap_bytes,
                "collectives": sorted(set(log.ops())),
                "ratio_vs_plain": round(st["autopar"]["median_ms"] / st["plain"]["median_ms"], 3)})
        C.emit({"bench": bench, "impl": "dtensor", "ranks": k, "supported": False,
                "note": "DTensor.redistribute cannot change the DeviceMesh"})
        C.emit({"bench": bench, "impl": "plain", "variant": "batch_isend_irecv", **common, **st["plain"],
                "bytes_sent_per_rank": max(plain_bytes), "bytes_sent_each_rank": plain_bytes})


if __name__ == "__main__":
    C.fail_loudly(main)
