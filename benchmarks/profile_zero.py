"""Where HF Llama's sharded data-parallel steps go: autopar's ZeRO levels beside level 0, DDP and FSDP2.

    python -m autopar.launch --nproc_per_node 2 benchmarks/profile_zero.py [--steps 30] [--levels 0,1,2,3]

profile_llama_dp.py's model, batches and turns (bench_zero's Llama, each rank fed its own rows:
`input_source="local"` for autopar, as DDP and FSDP2 are), with the step cut finer: forward
(the loss included), backward, the optimizer's pre-step hooks (autopar: its gradient
reduction and the swap to local pieces), the optimizer step itself, the post-step hooks
(ZeRO-1/2: the all-gather of the updated shards), zero_grad, reading the loss; and, inside
forward and backward, the time spent gathering parameters (autopar's ZeRO-3 units, FSDP2's
unshard) and, for ZeRO-3 and FSDP2, reduce-scattering the gradients after a unit's backward.
Per phase the median of this thread's CPU time (compare these on a loaded machine: a wait for
the other rank counts in wall time only) and of wall time; per impl the collectives of one step
and the bytes this rank sends (bench_zero's count: comm_log for autopar, c10d ops for torch);
then cProfile of as many steps again (profile_dp.py's tables).
Rank 0 writes the summary to `--out` (default `benchmarks/results/profile_zero.<commit>.txt`).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import profile_dp  # noqa: E402
import profile_llama_dp  # noqa: E402

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import autopar as dist  # noqa: E402
from autopar.runtime.zero import zero3  # noqa: E402
from bench_zero import collectives, llama  # noqa: E402

PHASES = ("forward", "backward", "pre_step", "step", "post_step", "zero_grad", "loss_read")
INSIDE = ("gathers", "unit_reduce")  # within forward and backward, not added to the step
# (class, method) timed as a share of forward/backward: parameter gathers, a unit's gradient reduction
TIMED = {"gathers": ((zero3._Unit, "start_gather"), (zero3._Unit, "wait_gather"), (FSDPParamGroup, "unshard"),
                     (FSDPParamGroup, "wait_for_unshard")),
         "unit_reduce": ((zero3._Unit, "reduce"), (zero3._Unit, "deliver"), (FSDPParamGroup, "post_backward"))}
_SPENT = {k: [0.0, 0.0] for k in INSIDE}  # (wall, cpu) seconds since the step started


def _time_inside() -> None:
    """Wrap TIMED's methods to add their time to _SPENT (the outermost call only)."""
    depth = [0]
    for what, methods in TIMED.items():
        for cls, name in methods:
            def timed(*args, _f=getattr(cls, name), _what=what, **kwargs):
                depth[0] += 1
                t0 = profile_dp.clock()
                try:
                    return _f(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if not depth[0]:
                        t1 = profile_dp.clock()
                        _SPENT[_what][0] += t1[0] - t0[0]
                        _SPENT[_what][1] += t1[1] - t0[1]
            setattr(cls, name, timed)


class PhasedStep(profile_llama_dp.PhasedStep):
    """profile_llama_dp's step with the optimizer's hooks timed by hooks of our own around the
    library's (as profile_dp.PhasedStep does)."""

    def __init__(self, name, model, opt, batches):
        super().__init__(model, opt, batches)
        self.name = name
        self.wall = {p: [] for p in PHASES + INSIDE}
        self.cpu = {p: [] for p in PHASES + INSIDE}
        self._t: dict = {}
        opt.register_step_pre_hook(lambda *_: self._t.__setitem__("pre_done", profile_dp.clock()))
        post = opt.register_step_post_hook(lambda *_: self._t.__setitem__("step_done", profile_dp.clock()))
        opt._optimizer_step_post_hooks.move_to_end(post.id, last=False)  # before the library's post-step

    def step(self, record: bool = True) -> None:
        for spent in _SPENT.values():
            spent[:] = [0.0, 0.0]
        t = self.clocked_step()
        if not record:
            return
        pre, done = self._t["pre_done"], self._t["step_done"]
        marks = (t[0], t[1], t[2], pre, done, t[3], t[4], t[5])
        for k, table in enumerate((self.wall, self.cpu)):
            for i, phase in enumerate(PHASES):
                table[phase].append(marks[i + 1][k] - marks[i][k])
            for what in INSIDE:
                table[what].append(_SPENT[what][k])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps (local regions verify in the first few)")
    p.add_argument("--levels", default="0,1,2,3", help="autopar ZeRO levels to run")
    p.add_argument("--no-torch", action="store_true", help="leave DDP and FSDP2 out")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None)
    p.add_argument("--dump", default=None, help="also write each impl's raw cProfile stats to DUMP.<impl>.prof")
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("ignore")
    model_args, mine = profile_llama_dp.model_and_rows(rank, k)

    steps: dict = {}
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    for level in (int(s) for s in args.levels.split(",")):
        model = llama(model_args)
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh,
                                      {"dp_config": {"sharding_level": level, "input_source": "local"}})
        steps[f"autopar_z{level}"] = PhasedStep(f"autopar_z{level}", model, opt, mine)
    if not args.no_torch:
        ddp = DistributedDataParallel(llama(model_args))
        steps["ddp"] = PhasedStep("ddp", ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), mine)
        model = llama(model_args)
        dmesh = init_device_mesh("cpu", (k,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        steps["fsdp2"] = PhasedStep("fsdp2", model, torch.optim.AdamW(model.parameters(), lr=1e-3), mine)
    _time_inside()
    for i in range(args.warmup + args.steps):
        for r in steps.values():
            C.barrier()
            r.step(record=i >= args.warmup)
    counts = {}
    for name, r in steps.items():
        C.barrier()
        counts[name] = collectives(r)
    profiles = profile_dp.profile_in_turn(steps, args.steps, rank)
    if rank != 0:
        return
    for n, prof in profiles.items():
        if args.dump:
            prof.dump_stats(f"{args.dump}.{n}.prof")
    env = C.env_info()
    what = ["model: bench_zero's Llama (2.9 M parameters), each rank its own rows; collectives per step, "
            "MiB this rank sends:"]
    what += [f"  {n:12s} {count:4d} {sent / 2**20:8.2f}  {', '.join(ops)}" for n, (count, sent, ops) in counts.items()]
    what += ["", f"({', '.join(INSIDE)}: time inside forward and backward, already counted there)"]
    lines = profile_dp.summary_head("profile_zero", k, args, env, "\n".join(what),
                                    profile_dp.phase_table(steps, "wall", PHASES, INSIDE)
                                    + profile_dp.phase_table(steps, "cpu", PHASES, INSIDE))
    profile_dp.write_summary(lines, profiles, args, f"profile_zero.{env['autopar_commit']}.txt")


if __name__ == "__main__":
    C.fail_loudly(main)
