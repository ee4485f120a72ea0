"""Context parallel attention: the ring and Ulysses against attention on gathered K/V.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_context_parallel.py
    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_context_parallel.py --seqs 8192,16384

One step = causal `F.scaled_dot_product_attention` on q, k, v of [batch, heads, seq, head dim]
(fp32) split over the mesh dim "sep", forward and backward of out.sum():
  gathered : the sequence split in order (Shard(2)), no context manager: autopar's sdpa rule
             keeps the query rows split and gathers K and V whole (the all-gather form of
             context parallel, unbalanced under the causal mask);
  ring     : `shard_sequence(..., backend="p2p")` (head-tail chunks) under
             `context_parallel(mesh, "p2p")`: K/V blocks passed round the ranks;
  ulysses  : `shard_sequence(..., backend="all2all")` under `context_parallel(mesh, "all2all")`:
             four all-to-alls (sequence split <-> head split).
Checks: the three outputs and the gradients of q, k and v agree (rtol 1e-4, put back in the
natural order).  Reports per impl the step time (max over ranks), the ratio to gathered, the
bytes this rank sends per step, and the bytes autograd saves for backward on this rank (the
activation memory attention holds).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar as dist  # noqa: E402
from autopar.runtime.context_parallel import load_balanced_order  # noqa: E402


class Attention:
    """One impl's inputs and its step (forward, backward of out.sum())."""

    def __init__(self, name, full, mesh):
        self.name, self.mesh = name, mesh
        backend = {"ring": "p2p", "ulysses": "all2all"}.get(name)
        self.backend = backend
        if backend is None:
            self.inputs = [dist.shard_tensor(t, mesh, [dist.Shard(2)]).requires_grad_() for t in full]
        else:
            self.inputs = [dist.shard_sequence(t, mesh, dim=2, backend=backend).requires_grad_() for t in full]
        self.out = None
        self.saved = 0

    def step(self):
        for t in self.inputs:
            t.grad = None
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if self.backend is None:
                out = F.scaled_dot_product_attention(*self.inputs, is_causal=True)
            else:
                with dist.context_parallel(self.mesh, backend=self.backend):
                    out = F.scaled_dot_product_attention(*self.inputs, is_causal=True)
        self.saved = _storage_bytes(saved)
        out.sum().backward()
        self.out = out

    def natural(self, t):
        """`t` (an output or gradient of this impl) whole, in the sequence's natural order."""
        whole = dist.unshard_dtensor(t)
        if self.backend != "p2p":
            return whole
        return whole[:, :, torch.argsort(load_balanced_order(whole.shape[2], self.mesh.size))]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`' local pieces."""
    seen = {}
    for t in tensors:
        local = t.local_value() if dist.is_dist_tensor(t) else t
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    rank, k = C.setup()
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["sep"])
    for seq in map(int, args.seqs.split(",")):
        gen = torch.Generator().manual_seed(seq)
        full = [torch.randn(args.batch, args.heads, seq, args.head_dim, generator=gen) for _ in range(3)]
        impls = {name: Attention(name, full, mesh) for name in ("gathered", "ring", "ulysses")}
        sent = {}
        for name, impl in impls.items():
            with dist.comm_log() as log:
                impl.step()
            sent[name] = log.total_bytes()
        want = impls["gathered"]
        for name in ("ring", "ulysses"):
            got = impls[name]
            C.assert_close(got.natural(got.out), want.natural(want.out), f"{name} output at {seq}", rtol=1e-4, atol=1e-5)
            for i, what in enumerate("qkv"):
                C.assert_close(got.natural(got.inputs[i].grad), want.natural(want.inputs[i].grad),
                               f"{name} gradient of {what} at {seq}", rtol=1e-4, atol=1e-5)
        times = C.interleaved({n: i.step for n, i in impls.items()}, reps=args.reps, warmup=args.warmup)
        st = {n: C.stats_ms(v) for n, v in times.items()}
        for name, impl in impls.items():
            C.emit({"bench": "context_parallel_attention", "impl": name, "ranks": k, "seq": seq,
                    "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch,
                    "bytes_sent_per_rank": sent[name], "saved_for_backward_bytes": impl.saved, **st[name],
                    "ratio_vs_gathered": round(st[name]["median_ms"] / st["gathered"]["median_ms"], 4)})


if __name__ == "__main__":
    C.fail_loudly(main)
