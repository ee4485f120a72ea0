"""The planner's layout vs the hand layout of Paddle's parallelize docs, measured on the same ranks in one run.

    python -m autopar.launch --nproc_per_node 8 benchmarks/bench_plan.py

Model: the Llama of examples/parallelize_llama.py (fused qkv, SwiGLU MLP, learned
positions, an LM head of its own), `--batch` sequences of `--seq` tokens per step, AdamW.
  hand    : that example's config on its mesh: dp 2 x mp 2 x pp 2, tensor + sequence parallel,
            ZeRO-1, 1F1B over `--micro-batches` micro-batches.
  planned : `dist.plan(model, batch, world, device="cpu", precision="fp32")`, its config on
            its mesh (what `parallelize(..., config="auto")` runs, given the real batch).
  dp8     : plain data parallel over every rank (the planner's best layout with dp = 8).
Both are built in the same job from the same initial weights and stepped alternately.
Checks: each layout's first-step loss equals the single-process loss (rtol 1e-5).
Reports per layout: the median step (max over ranks), the ratio planned / hand, and the
planner's predicted step time for both layouts (`compare` prices the hand degrees).
"""
from __future__ import annotations

import argparse
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(os.path.dirname(here), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar as dist  # noqa: E402
from parallelize_llama import LlamaForCausalLM, parallel_config  # noqa: E402

HAND = {"dp": 2, "mp": 2, "pp": 2, "zero": 1, "sequence_parallel": True}


class Layout:
    """One parallelized copy of the model and its training step."""

    def __init__(self, name, args, mesh, config, x, y):
        """`config`: a parallelize config for `mesh`, or a `dist.plan` result (mesh None)."""
        self.name, self.x, self.y, self.vocab = name, x, y, args.vocab
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(args.vocab, args.hidden, args.ffn, args.heads, args.layers, args.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        self.model, self.opt = dist.parallelize(model, opt, mesh, config)
        piped = hasattr(self.model, "_autopar_pipeline")
        self.schedule = dist.pipelining.build_schedule(self.model, self.loss_fn) if piped else None

    def loss_fn(self, logits, labels):
        return F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))

    def step(self):
        if self.schedule is not None:
            loss = self.schedule.step(self.x, target=self.y)
        else:
            loss = self.loss_fn(self.model(self.x), self.y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    rank, world = C.setup()
    if world != 8:
        raise SystemExit("bench_plan compares against the hand dp2 x mp2 x pp2: run it on 8 ranks")
    C.emit({"bench": "env", **C.env_info(), "ranks": world})
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    torch.manual_seed(args.seed)
    reference = LlamaForCausalLM(args.vocab, args.hidden, args.ffn, args.heads, args.layers, args.seq)
    plan = dist.plan(reference, x, world, device="cpu", precision="fp32", compare=HAND)
    dp8 = dist.plan(reference, x, world, device="cpu", precision="fp32", fixed={"dp": world, "zero": 0})
    with torch.no_grad():
        want = F.cross_entropy(reference(x).reshape(-1, args.vocab), y.reshape(-1)).item()
    seed_mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "mp", "pp"])
    layouts = [
        Layout("hand", args, seed_mesh, parallel_config(sharding_level=1, micro_batches=args.micro_batches), x, y),
        Layout("planned", args, None, plan, x, y),
        Layout("dp8", args, None, dp8, x, y),
    ]
    for layout in layouts:
        C.assert_close(torch.tensor(float(layout.step())), torch.tensor(want), f"{layout.name}: first loss vs one process")
    times = C.interleaved({l.name: l.step for l in layouts}, reps=args.reps, warmup=args.warmup)
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    predicted = {"hand": plan.compared.step_time, "planned": plan.step_time_s, "dp8": dp8.step_time_s}
    degrees = {"hand": "dp2 mp2 pp2 zero1 sp mb" + str(args.batch // 2 // args.micro_batches) + "x"
               + str(args.micro_batches), "planned": plan.name, "dp8": dp8.name}
    for layout in layouts:
        n = layout.name
        C.emit({"bench": "plan", "impl": n, "ranks": world, "layout": degrees[n], "batch": args.batch,
                "seq": args.seq, "hidden": args.hidden, "layers": args.layers, **C.stats_ms(times[n]),
                "ratio_vs_hand": round(median[n] / median["hand"], 3),
                "predicted_ms": round(predicted[n] * 1e3, 4)})


if __name__ == "__main__":
    C.fail_loudly(main)
