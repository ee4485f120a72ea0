"""Pipeline schedules: autopar 1F1B x8 vs one micro-batch vs torch.distributed.pipelining.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_pipeline.py

Model: `--stages` stages (one per rank) of `--layers` Linear(f, f) + ReLU each (f =
`--features` 512), batch `--batch` 1024 x f, loss = mse against a fixed target; one step =
the schedule's step (forward, backward of every micro-batch) and zero_grad.  A micro-batch
of 128 rows keeps the matmuls as efficient as the whole batch's on this CPU (at 16 rows they
cost 2.6x), so the comparison is about the schedule, not the kernels.
  autopar_1f1b     : autopar.pipelining.Schedule1F1B, `--microbatches` (8) micro-batches.
  autopar_1mb      : the same stages run with one micro-batch (ScheduleFThenB, m = 1): what a
                     pipeline without micro-batches costs (every rank idle (p-1)/p of the step).
  torch_1f1b       : torch.distributed.pipelining.Schedule1F1B on copies of the same stage
                     modules, the same micro-batches.
  torch_interleaved / torch_interleaved_zb: torch's ScheduleInterleaved1F1B and
                     ScheduleInterleavedZeroBubble on the same two stages per rank as
                     autopar_vpp (with an even `--layers`), the peers of autopar_vpp and
                     autopar_zbvpp.
  autopar_fthenb / autopar_zbh1 / autopar_vpp / autopar_zbvpp: the other schedules (VPP and
                     ZBVPP: every stage cut in two, two stages per rank), for their step time
                     and bubble.
Every implementation is timed in the same run, repetitions interleaved (order rotated).
Checks: every implementation's gradients equal the 1-micro-batch run's (rtol 1e-4).
Reports per implementation: median step (max over ranks), the ratios to autopar_1mb, to
torch_1f1b and to torch's interleaved schedules, and for autopar's schedules the measured bubble (the share of the step a rank
waited for messages, mean over ranks and repetitions) next to the textbook (p-1)/(m+p-1)
and the order's own prediction (`orders.simulate`, backward = 2 forwards).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed import pipelining as tpp  # noqa: E402

import autopar as dist  # noqa: E402
from autopar import pipelining as app  # noqa: E402
from autopar.pipelining import orders  # noqa: E402


def _layers(n: int, f: int) -> list:
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        out += [torch.nn.Linear(f, f), torch.nn.ReLU()]
    return out


class Runner:
    """One implementation: a step function and, for autopar's, the bubble of each step."""

    def __init__(self, name, modules, step, schedule=None):
        self.name, self.modules, self.step_fn, self.schedule = name, modules, step, schedule
        self.bubbles: list = []

    def step(self):
        self.step_fn()
        if self.schedule is not None:
            t = self.schedule.last_times
            self.bubbles.append(t.idle / t.total)
        for m in self.modules:
            m.zero_grad(set_to_none=True)

    def grads(self) -> dict:
        """{index of the layer in the whole model: its parameters' gradients}."""
        return {m.first + i: [p.grad.clone() for p in layer.parameters()]
                for m in self.modules for i, layer in enumerate(m) if list(layer.parameters())}


def _stage(layers: list, k: int, n: int) -> torch.nn.Sequential:
    """Stage k of n: fresh copies of its share of `layers`; `.first` is its first layer's index."""
    size = len(layers) // n
    module = torch.nn.Sequential(*copy.deepcopy(layers[k * size:(k + 1) * size]))
    module.first = k * size
    return module


def _autopar(name, schedule_cls, layers, rank, p, m, x, y, stages_per_rank=1):
    n = p * stages_per_rank
    mine = [k for k in range(n) if k % p == rank]
    modules = [_stage(layers, k, n) for k in mine]
    stages = [app.PipelineStage(module, k, n) for k, module in zip(mine, modules)]
    schedule = schedule_cls(stages if stages_per_rank > 1 else stages[0], m, F.mse_loss)
    return Runner(name, modules, lambda: schedule.step(x, target=y), schedule)


