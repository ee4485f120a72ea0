"""Where the data-parallel step's Python time goes: autopar's dynamic DP step against DDP.

    python -m autopar.launch --nproc_per_node 2 benchmarks/profile_dp.py [--steps 200] [--top 22]

The model, data and step of bench_gpt.py's `autopar_dp` and `ddp` (train_gpt's GPT, its tiny
defaults; pass the model flags for another size): forward, cross-entropy, backward, AdamW step,
zero_grad, reading the loss.  The two run alternately, one step each, all ranks passing a
barrier first, for the same number of steps, measured twice:
- phases: perf_counter at the boundaries of each step on rank 0 (forward; loss; backward; the
  optimizer's pre-step hooks, split into the gradient reduction (`prepare_grads`) and the rest
  (the swap of local pieces); the step itself; the post-step hooks; zero_grad; reading the
  loss), the median ms of each over the steps.  A phase that holds a collective includes the
  wait for the other rank;
- cProfile of rank 0 over as many steps again: the functions with the most cumulative and
  self time, in ms per step (the profiler's own cost inflates both impls alike).
Rank 0 writes the summary to `--out` (default `benchmarks/results/profile_dp.<commit>.txt`).

`--loop IMPL` runs only IMPL's steps, back to back as a training loop does (no barriers, no
cProfile; the phases' clock reads stay, a few percent of the samples, under `clock`), in a
function named `loop`, for a sampling profiler that leaves the step's own costs as they are
(`py-spy` samples every rank):

    py-spy record -r 1000 -f raw --subprocesses -o /tmp/dp.txt -- \
        python -m autopar.launch --nproc_per_node 2 benchmarks/profile_dp.py --loop autopar_dp --steps 600
    python benchmarks/pyspy_summary.py /tmp/dp.txt --under loop
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import autopar as dist  # noqa: E402
import train_gpt as G  # noqa: E402

PHASES = ("forward", "loss", "backward", "grad_reduction", "pre_step_rest", "step", "post_step", "zero_grad",
          "loss_read")


class PhasedStep:
    """One training step with a clock read at every phase boundary (`marks[phase]`: seconds
    per step).  The optimizer's hooks are timed by hooks of our own around the library's."""

    def __init__(self, model, opt, data, vocab, read_loss):
        self.model, self.opt, self.data, self.vocab, self.read_loss = model, opt, data, vocab, read_loss
        self.wall = {p: [] for p in PHASES}  # wall seconds
        self.cpu = {p: [] for p in PHASES}  # this thread's CPU seconds (no time blocked in a wait)
        self.n = 0
        self._t: dict = {}
        opt.register_step_pre_hook(lambda *_: self._stamp("pre_done"))  # after the library's pre-step
        post = opt.register_step_post_hook(lambda *_: self._stamp("step_done"))
        opt._optimizer_step_post_hooks.move_to_end(post.id, last=False)  # before the library's post-step
        sharding = getattr(opt, "_autopar_sharding", None)
        if sharding is not None:
            prepare = sharding.prepare_grads

            def timed_prepare():
                t0 = clock()
                prepare()
                t1 = clock()
                before = self._t.get("reduce", (0.0, 0.0))
                self._t["reduce"] = (before[0] + t1[0] - t0[0], before[1] + t1[1] - t0[1])

            sharding.prepare_grads = timed_prepare

    def _stamp(self, what):
        self._t[what] = clock()

    def step(self, record=True):
        x, y = self.data[self.n % len(self.data)]
        self.n += 1
        self._t = {}
        t = [clock()]
        logits = self.model(x)
        t.append(clock())
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))
        t.append(clock())
        loss.backward()
        t.append(clock())
        self.opt.step()
        t.append(clock())
        self.opt.zero_grad()
        t.append(clock())
        self.read_loss(loss)
        t.append(clock())
        if not record:
            return
        reduce = self._t.get("reduce", (0.0, 0.0))
        pre, done = self._t["pre_done"], self._t["step_done"]
        for k, marks in enumerate((self.wall, self.cpu)):
            for phase, seconds in zip(PHASES, (t[1][k] - t[0][k], t[2][k] - t[1][k], t[3][k] - t[2][k], reduce[k],
                                               pre[k] - t[3][k] - reduce[k], done[k] - pre[k], t[4][k] - done[k],
                                               t[5][k] - t[4][k], t[6][k] - t[5][k])):
                marks[phase].append(seconds)


def clock() -> tuple:
    return time.perf_counter(), time.thread_time()


def runners(args, rank, world):
    """bench_gpt's autopar_dp and ddp, as PhasedSteps."""
    data = list(G.batches(args, 4))
    mesh = dist.ProcessMesh([[r] for r in range(world)], dim_names=["dp", "mp"])
    sh = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])  # noqa: E731
    m, o = G.build(args, mesh)
    out = {"autopar_dp": PhasedStep(m, o, [(sh(x), sh(y)) for x, y in data], args.vocab,
                                    lambda loss: float(loss.item()))}
    torch.manual_seed(args.seed)
    dm = DDP(G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq))
    per = args.batch // world

    def world_mean(loss):  # bench_gpt's: DDP's loss is this rank's, the log wants the global mean
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        return float(t.item()) / world

    out["ddp"] = PhasedStep(dm, torch.optim.AdamW(dm.parameters(), lr=args.lr),
                            [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in data],
                            args.vocab, world_mean)
    return out


