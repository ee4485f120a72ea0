"""A Mixtral MoE layer under expert parallel: autopar's `ExpertParallel` against the same
dispatch written by hand with torch.distributed's differentiable all_to_all_single.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_moe.py

Model: HF's MixtralSparseMoeBlock (hidden 256, intermediate 512, 8 experts, top-2, its grouped
GEMM experts), each rank holding 8/ranks experts and routing its own batch x seq tokens; one
step = zero_grad, forward, loss = out.square().mean(), backward; the tokens need a gradient, as
inside a model.
  autopar : parallelize with {"moe": ExpertParallel()} on a mesh ["ep"], the tokens Shard(0).
  plain   : the router on the local tokens, the per-expert counts exchanged, the rows sorted by
            expert sent with torch.distributed.nn.functional.all_to_all_single, the local
            experts (a MixtralExperts of 8/ranks experts holding this rank's slices) run on
            what arrived, the results sent back and summed per token.
Checks: both give the same output and the same gradients of the local experts' weights and
the router (rtol 1e-5).  Reports the step time and the calling thread's CPU time (each the max
over ranks; the CPU time leaves out time descheduled on a shared machine and time blocked in a
wait) and the bytes each rank sends.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.distributed.nn.functional as tfn  # noqa: E402
import transformers  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mixtral  # noqa: E402

import autopar as dist  # noqa: E402


def _config(args, experts):
    config = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                        num_local_experts=experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "grouped_mm"  # as HF's models set it
    return config


class HandDispatch(torch.nn.Module):
    """The MoE layer with the dispatch written against torch.distributed directly."""

    def __init__(self, block, args, rank, ranks):
        super().__init__()
        self.gate, self.ranks, self.experts_total = copy.deepcopy(block.gate), ranks, args.experts
        per_rank = args.experts // ranks
        self.experts = mixtral.MixtralExperts(_config(args, per_rank))
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                p.copy_(getattr(block.experts, name)[rank * per_rank:(rank + 1) * per_rank])

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(x)
        k, per_rank = index.shape[1], self.experts_total // self.ranks
        order = torch.argsort(index.reshape(-1), stable=True)
        counts = torch.bincount(index.reshape(-1), minlength=self.experts_total)
        got = torch.empty_like(counts)
        tdist.all_to_all_single(got, counts)
        send = counts.view(self.ranks, per_rank).sum(1).tolist()
        recv = got.view(self.ranks, per_rank).sum(1).tolist()
        rows = x[order // k]
        arrived = tfn.all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send)
        local = torch.repeat_interleave(torch.arange(per_rank).repeat(self.ranks), got)
        done = self.experts(arrived, local[:, None], torch.ones(len(local), 1))
        back = tfn.all_to_all_single(done.new_empty(sum(send), done.shape[1]), done, send, recv)
        out = torch.zeros_like(x).index_add(0, order // k, back * weights.reshape(-1)[order, None])
        return out.reshape(shape)


class Runner:
    """One step of `model` on `batch`: the mean square of the whole batch's output (`ranks`:
    how many ranks hold a part of it when the output is this rank's part only)."""

    def __init__(self, model, batch, ranks=1):
        self.model, self.batch, self.ranks, self.out = model, batch, ranks, None

    def step(self):
        for p in [self.batch, *self.model.parameters()]:
            p.grad = None
        out = self.model(self.batch)
        (out.square().sum() / (out.numel() * self.ranks)).backward()
        self.out = out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)


def runners(args, rank, k):
    """(autopar's Runner, the hand dispatch's Runner, the mesh) on this rank's tokens."""
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_to_all_single is deprecated")
    torch.manual_seed(0)
    block = mixtral.MixtralSparseMoeBlock(_config(args, args.experts))
    torch.nn.init.normal_(block.gate.weight, std=0.02)
    for p_ in block.experts.parameters():
        torch.nn.init.normal_(p_, std=0.02)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(k * args.batch, args.seq, args.hidden, generator=gen)
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]

    hand = Runner(HandDispatch(block, args, rank, k), mine.clone().requires_grad_(), k)  # (as inside a model)
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["ep"])
    model, _ = dist.parallelize(torch.nn.ModuleDict({"moe": block}), mesh=mesh,
                                config={"mp_config": {"parallelize_plan": {"moe": dist.ExpertParallel()}}})
    ap = Runner(model["moe"], dist.shard_tensor(tokens, mesh, [dist.Shard(0)]).requires_grad_())
    return ap, hand, mesh


def main():
    p = argparse.ArgumentParser()
    add_args(p)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    rank, k = C.setup()
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    ap, hand, mesh = runners(args, rank, k)

    # correctness: same output, same gradients of this rank's experts and of the router
    hand_grads, ap_grads = {}, {}
    for runner, grads in ((hand, hand_grads), (ap, ap_grads)):
        for name, p_ in runner.model.named_parameters():
            p_.register_hook(lambda g, name=name, grads=grads: grads.__setitem__(name, g))
    with dist.comm_log() as log:
        ap.step()
    hand.step()
    C.assert_close(ap.out.local_value(), hand.out, "autopar vs hand-written dispatch output")
    C.assert_close(ap.batch.grad.local_value(), hand.batch.grad, "the tokens' gradient")
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        C.assert_close(ap_grads[name].local_value(), hand_grads[name], f"gradient of the local {name}")
    C.assert_close(dist.reshard(ap_grads["gate.weight"], mesh, [dist.Replicate()]).local_value(),
                   _summed(hand_grads["gate.weight"]), "router gradient")
    ap_bytes = log.total_bytes()

    cpu = {}
    times = C.interleaved({"autopar": ap.step, "plain": hand.step}, reps=args.reps, warmup=args.warmup, cpu=cpu)
    st = {n: {**C.stats_ms(v), **C.stats_ms(cpu[n], "cpu_")} for n, v in times.items()}
    for name in ("autopar", "plain"):
        C.emit({"bench": "moe_layer", "impl": name, "ranks": k, "tokens_per_rank": args.batch * args.seq,
                "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                "bytes_sent_per_rank": ap_bytes, **st[name],
                "ratio_vs_hand_all_to_all": round(st[name]["median_ms"] / st["plain"]["median_ms"], 4),
                "cpu_ratio_vs_hand_all_to_all": round(st[name]["cpu_median_ms"] / st["plain"]["cpu_median_ms"], 4)})


def _summed(g):
    g = g.clone()
    tdist.all_reduce(g)
    return g


if __name__ == "__main__":
    C.fail_loudly(main)
