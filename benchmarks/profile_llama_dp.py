"""Where HF Llama's data-parallel step goes: autopar at ZeRO level 0 against DDP, by phase.

    python -m autopar.launch --nproc_per_node 2 benchmarks/profile_llama_dp.py [--steps 40] [--cache]

bench_zero.py's Llama (its defaults: hidden 256, 4 layers, vocab 1024, sequence 64, batch 8),
each rank fed its own rows (`input_source="local"` for autopar, as DDP is), AdamW.  The two
run alternately, one step each after a barrier: forward (the loss included), backward,
optimizer step, zero_grad, reading the loss; per phase the median wall and this thread's CPU
time (a wait for the other rank counts in wall time only), then cProfile of as many steps
again, by self time, and the count of ops autopar dispatched one by one per step (the ops a
local region runs as plain torch are not among them).  `--cache` trains with HF's key cache
on (`use_cache=True`, HF's default), which keeps the decoder layers off the local-region path.
Rank 0 writes the summary to `--out` (default `benchmarks/results/profile_llama_dp.<commit>.txt`).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import autopar as dist  # noqa: E402
from bench_zero import llama  # noqa: E402

PHASES = ("forward", "backward", "step", "zero_grad", "loss_read")


def _clock() -> tuple:
    return time.perf_counter(), time.thread_time()


class Phased:
    def __init__(self, model, opt, batches):
        self.model, self.opt, self.batches, self.n = model, opt, batches, 0
        self.marks: list = []  # per recorded step: (wall, cpu) per phase

    def step(self, record: bool) -> None:
        ids = self.batches[self.n % len(self.batches)]
        self.n += 1
        t = [_clock()]
        loss = self.model(input_ids=ids, labels=ids).loss
        t.append(_clock())
        loss.backward()
        t.append(_clock())
        self.opt.step()
        t.append(_clock())
        self.opt.zero_grad()
        t.append(_clock())
        float(loss.item())
        t.append(_clock())
        if record:
            self.marks.append([(b[0] - a[0], b[1] - a[1]) for a, b in zip(t, t[1:])])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps (local regions verify in the first few)")
    p.add_argument("--cache", action="store_true", help="keep HF's key cache on in training")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("ignore")
    model_args = argparse.Namespace(vocab=1024, hidden=256, ffn=512, layers=4, heads=8, seq=64, batch=8)
    gen = torch.Generator().manual_seed(2024)
    batches = [torch.randint(0, model_args.vocab, (model_args.batch, model_args.seq), generator=gen) for _ in range(4)]
    per = model_args.batch // k
    mine = [b[rank * per:(rank + 1) * per] for b in batches]

    def build():
        m = llama(model_args)
        m.config.use_cache = args.cache
        return m

    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    model = build()
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh,
                                  {"dp_config": {"sharding_level": 0, "input_source": "local"}})
    ddp = DistributedDataParallel(build())
    runs = {"autopar_z0_local": Phased(model, opt, mine),
            "ddp": Phased(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), mine)}
    for n in range(args.warmup + args.steps):
        for r in runs.values():
            C.barrier()
            r.step(record=n >= args.warmup)
    profiles = {name: cProfile.Profile() for name in runs}
    dispatched = {}
    from autopar.tensor import dtensor
    for name, r in runs.items():
        calls = [0]
        orig = dtensor.DistTensor.__torch_dispatch__.__func__

        def counting(cls, func, types, a=(), kw=None, orig=orig, calls=calls):
            calls[0] += 1
            return orig(cls, func, types, a, kw)

        dtensor.DistTensor.__torch_dispatch__ = classmethod(counting)
        try:
            for _ in range(args.steps // 4):
                C.barrier()
                profiles[name].enable()
                r.step(record=False)
                profiles[name].disable()
        finally:
            dtensor.DistTensor.__torch_dispatch__ = classmethod(orig)
        dispatched[name] = calls[0] / (args.steps // 4)
    C.barrier()
    if rank != 0:
        return
    env = C.env_info()
    lines = [f"profile_llama_dp: {k} ranks, {args.steps} steps each, rank 0's view; autopar {env['autopar_commit']} "
             f"(uncommitted: {len(env['autopar_uncommitted'])}), torch {env['torch']}, load {env['loadavg_1m']}, "
             f"{env['date']}; key cache {'on' if args.cache else 'off'}", "",
             "median ms per step by phase: wall, then this thread's CPU time (waits left out)",
             f"  {'':14s}" + "".join(f"{n + ' wall':>22s}{n + ' cpu':>22s}" for n in runs)]
    for i, ph in enumerate(PHASES):
        cells = []
        for r in runs.values():
            cells += [statistics.median(m[i][0] for m in r.marks) * 1e3, statistics.median(m[i][1] for m in r.marks) * 1e3]
        lines.append(f"  {ph:14s}" + "".join(f"{c:22.2f}" for c in cells))
    totals = [statistics.median(sum(x[j] for x in m) for m in r.marks) * 1e3 for r in runs.values() for j in (0, 1)]
    lines.append(f"  {'step':14s}" + "".join(f"{c:22.2f}" for c in totals))
    lines.append("")
    lines.append("ops dispatched one by one per step: " + ", ".join(f"{n} {c:.0f}" for n, c in dispatched.items()))
    for name, prof in profiles.items():
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        lines += ["", f"{name}: top 15 by self time (cProfile, {args.steps // 4} steps)", s.getvalue().strip()]
    text = "\n".join(lines)
    print(text)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"profile_llama_dp.{env['autopar_commit']}.txt")
    with open(out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