def _where(key) -> str:
    path, line, func = key
    if path == "~":
        return func
    for marker in ("site-packages/", "wt-dpspeed/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{line}({func})"


def top(prof: cProfile.Profile, steps: int, by: str, n: int) -> list[str]:
    stats = pstats.Stats(prof).stats
    col = {"cumulative": 3, "self": 2}[by]
    rows = sorted(stats.items(), key=lambda kv: kv[1][col], reverse=True)[:n]
    lines = [f"  {'ms/step':>8} {'self':>7} {'calls/step':>10}  function"]
    for key, (_, nc, tt, ct, _) in rows:
        lines.append(f"  {ct / steps * 1e3:8.3f} {tt / steps * 1e3:7.3f} {nc / steps:10.1f}  {_where(key)}")
    return lines


def phase_table(steps: dict, what: str, phases: tuple = PHASES, parts: tuple = ()) -> list[str]:
    """Per phase, each impl's median ms (of `wall` or `cpu`), with two impls the difference; the
    step is the sum of `phases`; `parts` (shares of those phases) follow it."""
    two = len(steps) == 2
    lines = [f"  {what + ':':16s}" + "".join(f"{n:>12s}" for n in steps) + (f"{'difference':>12s}" if two else "")]
    med = {n: {ph: statistics.median(getattr(r, what)[ph]) * 1e3 for ph in phases + parts} for n, r in steps.items()}
    totals = {n: statistics.median(map(sum, zip(*(getattr(r, what)[ph] for ph in phases)))) * 1e3
              for n, r in steps.items()}
    med = {n: {**m, "step (median)": totals[n]} for n, m in med.items()}
    for ph in (*phases, "step (median)", *parts):
        row = [med[n][ph] for n in steps]
        lines.append(f"  {ph:16s}" + "".join(f"{v:12.3f}" for v in row) + (f"{row[0] - row[1]:12.3f}" if two else ""))
    return lines


def profile_in_turn(steps: dict, n: int, rank: int) -> dict:
    """cProfile of rank 0 over `n` more steps of each of `steps` (name -> a runner with
    `step(record=False)`), one step each in turn, all ranks passing a barrier before each."""
    profiles = {name: cProfile.Profile() for name in steps}
    for _ in range(n):
        for name, r in steps.items():
            C.barrier()
            if rank == 0:
                profiles[name].enable()
            r.step(record=False)
            if rank == 0:
                profiles[name].disable()
    C.barrier()
    return profiles


def summary_head(script: str, world: int, args, env: dict, what: str, phases: list) -> list:
    """The summary's first lines: the run, what ran (`what`) and the phase tables."""
    return [f"{script}: {world} ranks, {args.steps} steps each, rank 0's view; autopar {env['autopar_commit']} "
            f"(uncommitted: {len(env['autopar_uncommitted'])}), torch {env['torch']}, load {env['loadavg_1m']}, "
            f"{env['date']}", what, "",
            "median ms per step by phase (unprofiled steps): wall time, then this thread's CPU time (waits left out)",
            *phases]


def write_summary(lines: list, profiles: dict, args, name: str) -> None:
    """`lines` and each profile's top `args.top` functions by cumulative and self time, printed
    and written to `args.out` (default benchmarks/results/`name`)."""
    for n, prof in profiles.items():
        for by in ("cumulative", "self"):
            lines += ["", f"{n}: top {args.top} by {by} time (cProfile, ms per step)"]
            lines += top(prof, args.steps, by, args.top)
    text = "\n".join(lines) + "\n"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    with open(out, "w") as f:
        f.write(text)
    print(text, flush=True)


def loop(step: "PhasedStep", steps: int) -> None:
    """`steps` training steps, unrecorded: a sampling profiler's window (the frames under this
    function)."""
    for _ in range(steps):
        step.step(record=False)


def main():
    p = argparse.ArgumentParser()
    G.add_model_args(p)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--out", default=None)
    p.add_argument("--dump", default=None, help="also write each impl's raw cProfile stats to DUMP.<impl>.prof")
    p.add_argument("--loop", default=None, choices=("autopar_dp", "ddp"),
                   help="only run this impl's steps back to back (for py-spy; see the module doc)")
    args = p.parse_args()
    rank, world = C.setup()
    steps = runners(args, rank, world)
    if args.loop:
        for _ in range(args.warmup):
            steps[args.loop].step(record=False)
        return loop(steps[args.loop], args.steps)
    for _ in range(args.warmup):
        for r in steps.values():
            C.barrier()
            r.step(record=False)
    for _ in range(args.steps):
        for r in steps.values():
            C.barrier()
            r.step()
    profiles = profile_in_turn(steps, args.steps, rank)
    if rank != 0:
        return
    env = C.env_info()
    lines = summary_head("profile_dp", world, args, env,
                         f"model: dim {args.dim}, layers {args.layers}, heads {args.heads}, vocab {args.vocab}, "
                         f"seq {args.seq}, batch {args.batch}", phase_table(steps, "wall") + phase_table(steps, "cpu"))
    for n, prof in profiles.items():
        if args.dump:
            prof.dump_stats(f"{args.dump}.{n}.prof")
    write_summary(lines, profiles, args, f"profile_dp.{env['autopar_commit']}.txt")


if __name__ == "__main__":
    C.fail_loudly(main)
