"""The tensor-parallel MLP step of Paddle's auto-parallel guide (section 4.2): autopar vs DTensor vs one process.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_tp_mlp.py
    python -m autopar.launch --nproc_per_node 4 benchmarks/bench_tp_mlp.py

Model: z = (x @ w0) @ w1 with w0 1024x4096 split by columns (Shard(1)) and w1 4096x1024 by
rows (Shard(0)), x 4x128x1024, loss = z.mean(), AdamW(lr=1e-3); one step = forward,
backward, optimizer step, zero_grad, loss.item().  (`--relu` puts a ReLU between the
layers, with a ReLU between them.)
  autopar : the guide's program (§4.2): shard_tensor on the two Parameters, plain x.
  dtensor : nn.Module with two bias-free nn.Linear (weights = w0.T, w1.T, since Linear stores
            weight as out x in), parallelize_module with fc0 ColwiseParallel and fc1
            RowwiseParallel (defaults: Replicate input, Replicate output).
  plain   : the single-process step on rank 0 (variants `plain_1thread`, `plain_2threads`)
            while the other ranks wait in a barrier.
All impls start from the same weights and see the same batches; the step order rotates per
repetition.  Checks: per-step losses of autopar, DTensor and the 1-thread plain run agree
(rtol 1e-5, atol 1e-5) and so do the final weights (rtol 1e-4, atol 1e-4: Adam divides by
sqrt(v), which amplifies summation-order noise in small gradients).
Reports step time (max over ranks), per-rank parameter and optimizer-state bytes, and the
bytes each rank sends per step.
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
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import autopar as dist  # noqa: E402


class SeedMlp(torch.nn.Module):
    """The guide's §4.2: parameters as matrices, x @ w0 @ w1 (optionally a ReLU in between)."""

    def __init__(self, w0, w1, mesh=None, relu=False):
        super().__init__()
        p0, p1 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w1.clone())
        self.w0 = dist.shard_tensor(p0, mesh, [dist.Shard(1)]) if mesh is not None else p0
        self.w1 = dist.shard_tensor(p1, mesh, [dist.Shard(0)]) if mesh is not None else p1
        self.relu = relu

    def forward(self, x):
        y = torch.matmul(x, self.w0)
        if self.relu:
            y = torch.relu(y)
        return torch.matmul(y, self.w1)


class LinearMlp(torch.nn.Module):
    """The same model in nn.Linear form (weight stored transposed) for parallelize_module."""

    def __init__(self, w0, w1, relu=False):
        super().__init__()
        self.fc0 = torch.nn.Linear(w0.shape[0], w0.shape[1], bias=False)
        self.fc1 = torch.nn.Linear(w1.shape[0], w1.shape[1], bias=False)
        with torch.no_grad():
            self.fc0.weight.copy_(w0.t())
            self.fc1.weight.copy_(w1.t())
        self.relu = relu

    def forward(self, x):
        y = self.fc0(x)
        if self.relu:
            y = torch.relu(y)
        return self.fc1(y)


def local_of(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.to_local()
    if dist.is_dist_tensor(t):
        return t.local_value()
    return t


def nbytes_local(ts) -> int:
    return sum(local_of(t).numel() * local_of(t).element_size() for t in ts)


def opt_state_bytes(opt) -> int:
    return sum(nbytes_local([v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0])
               for st in opt.state.values())


def full_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, DTensor):
        return t.full_tensor()
    if dist.is_dist_tensor(t):
        return dist.unshard_dtensor(t)
    return t


class Runner:
    """One model + optimizer; `step()` runs the next batch and records the loss."""

    def __init__(self, name, model, batches, threads=1):
        self.name, self.model, self.batches, self.threads = name, model, batches, threads
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.losses: list[float] = []

    def step(self):
        if self.threads != 1:
            torch.set_num_threads(self.threads)
        try:
            x = self.batches[len(self.losses) % len(self.batches)]
            loss = self.model(x).mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.losses.append(float(loss.item()))
        finally:
            if self.threads != 1:
                torch.set_num_threads(1)


