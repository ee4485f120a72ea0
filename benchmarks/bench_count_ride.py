"""The loader's count of targets riding in the gradient bucket against its own all-reduce.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_count_ride.py [--reps 40] [--inner 5] [--read-each-step]

`shard_dataloader(count_items=...)` sums each batch's count over the ranks.  While a training
loop reduces a gradient bucket in backward, the next batch's count rides in that bucket's
all-reduce (`autopar/tensor/riders.py`); otherwise it is an 8-byte all-reduce of its own,
posted a batch ahead.  bench_gpt's tiny GPT (its model flags apply), data parallel over every
rank, 100 batches an epoch, one step per call, `--inner` steps back to back per timed block (the ranks pass a
barrier before each block only), the impls' blocks interleaved:
  ride       : the loader's count, riding (the library's default);
  posted     : the same loader with riding off: the count's own all-reduce;
  known      : the loss summed over a count the job knows (a Python int): no count to sum;
  mean       : the mean cross-entropy over the loader's batches (its (sum, count) carried
               by the gradient bucket, `tensor/deferred_mean.py`);
  ddp        : DDP over each rank's rows, prepared, its local mean loss;
  ddp_loader : the same DDP fed by torch's DataLoader with a DistributedSampler (each rank
               reading every k-th row: the same global batches), as a DDP job is fed.
The losses are read after the timed steps, as a job that logs now and then reads them (a
Partial loss is reduced when read); `--read-each-step` reads each one as it comes, as
bench_gpt.py does (one small all-reduce a step for a Partial loss, and for DDP's world mean).
One JSON line: each impl's median ms per step (max over ranks) and the ratios; every impl's
losses are checked against `known`'s.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import autopar as dist  # noqa: E402
import train_gpt as G  # noqa: E402
from autopar.tensor import riders  # noqa: E402
from bench_gpt import LoaderRunner, Runner  # noqa: E402


@contextlib.contextmanager
def no_riding():
    """Counts offered to no bucket: each posted as its own all-reduce."""
    offer, riders.offer = riders.offer, lambda n, ranks: None
    try:
        yield
    finally:
        riders.offer = offer


def main() -> None:
    p = argparse.ArgumentParser()
    G.add_model_args(p)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--read-each-step", action="store_true")
    args = p.parse_args()
    rank, k = C.setup()
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    mesh = dist.ProcessMesh([[r] for r in range(k)], dim_names=["dp", "mp"])
    # an epoch of 100 batches (bench_gpt's 4, again and again): a new epoch's first count is
    # needed at once, and its order drawn (a broadcast), costs a real epoch pays once
    data = list(G.batches(args, 4)) * 25
    shard = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0), dist.Replicate()])  # noqa: E731
    built = [(shard(x), shard(y)) for x, y in data]

    kept = None if args.read_each_step else (lambda loss: loss.detach())  # (read after the timed steps)

    def loader_runner(name, counted):
        model, opt = G.build(args, mesh)
        runner = LoaderRunner(name, model, opt, data, args.vocab, mesh, counted)
        runner.loss_fn = kept or runner.loss_fn
        return runner

    model, opt = G.build(args, mesh)
    runners = {"ride": loader_runner("ride", True), "posted": loader_runner("posted", True),
               "known": Runner("known", model, opt, built, args.vocab, loss_fn=kept, count=data[0][1].numel()),
               "mean": loader_runner("mean", False)}
    torch.manual_seed(args.seed)
    ddp = DDP(G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq))
    rows = args.batch // k
    mine = [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]) for x, y in data]
    world_mean = lambda loss: float(_world_mean(loss.detach(), k))  # noqa: E731
    runners["ddp"] = Runner("ddp", ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr), mine, args.vocab,
                            loss_fn=kept or world_mean)
    torch.manual_seed(args.seed)
    ddp = DDP(G.GPT(args.vocab, args.dim, args.heads, args.layers, args.seq))
    runners["ddp_loader"] = SampledRunner("ddp_loader", ddp, torch.optim.AdamW(ddp.parameters(), lr=args.lr), data,
                                          args.vocab, loss_fn=kept or world_mean)

    def posted_step():
        with no_riding():
            runners["posted"].step()

    fns = {name: r.step for name, r in runners.items()}
    fns["posted"] = posted_step
    times = C.interleaved(fns, reps=args.reps, inner=args.inner)
    if kept is not None:  # the losses read now
        for name, r in runners.items():
            ddp = name.startswith("ddp")
            r.losses = _world_mean(torch.stack(r.losses), k).tolist() if ddp else [float(v) for v in r.losses]
    for name, r in runners.items():
        C.assert_close(r.losses, runners["known"].losses, f"{name}'s losses against known's")
    med = {name: C.stats_ms(t)["median_ms"] for name, t in times.items()}
    C.emit({"bench": "count_ride", "ranks": k, "steps_per_block": args.inner, "read_each_step": args.read_each_step,
            **{f"{name}_median_ms": v for name, v in med.items()},
            **{f"{a}_vs_{b}": round(med[a] / med[b], 4)
               for a, b in [("ride", "posted"), ("ride", "known"), ("ride", "ddp"), ("posted", "ddp"), ("mean", "ddp"),
                            ("known", "ddp"), ("ride", "ddp_loader"), ("ddp_loader", "ddp")]}})


class SampledRunner(LoaderRunner):
    """Batches from torch's DataLoader over the same rows with a DistributedSampler: rank r
    reads rows r, r + k, ... of each global batch (DDP's feeding; the world's batches are the
    same rows)."""

    def __init__(self, name, model, opt, data, vocab, loss_fn):
        xs, ys = (torch.cat(t) for t in zip(*data))
        dataset = torch.utils.data.TensorDataset(xs, ys)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=False)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=len(data[0][0]) // tdist.get_world_size(),
                                                  sampler=sampler)
        self.batches = iter(())
        Runner.__init__(self, name, model, opt, data, vocab, loss_fn=loss_fn)

    def batch(self) -> tuple:
        return (*self.next_rows(), None)


def _world_mean(local: torch.Tensor, k: int) -> torch.Tensor:
    """DDP's losses as the world's mean (each rank's is its rows' mean)."""
    total = local.clone()
    tdist.all_reduce(total)
    return total / k


if __name__ == "__main__":
    C.fail_loudly(main)
