"""Where the MoE layer's Python time goes: autopar's `ExpertParallel` against the dispatch by hand.

    python -m autopar.launch --nproc_per_node 2 benchmarks/profile_moe.py [--steps 30] [--top 25]

The two runners of bench_moe.py (same block, tokens and step: forward, the mean square of the
output, backward), and autopar's once more with a hook on its router, which keeps the block
running op by op on the distributed tensors (as every call did before the block ran whole on
its rank's tokens), run in turn, one step each, all ranks passing a barrier first:
- phases: perf_counter and this thread's CPU time at the boundaries of forward, loss and
  backward on rank 0, the median ms of each over the steps (the CPU time leaves out the time
  descheduled on a shared machine and the time blocked in a collective's wait);
- cProfile of rank 0 over as many steps again: the functions with the most cumulative and
  self time, in ms per step (the profiler's own cost inflates both alike).
Rank 0 writes the summary to `--out` (default `benchmarks/results/profile_moe.<commit>.txt`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_moe  # noqa: E402
import profile_dp  # noqa: E402

PHASES = ("forward", "loss", "backward")


class PhasedStep:
    """bench_moe's Runner step with the clocks read at each phase boundary."""

    def __init__(self, runner):
        self.runner = runner
        self.wall = {p: [] for p in PHASES}
        self.cpu = {p: [] for p in PHASES}

    def step(self, record=True):
        r = self.runner
        for p in [r.batch, *r.model.parameters()]:
            p.grad = None
        t = [profile_dp.clock()]
        out = r.model(r.batch)
        t.append(profile_dp.clock())
        loss = out.square().sum() / (out.numel() * r.ranks)
        t.append(profile_dp.clock())
        loss.backward()
        t.append(profile_dp.clock())
        if record:
            for k, marks in enumerate((self.wall, self.cpu)):
                for i, phase in enumerate(PHASES):
                    marks[phase].append(t[i + 1][k] - t[i][k])


def phase_table(steps: dict, what: str) -> list[str]:
    """Per phase, each impl's median ms (of `wall` or `cpu`), then each one's ratio to the last."""
    names = list(steps)
    base = names[-1]
    lines = [f"  {what + ':':16s}" + "".join(f"{n:>18s}" for n in names)
             + "".join(f"{n + '/' + base:>22s}" for n in names[:-1])]
    med = {n: {ph: statistics.median(getattr(r, what)[ph]) * 1e3 for ph in PHASES} for n, r in steps.items()}
    med = {n: {**m, "step (median)": statistics.median(map(sum, zip(*getattr(steps[n], what).values()))) * 1e3}
           for n, m in med.items()}
    for ph in (*PHASES, "step (median)"):
        lines.append(f"  {ph:16s}" + "".join(f"{med[n][ph]:18.3f}" for n in names)
                     + "".join(f"{med[n][ph] / max(med[base][ph], 1e-9):22.3f}" for n in names[:-1]))
    return lines


def main():
    p = argparse.ArgumentParser()
    bench_moe.add_args(p)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank, world = C.setup()
    ap, hand, _ = bench_moe.runners(args, rank, world)
    op_by_op, _, _ = bench_moe.runners(args, rank, world)
    # a hook on the router keeps ExpertParallel's block on the distributed tensors, op by op
    op_by_op.model.gate.register_forward_hook(lambda _m, _a, out: out)
    steps = {"autopar": PhasedStep(ap), "autopar_op_by_op": PhasedStep(op_by_op), "hand": PhasedStep(hand)}
    for i in range(args.warmup + args.steps):
        for r in steps.values():
            C.barrier()
            r.step(record=i >= args.warmup)
    profiles = profile_dp.profile_in_turn(steps, args.steps, rank)
    if rank != 0:
        return
    env = C.env_info()
    lines = profile_dp.summary_head("profile_moe", world, args, env,
                                    f"block: MixtralSparseMoeBlock hidden {args.hidden}, ffn {args.ffn}, "
                                    f"{args.experts} experts, top-{args.top_k}, "
                                    f"{args.batch * args.seq} tokens per rank",
                                    phase_table(steps, "wall") + phase_table(steps, "cpu"))
    profile_dp.write_summary(lines, profiles, args, f"profile_moe.{env['autopar_commit']}.txt")


if __name__ == "__main__":
    C.fail_loudly(main)
