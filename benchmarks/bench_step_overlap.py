"""Whether ZeRO-1/2's all-gather of the updated shards can hide behind the optimizer step.

    python -m autopar.launch --nproc_per_node 2 benchmarks/bench_step_overlap.py [--mb 11] [--buckets 1,4,8]

ZeRO-1/2 steps this rank's shards, then all-gathers them into the whole parameters, waiting
for the all-gather after the step (`runtime/zero/sharding.py::_publish`).  Stepping bucket by
bucket and starting each bucket's all-gather before the next bucket's step would overlap
them.  This measures that on plain tensors (torch's AdamW, gloo), `--mb` MB of parameters
sharded over the ranks, cut into each `--buckets` count of equal buckets:
  step     : AdamW over the shards, alone;
  gather   : the buckets' all-gathers one after another, alone;
  serial   : the step, then the all-gathers (what ZeRO-1/2 does);
  overlap  : per bucket, its step and then its all-gather started, waited for at the end.
Per bucket count, one JSON line: the median ms per call of each (interleaved, max over
ranks) and overlap / serial at one bucket, the fewest collectives.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=11.0, help="parameters in all, MB of fp32 (bench_zero's Llama: 11)")
    p.add_argument("--buckets", default="1,4,8")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    _, world = C.setup()
    shard = int(args.mb * 2**20 / 4 / world)
    serial_one = None
    for count in [int(b) for b in args.buckets.split(",")]:
        shards = [torch.randn(shard // count) for _ in range(count)]
        for s in shards:
            s.grad = torch.randn_like(s)
        opt = torch.optim.AdamW(shards, lr=1e-3, foreach=False)
        opt.step()  # its states made before timing
        step_alone = type(opt).step.__wrapped__  # torch's step without the hooks, on a subset below
        gathered = [torch.empty(s.numel() * world) for s in shards]
        group = opt.param_groups[0]

        def gather():
            for s, out in zip(shards, gathered):
                tdist.all_gather_into_tensor(out, s)

        def serial():
            opt.step()
            gather()

        def overlap():
            works = []
            try:
                for s, out in zip(shards, gathered):
                    group["params"] = [s]
                    step_alone(opt)
                    works.append(tdist.all_gather_into_tensor(out, s, async_op=True))
            finally:
                group["params"] = shards
            for w in works:
                w.wait()

        times = C.interleaved({"step": opt.step, "gather": gather, "serial": serial, "overlap": overlap},
                              reps=args.reps)
        record = {"bench": "step_overlap", "world": world, "mb": args.mb, "buckets": count}
        record.update({f"{name}_ms": C.stats_ms(t)["median_ms"] for name, t in times.items()})
        serial_one = serial_one or record["serial_ms"]
        record["overlap_vs_serial_one_bucket"] = round(record["overlap_ms"] / serial_one, 3)
        C.emit({**record, **C.env_info()})


if __name__ == "__main__":
    C.fail_loudly(main)
