"""ZeRO on the seed MLP: autopar ShardingStage1/2/3 vs torch FSDP2 (fully_shard) vs one process.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_zero.py
    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_zero.py

Model: two bias-free nn.Linear (1024->4096, 4096->1024), x 4x128x1024 split by batch over the
ranks, loss = z.mean(), AdamW(lr=1e-3); one step = forward, backward, optimizer step,
zero_grad, loss.item().
  autopar_z3 : shard_layer(model, mesh) (replicated), shard_optimizer(opt, ShardingStage3("dp")),
               x = shard_tensor(x, mesh, [Shard(0)]).
  autopar_z1/z2 : the same with ShardingStage1/2 (with --stages 1,2,3).
  fsdp2      : fully_shard on each Linear and the root, 1-D DeviceMesh, each rank feeds its
               batch slice; the logged loss is the all-reduced mean of the local losses.
  plain      : the single-process step on rank 0 (other ranks wait in a barrier).
Checks: every impl's per-step losses agree with the single-process run (rtol 1e-5, atol 1e-5).
Bytes: per-rank local bytes of params + grads + optimizer states (exp_avg, exp_avg_sq) right
after an optimizer step, before zero_grad (plus grads right after backward, the stage-1 peak) (autopar: `t._local` of DistTensors; FSDP2:
`to_local()` of DTensors).
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
from torch.distributed.fsdp import fully_shard  # noqa: E402

import autopar as dist  # noqa: E402


def make_mlp(w0, w1):
    m = torch.nn.Sequential(torch.nn.Linear(w0.shape[0], w0.shape[1], bias=False),
                            torch.nn.Linear(w1.shape[0], w1.shape[1], bias=False))
    with torch.no_grad():
        m[0].weight.copy_(w0.t())
        m[1].weight.copy_(w1.t())
    return m


def opt_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def mem_breakdown(model, opt) -> dict:
    params = list(model.parameters())
    extra = [p for p in opt_params(opt) if all(p is not q for q in params)]  # ZeRO-1/2 shards
    grads = [p.grad for p in params] + [p.grad for p in extra]
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    pb, gb, sb = C.local_bytes(params), C.local_bytes(grads), C.local_bytes(states)
    return {"param_bytes": pb, "grad_bytes": gb, "state_bytes": sb, "total_bytes": pb + gb + sb}


class Runner:
    def __init__(self, name, model, opt, inputs, loss_fn=None):
        self.name, self.model, self.opt, self.inputs = name, model, opt, inputs
        self.loss_fn = loss_fn or (lambda loss: float(loss.item()))
        self.losses: list[float] = []
        self.mem = None

    def step(self, measure=False):
        x = self.inputs[len(self.losses) % len(self.inputs)]
        loss = self.model(x).mean()
        loss.backward()
        if measure:
            grads_bw = mem_breakdown(self.model, self.opt)["grad_bytes"]
        self.opt.step()
        if measure:
            self.mem = mem_breakdown(self.model, self.opt)
            self.mem["grad_bytes_after_backward"] = grads_bw
        self.opt.zero_grad()
        self.losses.append(self.loss_fn(loss))


def main():
    p = argparse.ArgumentParser()
    C.add_mlp_sizes(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--stages", default="3", help="autopar ZeRO stages to run, e.g. 1,2,3")
    p.add_argument("--no-plain", action="store_true")
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("default")
    C.check(args.batch % k == 0, f"batch {args.batch} not divisible by {k} ranks")
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    dmesh = init_device_mesh("cpu", (k,), mesh_dim_names=("dp",))
    gen = torch.Generator().manual_seed(2024)
    w0 = torch.randn(args.hidden, args.ffn, generator=gen) * args.hidden ** -0.5
    w1 = torch.randn(args.ffn, args.hidden, generator=gen) * args.ffn ** -0.5
    batches = [torch.rand(args.batch, args.seq, args.hidden, generator=gen) for _ in range(4)]
    C.emit({"bench": "env", **C.env_info(), "ranks": k})

    runners: dict[str, Runner] = {}
    for stage in sorted(int(s) for s in args.stages.split(",")):
        model = dist.shard_layer(make_mlp(w0, w1), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        shard_fn = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]("dp")
        opt = dist.shard_optimizer(opt, shard_fn)
        xs = [dist.shard_tensor(x, mesh, [dist.Shard(0)]) for x in batches]
        runners[f"autopar_z{stage}"] = Runner(f"autopar_z{stage}", model, opt, xs)

    fmodel = make_mlp(w0, w1)
    fully_shard(fmodel[0], mesh=dmesh)
    fully_shard(fmodel[1], mesh=dmesh)
    fully_shard(fmodel, mesh=dmesh)
    fopt = torch.optim.AdamW(fmodel.parameters(), lr=1e-3)
    per = args.batch // k

    def global_loss(loss):
        t = loss.detach().clone()
        tdist.all_reduce(t)
        return float(t.item()) / k

    runners["fsdp2"] = Runner("fsdp2", fmodel, fopt, [x[rank * per:(rank + 1) * per] for x in batches], global_loss)
    if not args.no_plain:
        pm = make_mlp(w0, w1)
        runners["plain"] = Runner("plain", pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), batches)
        if rank != 0:
            runners["plain"].step = lambda measure=False: None

    # first step: untimed, with the memory measurement
    for name, r in runners.items():
        C.barrier()
        if name == "plain" and rank != 0:
            continue
        r.step(measure=True)
    C.barrier()

    fns = {name: r.step for name, r in runners.items()}
    times = C.interleaved(fns, reps=args.reps, warmup=args.warmup, only_rank0=frozenset({"plain"}))

    # correctness: losses per step against the single-process run (rank 0 holds it)
    names = [n for n in runners if n != "plain"]
    ref = runners.get("plain")
    max_rel = 0.0
    if rank == 0 and ref is not None:
        for n in names:
            got = runners[n].losses
            C.assert_close(torch.tensor(got), torch.tensor(ref.losses), f"{n} vs single-process losses")
            max_rel = max(max_rel, max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref.losses)))
    for n in names[1:]:
        C.assert_close(torch.tensor(runners[n].losses), torch.tensor(runners[names[0]].losses),
                       f"{n} vs {names[0]} losses")

    st = {n: C.stats_ms(v) for n, v in times.items()}
    mem = {}
    for n in names:
        m = runners[n].mem
        keys = ("param_bytes", "grad_bytes", "state_bytes", "total_bytes", "grad_bytes_after_backward")
        t = torch.tensor([m[key] for key in keys], dtype=torch.int64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        mem[n] = dict(zip(keys, t.tolist()))
    full = (w0.numel() + w1.numel()) * 4
    for n in runners:
        rec = {"bench": "zero_mlp_step", "impl": n, "ranks": 1 if n == "plain" else k, "world": k, **st[n],
               "steps_checked": len(runners[names[0]].losses), "max_rel_loss_diff_vs_plain": max_rel}
        if n in mem:
            rec.update({f"{key}_per_rank_max": v for key, v in mem[n].items()})
        else:
            rec.update(param_bytes_per_rank_max=full, grad_bytes_per_rank_max=full,
                       state_bytes_per_rank_max=2 * full, total_bytes_per_rank_max=4 * full)
        if n.startswith("autopar"):
            rec["ratio_time_vs_fsdp2"] = round(st[n]["median_ms"] / st["fsdp2"]["median_ms"], 3)
            rec["ratio_bytes_vs_fsdp2"] = round(mem[n]["total_bytes"] / mem["fsdp2"]["total_bytes"], 3)
        if "plain" in st and n != "plain":
            rec["ratio_time_vs_plain"] = round(st[n]["median_ms"] / st["plain"]["median_ms"], 3)
        C.emit(rec)
    C.emit({"bench": "rules_missing", "ranks": k, "ops": C.rule_warnings()})


if __name__ == "__main__":
    C.fail_loudly(main)
