"""Where HF Llama's data-parallel step goes: autopar at ZeRO level 0 against DDP, by phase.

    python -m autopar.launch --nproc_per_node 2 benchmarks/profile_llama_dp.py [--steps 40] [--cache]

bench_zero.py's Llama (its defaults: hidden 256, 4 layers, vocab 1024, sequence 64, batch 8),
each rank fed its own rows (`input_source="local"` for autopar, as DDP is), AdamW.  The two
run alternately, one step each after a barrier: forward (the loss included), backward,
optimizer step, zero_grad, reading the loss; per phase the median wall and this thread's CPU
time (a wait for the other rank counts in wall time only), then cProfile of as many steps
again (profile_dp.py's tables), and the count of ops autopar dispatched one by one per step
(the ops a local region runs as plain torch are not among them).  `--cache` trains with HF's key cache
on (`use_cache=True`, HF's default), which keeps the decoder layers off the local-region path.
Rank 0 writes the summary to `--out` (default `benchmarks/results/profile_llama_dp.<commit>.txt`).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import profile_dp  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import autopar as dist  # noqa: E402
from autopar.tensor.dtensor import DistTensor  # noqa: E402
from bench_zero import llama  # noqa: E402

PHASES = ("forward", "backward", "step", "zero_grad", "loss_read")


class PhasedStep:
    """bench_zero's step with the clocks read at each phase boundary."""

    def __init__(self, model, opt, batches):
        self.model, self.opt, self.batches, self.n = model, opt, batches, 0
        self.wall = {p: [] for p in PHASES}
        self.cpu = {p: [] for p in PHASES}

    def step(self, record: bool = True) -> None:
        t = self.clocked_step()
        if record:
            for k, marks in enumerate((self.wall, self.cpu)):
                for i, phase in enumerate(PHASES):
                    marks[phase].append(t[i + 1][k] - t[i][k])

    def clocked_step(self) -> list:
        """One step; the clocks at its start and after each of PHASES."""
        ids = self.batches[self.n % len(self.batches)]
        self.n += 1
        t = [profile_dp.clock()]
        loss = self.model(input_ids=ids, labels=ids).loss
        t.append(profile_dp.clock())
        loss.backward()
        t.append(profile_dp.clock())
        self.opt.step()
        t.append(profile_dp.clock())
        self.opt.zero_grad()
        t.append(profile_dp.clock())
        float(loss.item())
        t.append(profile_dp.clock())
        return t


class _CountDispatch:
    """Within: the ops dispatched through DistTensor one by one are counted."""

    def __enter__(self) -> "_CountDispatch":
        self.calls, self.dispatch = 0, DistTensor.__torch_dispatch__.__func__

        def counting(cls, func, types, args=(), kwargs=None):
            self.calls += 1
            return self.dispatch(cls, func, types, args, kwargs)

        DistTensor.__torch_dispatch__ = classmethod(counting)
        return self

    def __exit__(self, *exc) -> None:
        DistTensor.__torch_dispatch__ = classmethod(self.dispatch)


def model_and_rows(rank: int, k: int) -> tuple:
    """bench_zero's Llama defaults, and this rank's rows of its 4 batches."""
    model_args = argparse.Namespace(vocab=1024, hidden=256, ffn=512, layers=4, heads=8, seq=64, batch=8)
    gen = torch.Generator().manual_seed(2024)
    batches = [torch.randint(0, model_args.vocab, (model_args.batch, model_args.seq), generator=gen) for _ in range(4)]
    per = model_args.batch // k
    return model_args, [b[rank * per:(rank + 1) * per] for b in batches]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps (local regions verify in the first few)")
    p.add_argument("--cache", action="store_true", help="keep HF's key cache on in training")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("ignore")
    model_args, mine = model_and_rows(rank, k)

    def build():
        m = llama(model_args)
        m.config.use_cache = args.cache
        return m

    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    model = build()
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh,
                                  {"dp_config": {"sharding_level": 0, "input_source": "local"}})
    ddp = DistributedDataParallel(build())
    steps = {"autopar_z0_local": PhasedStep(model, opt, mine),
             "ddp": PhasedStep(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), mine)}
    for i in range(args.warmup + args.steps):
        for r in steps.values():
            C.barrier()
            r.step(record=i >= args.warmup)
    with _CountDispatch() as counted:  # (DDP's step dispatches none)
        profiles = profile_dp.profile_in_turn(steps, args.steps, rank)
    if rank != 0:
        return
    env = C.env_info()
    what = (f"model: bench_zero's Llama, key cache {'on' if args.cache else 'off'}; ops autopar dispatched one by "
            f"one per step: {counted.calls / args.steps:.0f}")
    lines = profile_dp.summary_head("profile_llama_dp", k, args, env, what,
                                    profile_dp.phase_table(steps, "wall", PHASES)
                                    + profile_dp.phase_table(steps, "cpu", PHASES))
    name = "profile_llama_dp_cache" if args.cache else "profile_llama_dp"
    profile_dp.write_summary(lines, profiles, args, f"{name}.{env['autopar_commit']}.txt")


if __name__ == "__main__":
    C.fail_loudly(main)