def main():
    p = argparse.ArgumentParser()
    C.add_mlp_sizes(p)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--relu", action="store_true")
    p.add_argument("--no-plain", action="store_true", help="skip the single-process baselines")
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("default")
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["x"])
    dmesh = init_device_mesh("cpu", (k,))
    gen = torch.Generator().manual_seed(2024)
    w0 = torch.randn(args.hidden, args.ffn, generator=gen) * args.hidden ** -0.5
    w1 = torch.randn(args.ffn, args.hidden, generator=gen) * args.ffn ** -0.5
    batches = [torch.rand(args.batch, args.seq, args.hidden, generator=gen) for _ in range(4)]
    C.emit({"bench": "env", **C.env_info(), "ranks": k})

    ap = Runner("autopar", SeedMlp(w0, w1, mesh, args.relu), batches)
    dmodel = parallelize_module(LinearMlp(w0, w1, args.relu), dmesh,
                                {"fc0": ColwiseParallel(), "fc1": RowwiseParallel()})
    dt = Runner("dtensor", dmodel, batches)
    runners = {"autopar": ap, "dtensor": dt}
    if not args.no_plain:
        runners["plain_1thread"] = Runner("plain_1thread", SeedMlp(w0, w1, None, args.relu), batches, threads=1)
        runners["plain_2threads"] = Runner("plain_2threads", SeedMlp(w0, w1, None, args.relu), batches, threads=2)
        if rank != 0:  # the single-process baselines run on rank 0 only
            runners["plain_1thread"].step = runners["plain_2threads"].step = lambda: None

    # first step of each distributed impl under communication accounting (untimed)
    with dist.comm_log() as log:
        ap.step()
    counter = C.TorchCommCounter()
    with counter:
        dt.step()
    if rank == 0:
        for name in ("plain_1thread", "plain_2threads"):
            if name in runners:
                runners[name].step()
    C.barrier()
    ap_bytes = max(int(x) for x in _gather(log.total_bytes()))
    dt_bytes = max(int(x) for x in _gather(counter.total_bytes()))
    C.check(all(b >= 0 for _, b, _ in counter.records), f"unpriced DTensor collective: {counter.records}")

    fns = {name: r.step for name, r in runners.items()}
    times = C.interleaved(fns, reps=args.reps, warmup=args.warmup, only_rank0=frozenset(
        n for n in fns if n.startswith("plain")))

    # correctness: losses per step and final weights against the single-process run
    ref = runners.get("plain_1thread")
    C.assert_close(torch.tensor(ap.losses), torch.tensor(dt.losses), "autopar vs DTensor losses per step")
    ap_w = [full_of(ap.model.w0), full_of(ap.model.w1)]
    dt_w = [full_of(dmodel.fc0.weight).t(), full_of(dmodel.fc1.weight).t()]
    for a, d, name in zip(ap_w, dt_w, ("w0", "w1")):
        C.assert_close(a, d, f"autopar vs DTensor final {name}", rtol=1e-4, atol=1e-4)
    max_loss_diff = max(abs(a - b) for a, b in zip(ap.losses, dt.losses))
    max_rel_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ap.losses, dt.losses))
    if rank == 0 and ref is not None:
        C.assert_close(torch.tensor(ap.losses), torch.tensor(ref.losses), "autopar vs single-process losses")
        C.assert_close(torch.tensor(runners["plain_2threads"].losses), torch.tensor(ref.losses),
                       "2-thread vs 1-thread single-process losses")
        for a, r, name in zip(ap_w, [ref.model.w0.detach(), ref.model.w1.detach()], ("w0", "w1")):
            C.assert_close(a, r, f"autopar vs single-process final {name}", rtol=1e-4, atol=1e-4)
        max_loss_diff = max(max_loss_diff, max(abs(a - b) for a, b in zip(ap.losses, ref.losses)))
        max_rel_diff = max(max_rel_diff, max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ap.losses, ref.losses)))

    st = {n: C.stats_ms(v) for n, v in times.items()}
    bench = f"tp_mlp_step{'_relu' if args.relu else ''}"
    info = {
        "autopar": (nbytes_local(ap.model.parameters()), opt_state_bytes(ap.opt), ap_bytes,
                    [str(x) for x in ap.model.w0.placements] + [str(x) for x in ap.model.w1.placements]),
        "dtensor": (nbytes_local(dmodel.parameters()), opt_state_bytes(dt.opt), dt_bytes,
                    [str(x) for x in dmodel.fc0.weight.placements] + [str(x) for x in dmodel.fc1.weight.placements]),
    }
    for name in fns:
        rec = {"bench": bench, "impl": "plain" if name.startswith("plain") else name, "variant": name,
               "ranks": 1 if name.startswith("plain") else k, "world": k, **st[name],
               "steps_checked": len(ap.losses), "max_abs_loss_diff": max_loss_diff,
               "max_rel_loss_diff": max_rel_diff, "loss_first_last": [ap.losses[0], ap.losses[-1]]}
        if name in info:
            pb, ob, sent, pl = info[name]
            rec.update(param_bytes_per_rank=pb, optim_state_bytes_per_rank=ob, bytes_sent_per_rank=sent,
                       placements=pl)
        else:
            rec.update(param_bytes_per_rank=(w0.numel() + w1.numel()) * 4,
                       optim_state_bytes_per_rank=2 * (w0.numel() + w1.numel()) * 4, bytes_sent_per_rank=0,
                       threads=runners[name].threads)
        if name == "autopar":
            rec["ratio_vs_dtensor"] = round(st["autopar"]["median_ms"] / st["dtensor"]["median_ms"], 3)
            rec["collectives_per_step"] = log.ops()
        if name == "dtensor":
            rec["collectives_per_step"] = counter.ops()
        for base in ("plain_1thread", "plain_2threads"):
            if base in st and name in ("autopar", "dtensor"):
                rec[f"ratio_vs_{base}"] = round(st[name]["median_ms"] / st[base]["median_ms"], 3)
        C.emit(rec)
    C.emit({"bench": "rules_missing", "ranks": k, "ops": C.rule_warnings()})


def _gather(x: int) -> list[int]:
    t = torch.zeros(C.world(), dtype=torch.int64)
    t[C.rank()] = x
    if C.world() > 1:
        tdist.all_reduce(t)
    return t.tolist()


if __name__ == "__main__":
    C.fail_loudly(main)