def _torch(name, schedule_cls, layers, rank, p, m, x, y, stages_per_rank=1):
    n = p * stages_per_rank
    mine = [k for k in range(n) if k % p == rank]
    modules = [_stage(layers, k, n) for k in mine]
    stages = [tpp.PipelineStage(module, k, n, torch.device("cpu")) for k, module in zip(mine, modules)]
    schedule = schedule_cls(stages if stages_per_rank > 1 else stages[0], m, loss_fn=F.mse_loss)

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y)
        else:
            schedule.step()

    return Runner(name, modules, step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4, help="linear layers per stage")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    rank, p = C.setup()
    m, f = args.microbatches, args.features
    C.emit({"bench": "env", **C.env_info(), "ranks": p})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, f, generator=g), torch.randn(args.batch, f, generator=g)
    layers = _layers(p * args.layers, f)
    runners = [
        _autopar("autopar_1f1b", app.Schedule1F1B, layers, rank, p, m, x, y),
        _autopar("autopar_1mb", app.ScheduleFThenB, layers, rank, p, 1, x, y),
        _torch("torch_1f1b", tpp.Schedule1F1B, layers, rank, p, m, x, y),
        _autopar("autopar_fthenb", app.ScheduleFThenB, layers, rank, p, m, x, y),
        _autopar("autopar_zbh1", app.ScheduleZBH1, layers, rank, p, m, x, y),
    ]
    if args.layers % 2 == 0:
        runners.append(_autopar("autopar_vpp", app.ScheduleVPP, layers, rank, p, m, x, y, stages_per_rank=2))
        runners.append(_autopar("autopar_zbvpp", app.ScheduleZBVPP, layers, rank, p, m, x, y, stages_per_rank=2))
        runners.append(_torch("torch_interleaved", tpp.ScheduleInterleaved1F1B, layers, rank, p, m, x, y, 2))
        runners.append(_torch("torch_interleaved_zb", tpp.ScheduleInterleavedZeroBubble, layers, rank, p, m, x, y, 2))
    whole = torch.nn.Sequential(*copy.deepcopy(layers))
    F.mse_loss(whole(x), y).backward()
    for r in runners:
        r.step_fn()
        for index, grads in r.grads().items():
            for got, want in zip(grads, whole[index].parameters()):
                C.assert_close(got, want.grad, f"{r.name}: layer {index}'s gradient vs one process", rtol=1e-4, atol=1e-5)
        for module in r.modules:
            module.zero_grad(set_to_none=True)
    times = C.interleaved({r.name: r.step for r in runners}, reps=args.reps, warmup=args.warmup)
    for r in runners:
        r.bubbles = r.bubbles[-args.reps:]
    medians = {n: statistics.median(t) for n, t in times.items()}
    simulated = {"autopar_1f1b": orders.simulate(orders.one_f_one_b(p, m), p),
                 "autopar_1mb": orders.simulate(orders.fthenb(p, 1), p),
                 "autopar_fthenb": orders.simulate(orders.fthenb(p, m), p),
                 "autopar_zbh1": orders.simulate(orders.zbh1(p, m), p, costs={"F": 1, "I": 1, "W": 1}),
                 "autopar_vpp": orders.simulate(orders.interleaved(p, 2, m), 2 * p, costs={"F": 0.5, "B": 1}),
                 "autopar_zbvpp": orders.simulate(orders.zbvpp(p, 2, m), 2 * p, costs={"F": 0.5, "I": 0.5, "W": 0.5})}
    for r in runners:
        rec = {"bench": "pipeline", "impl": r.name, "ranks": p, "features": f, "batch": args.batch,
               "layers_per_stage": args.layers, "microbatches": 1 if r.name == "autopar_1mb" else m,
               **C.stats_ms(times[r.name]),
               "ratio_vs_autopar_1mb": round(medians[r.name] / medians["autopar_1mb"], 3),
               "ratio_vs_torch_1f1b": round(medians[r.name] / medians["torch_1f1b"], 3),
               **{f"ratio_vs_{peer}": round(medians[r.name] / medians[peer], 3)
                  for peer in ("torch_interleaved", "torch_interleaved_zb") if peer in medians}}
        if r.schedule is not None:
            mb = rec["microbatches"]
            mean_bubble = torch.tensor([statistics.mean(r.bubbles)], dtype=torch.float64)
            if p > 1:
                torch.distributed.all_reduce(mean_bubble)
            rec.update({"bubble_measured": round(mean_bubble.item() / p, 3),
                        "bubble_textbook": round((p - 1) / (mb + p - 1), 3),
                        "bubble_order": round(simulated[r.name].bubble, 3)})
        C.emit(rec)


if __name__ == "__main__":
    C.fail_loudly(main)
