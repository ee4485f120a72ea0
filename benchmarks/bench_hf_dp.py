"""Data parallel on tiny HuggingFace models of six families: autopar's step against DDP's.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_hf_dp.py [--models gpt2,qwen2,...]

The suite's tiny configs (tests/test_hf_models.py: hidden 64, two layers, a vocabulary of 128,
eager attention), HF's key cache off, a batch of 8 sequences of 16 tokens split over the ranks,
each rank fed its own rows (`input_source="local"` for autopar, as DDP is), AdamW(lr=1e-3).
One step = forward with labels (HF's loss inside), backward, optimizer step, zero_grad,
loss.item().  Models this small show each step's fixed host cost: what autopar dispatches op
by op (its local regions run the rest as plain torch) and its collectives' waits.
Checks: both implementations' losses over the first steps equal the single-process run's
(rtol 1e-5).  Per model: median ms per step of each (interleaved, max over ranks), autopar's
and its `to_static` step's (the same model and plan, captured once) over DDP's, and the ops
autopar dispatched one by one in a step.  For GPT-2, Qwen2 and Mixtral (whose HF loss takes
`num_items_in_batch`), the same dynamic step with the loss a sum over the count of targets,
so no collective in the forward and the whole model one local region: `autopar_counted` fed
by `shard_dataloader(..., count_items=...)` (the loader's count, read a batch ahead, riding in
the step before's gradient bucket from the second step: 3 batches of the 4 an epoch here, an
epoch's first count being needed at once, as an all-reduce of its own), `autopar_known` given
the count the job knows (no padding here).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _common as C  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import autopar as dist  # noqa: E402
from autopar.tensor.observers import watching  # noqa: E402
import test_hf_models as hf_models  # noqa: E402  (the suite's tiny configs)

BATCH, SEQ, CHECKED = 8, 16, 3
# the families whose HF loss divides a sum by `num_items_in_batch` when given one (causal LMs:
# their targets are labels[..., 1:]); T5's, BART's and BERT's masked-LM losses take none
COUNTED = ("gpt2", "qwen2", "mixtral")


def _lm(ids) -> dict:
    """A causal LM's inputs: the ids are the labels (HF shifts them inside the loss)."""
    return {"input_ids": ids, "labels": ids}


def _step(model, opt, inputs: dict) -> float:
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _counted_batches(batches: list, mesh):
    """`shard_dataloader` over the same rows, each rank reading its own, the targets counted
    as HF's Trainer counts a causal LM's; its batches over and over."""
    rows = [{"input_ids": r, "labels": r} for b in batches for r in b]
    loader = dist.shard_dataloader(torch.utils.data.DataLoader(rows, batch_size=BATCH), mesh, shard_dims="dp",
                                   count_items=lambda b: (b["labels"][..., 1:] != -100).sum())
    while True:
        yield from loader


def _known_count(ids) -> dict:
    """`_lm(ids)` with the count of targets the job knows without looking (no padding: every
    label but each row's first is a target), as packed pretraining sequences are."""
    return {**_lm(ids), "num_items_in_batch": torch.tensor(BATCH * (SEQ - 1))}


def _world_mean(loss: float, k: int) -> float:
    """DDP's loss is this rank's rows' mean; every rank counts as many targets here."""
    t = torch.tensor([loss], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / k


def _counted_ops(model, opt, ids) -> int:
    """The ops autopar dispatches one by one in a step."""
    seen = []
    watch = type("Count", (), {"see": lambda self, *a: seen.append(a[0])})()
    with watching(watch):
        _step(model, opt, _lm(ids))
    return len(seen)


def bench(name: str, args, rank: int, k: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, hf_models.VOCAB, (BATCH, SEQ), generator=gen) for _ in range(4)]
    mine = [b[rank * BATCH // k:(rank + 1) * BATCH // k] for b in batches]
    base = hf_models.tiny(name, use_cache=False)
    plain, ddp_model, captured = copy.deepcopy(base), DistributedDataParallel(copy.deepcopy(base)), copy.deepcopy(base)
    counted, known = copy.deepcopy(base), copy.deepcopy(base)
    mesh = dist.ProcessMesh(list(range(k)), dim_names=["dp"])
    config = {"dp_config": {"sharding_level": 0, "input_source": "local"}}
    impls = {}
    if name in COUNTED:
        counted, counted_opt = dist.parallelize(counted, torch.optim.AdamW(counted.parameters(), lr=1e-3), mesh, config)
        feed = _counted_batches(batches, mesh)
        impls["autopar_counted"] = lambda i: _step(counted, counted_opt, next(feed))
        known, known_opt = dist.parallelize(known, torch.optim.AdamW(known.parameters(), lr=1e-3), mesh, config)
        impls["autopar_known"] = lambda i: _step(known, known_opt, _known_count(mine[i % 4]))
    model, opt = dist.parallelize(base, torch.optim.AdamW(base.parameters(), lr=1e-3), mesh, config)
    captured, static_opt = dist.parallelize(C.CausalLMLoss(captured), torch.optim.AdamW(captured.parameters(), lr=1e-3),
                                            mesh, config)
    program = dist.to_static(captured, None, lambda loss: loss, static_opt)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    want = [_step(plain, plain_opt, _lm(batches[i])) for i in range(CHECKED)]
    for impl, run in (("autopar", lambda i: _step(model, opt, _lm(mine[i]))),  # (the loss: the world's mean)
                      ("autopar_static", lambda i: float(program(mine[i]))),
                      ("ddp", lambda i: _world_mean(_step(ddp_model, ddp_opt, _lm(mine[i])), k)), *impls.items()):
        got = [run(i) for i in range(CHECKED)]
        C.assert_close(torch.tensor(got), torch.tensor(want), f"{name} {impl} losses")
    ops = _counted_ops(model, opt, mine[0])
    step = {"i": 0}

    def advance(_r):
        step["i"] += 1

    times = C.interleaved({"autopar": lambda: _step(model, opt, _lm(mine[step["i"] % 4])),
                           "autopar_static": lambda: float(program(mine[step["i"] % 4])),
                           "ddp": lambda: _step(ddp_model, ddp_opt, _lm(mine[step["i"] % 4])),
                           **{n: (lambda run=run: run(step["i"])) for n, run in impls.items()}},
                          reps=args.reps, warmup=args.warmup, before_rep=advance)
    a, s, d = (C.stats_ms(times[n])["median_ms"] for n in ("autopar", "autopar_static", "ddp"))
    c, n = (C.stats_ms(times[i])["median_ms"] if impls else None for i in ("autopar_counted", "autopar_known"))
    return {"bench": "hf_dp_step", "impl": name, "ranks": k, "autopar_median_ms": a, "autopar_static_median_ms": s,
            "ddp_median_ms": d, "autopar_counted_median_ms": c, "autopar_known_median_ms": n,
            "ratio_time_vs_ddp": round(a / d, 3), "ratio_static_vs_ddp": round(s / d, 3),
            "ratio_counted_vs_ddp": None if c is None else round(c / d, 3),
            "ratio_known_vs_ddp": None if n is None else round(n / d, 3), "ops_dispatched_per_step": ops}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt2,qwen2,mixtral,t5,bart,bert")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    args = p.parse_args()
    rank, k = C.setup()
    warnings.simplefilter("ignore")
    C.emit({"bench": "env", **C.env_info(), "ranks": k, "args": vars(args)})
    for name in args.models.split(","):
        C.emit(bench(name, args, rank, k))


if __name__ == "__main__":
    C.fail_loudly(main)
