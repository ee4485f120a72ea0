"""What a checkpoint costs the training loop: a blocking save against an asynchronous one.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_async_save.py

train_gpt's GPT (3.7 M parameters by default) under data parallel, AdamW; the checkpoint is
the model's and the optimizer's state dicts.  One repetition of each impl is a window of
`--window` training steps:
  `steps`     the steps alone;
  `blocking`  `save_state_dict(...)`, then the steps;
  `async`     `save_state_dict(..., async_save=True)`, then the steps, then `handle.wait()`
              (the window ends when the checkpoint is in place).
The cost of a save is its window's time minus `steps`' in the same repetition (median over
repetitions); the
figures are each save's cost as a fraction of one step, async's cost over blocking's, and how
long each save call holds the loop (`*_call_ms`; `async_wait_ms`: what was left to wait for
at the window's end: 0 when the steps outlast the write).
Checks: the async checkpoint loads bit-exact equal to the state at its call.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar as dist  # noqa: E402
import train_gpt as G  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=4, help="training steps per repetition")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    rank, k = C.setup()
    C.emit({"bench": "env", **C.env_info(), "ranks": k})
    cfg = argparse.Namespace(vocab=args.vocab, dim=args.dim, heads=8, layers=args.layers, seq=args.seq,
                             batch=args.batch, lr=1e-3, seed=0)
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    model, _ = dist.parallelize(G.GPT(cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.seq), None, mesh,
                                {"dp_config": {"input_source": "replicated"}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True))
    data = list(G.batches(cfg, 8))
    at = [0]

    def step():
        x, y = data[at[0] % len(data)]
        at[0] += 1
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    root = args.dir or (tempfile.mkdtemp(prefix="bench_async_save_") if rank == 0 else None)
    box = [root]
    torch.distributed.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    state = lambda: {"model": model.state_dict(), "opt": opt.state_dict()}  # noqa: E731
    step()  # the optimizer's states exist from here on

    def steps():
        for _ in range(args.window):
            step()

    calls = {"blocking": [], "async": []}  # how long the save call itself holds the loop, seconds

    def blocking():
        sd = state()
        t0 = time.perf_counter()
        dist.save_state_dict(sd, path)
        calls["blocking"].append(time.perf_counter() - t0)
        steps()

    def asynchronous():
        sd = state()
        t0 = time.perf_counter()
        handle = dist.save_state_dict(sd, path, async_save=True)
        calls["async"].append(time.perf_counter() - t0)
        steps()
        t0 = time.perf_counter()
        handle.wait()
        calls.setdefault("async_wait", []).append(time.perf_counter() - t0)

    times = C.interleaved({"steps": steps, "blocking": blocking, "async": asynchronous},
                          reps=args.reps, warmup=args.warmup)
    _check(model, opt, path, state)
    step_ms = statistics.median(times["steps"]) * 1e3 / args.window
    # paired: each repetition's window against the same repetition's steps (the load drifts)
    cost = {n: statistics.median(a - b for a, b in zip(times[n], times["steps"])) * 1e3 for n in ("blocking", "async")}
    nbytes = C.local_bytes([v for v in _tensors(state())])
    for name, seconds in times.items():
        C.emit({"bench": "async_save", "impl": name, "ranks": k, "window_steps": args.window,
                "state_bytes_per_rank": nbytes, **C.stats_ms(seconds)})
    C.emit({"bench": "async_save", "impl": "summary", "ranks": k, "step_ms": round(step_ms, 3),
            "blocking_cost_ms": round(cost["blocking"], 3), "async_cost_ms": round(cost["async"], 3),
            "blocking_cost_per_step": round(cost["blocking"] / step_ms, 4),
            "async_cost_per_step": round(cost["async"] / step_ms, 4),
            "async_over_blocking": round(cost["async"] / cost["blocking"], 4),
            **{f"{n}_call_ms": round(statistics.median(v[args.warmup:]) * 1e3, 3) for n, v in calls.items()}})
    C.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(box[0], ignore_errors=True)


def _tensors(sd):
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _tensors(v)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            yield from _tensors(v)
    elif isinstance(sd, torch.Tensor):
        yield sd


def _check(model, opt, path, state):
    """An async save, then the parameters change: the checkpoint holds the values at the call."""
    want = {n: dist.unshard_dtensor(p.detach()).clone() for n, p in model.named_parameters()}
    handle = dist.save_state_dict(state(), path, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    dist.load_state_dict(state(), path)
    for n, p in model.named_parameters():
        C.check(torch.equal(dist.unshard_dtensor(p.detach()), want[n]), f"async checkpoint of {n} is bit-exact")


if __name__ == "__main__":
    C.fail_loudly(main)
