"""The optimizer step alone: AdamW over train_gpt's GPT parameters, tensor parallel on 2 ranks.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_optim.py

Impls, interleaved: `autopar` (Megatron plan on a 1-D mp mesh, `shard_optimizer`),
`dtensor` (parallelize_module: q, k, v, fc1 Colwise; proj, fc2 Rowwise; the rest
replicated DTensors: DTensor's foreach step refuses plain and distributed params mixed), `plain` (the whole model on one rank: what each rank would
step without tensor parallelism) and `plain_local` (AdamW over plain tensors of autopar's
local shapes: the floor for the same work).  Gradients are set once (random, placed like
their parameters); each repetition is one `opt.step()`, timed as the slowest rank.
Checks: autopar's updated parameters equal the plain step's (rtol 1e-5), no communication.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate as DReplicate, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import autopar as dist  # noqa: E402
import train_gpt as G  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    rank, k = C.setup()
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    cfg = argparse.Namespace(vocab=512, dim=args.dim, heads=4, layers=args.layers, seq=64, lr=1e-3, seed=0)

    mesh = dist.ProcessMesh([list(range(k))], dim_names=["dp", "mp"])
    model, _ = G.build(cfg, mesh)
    # foreach=True in every impl: the same AdamW implementation (torch's CPU default would be its for-loop)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True))
    torch.manual_seed(1)
    grads = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = dist.shard_tensor(grads[n], mesh, p.placements)

    torch.manual_seed(cfg.seed)
    ref = G.GPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, foreach=True)
    for n, p in ref.named_parameters():
        p.grad = grads[n].clone()

    locals_ = [p.local_value().detach().clone() for p in model.parameters()]
    for t, p in zip(locals_, model.parameters()):
        t.grad = p.grad.local_value().detach().clone()
    local_opt = torch.optim.AdamW(locals_, lr=cfg.lr, foreach=True)

    dmesh = init_device_mesh("cpu", (k,))
    torch.manual_seed(cfg.seed)
    dmodel = G.GPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq)
    for blk in dmodel.blocks:
        parallelize_module(blk, dmesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                        "fc1": ColwiseParallel(), "proj": RowwiseParallel(), "fc2": RowwiseParallel()})
    for mod in dmodel.modules():  # DTensor's foreach step refuses plain and DTensor params mixed
        for n, p in list(mod.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                setattr(mod, n, torch.nn.Parameter(distribute_tensor(p.detach(), dmesh, [DReplicate()])))
    for n, p in dmodel.named_parameters():
        p.grad = distribute_tensor(grads[n], dmesh, p.placements)
    dopt = torch.optim.AdamW(dmodel.parameters(), lr=cfg.lr, foreach=True)

    with dist.comm_log() as log:
        opt.step()
    ref_opt.step()
    C.check(len(log) == 0, f"autopar's step communicated: {list(log)}")
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        C.assert_close(dist.unshard_dtensor(p.detach()), r.detach(), f"{n} after one step")

    fns = {"autopar": opt.step, "dtensor": dopt.step, "plain": ref_opt.step, "plain_local": local_opt.step}
    cpu: dict = {}
    times = C.interleaved(fns, reps=args.reps, warmup=args.warmup, cpu=cpu)
    st = {n: C.stats_ms(v) for n, v in times.items()}
    n_params = sum(1 for _ in model.parameters())
    for impl in fns:
        rec = {"bench": f"adamw_step_dim{args.dim}_layers{args.layers}", "impl": impl, "ranks": 1 if impl == "plain" else k, "world": k,
               "tensors": n_params, **st[impl]}
        if impl != "plain":
            rec["ratio_vs_plain"] = round(st[impl]["median_ms"] / st["plain"]["median_ms"], 3)
            rec["ratio_vs_plain_local"] = round(st[impl]["median_ms"] / st["plain_local"]["median_ms"], 3)
        if impl == "autopar":
            rec["ratio_vs_dtensor"] = round(st["autopar"]["median_ms"] / st["dtensor"]["median_ms"], 3)
        C.emit(rec)


if __name__ == "__main__":
    C.fail_loudly(main)
