"""Predicted against measured step time: `dist.planner.predict_step` on real training steps.

    python benchmarks/bench_predict.py [--cases dp2,mp2,...] [--profile cpu.json]

For each case (the examples' Llama trained with one `parallelize` config) this process
predicts the step (every rank run here under `simulate`, priced on the "cpu" profile or
`--profile`), then measures it on real ranks (`python -m autopar.launch`, this file with
`--measure CASE`: the median over timed steps after warm-up of the slowest rank's step), in
`--launches` separate jobs, and takes the median of their medians: on this machine one
launch's median moves 5-10% from the next (the same ranks' CPU time per step moves as
much), more than the steps within a launch do.
The machine may be shared: `machine_load` measures other programs' work (busy cores) for
2 s just before and after the run, and the prediction counts their average as competing for the
cores (`predicted_quiet_ms`: the same prediction on an otherwise idle machine);
and prints one JSON line per case, also appended to benchmarks/results/predict.<commit>.jsonl:
    {"bench": "predict", "case": ..., "ranks": N, "predicted_ms": ..., "measured_ms": ..., "ratio": ...,
     "measured_launches_ms": [...], "categories_ms": {...}}
The profile's constants come from `python -m autopar.plan --calibrate` only; nothing here is
fitted to these measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar as dist  # noqa: E402
import parallelize_llama as L  # noqa: E402
from autopar.planner.cost import load_profile  # noqa: E402
from autopar.planner.predict import job_time, machine_load, predict_step  # noqa: E402

SIZES = argparse.Namespace(vocab=512, hidden=256, ffn=512, heads=4, layers=4, seq=64, batch=8, steps=1, seed=0)
# case -> (mesh ids, dim names, config keys of the examples' seed config, micro-batches)
CASES = {
    "dp2": ([0, 1], ["dp"], {"dp_config": {"sharding_level": 0}}),
    "mp2": ([0, 1], ["mp"], {"mp": True}),
    "zero3_2": ([0, 1], ["dp"], {"dp_config": {"sharding_level": 3}}),
    "pp2_mb4": ([0, 1], ["pp"], {"pp_micro_batches": 4}),
    "dp2_mp2": ([[0, 1], [2, 3]], ["dp", "mp"], {"dp_config": {"sharding_level": 0}, "mp": True}),
    "dp2_mp2_pp2": ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["dp", "mp", "pp"],
                    {"dp_config": {"sharding_level": 1}, "mp": True, "pp_micro_batches": 2}),
}


def _ranks(ids) -> int:
    return len(ids) if not isinstance(ids[0], list) else len(ids) * _ranks(ids[0])


def make_step(case: str):
    """Build the case's model and optimizer on its mesh; return one training step."""
    ids, dims, spec = CASES[case]
    seed = L.parallel_config(sharding_level=0, micro_batches=spec.get("pp_micro_batches", 1))
    config = {}
    if "dp_config" in spec:
        config["dp_config"] = spec["dp_config"]
    if spec.get("mp"):
        config["mp_config"] = seed["mp_config"]
    if "pp_micro_batches" in spec:
        config["pp_config"] = seed["pp_config"]
    a = SIZES
    torch.manual_seed(a.seed)
    model = L.LlamaForCausalLM(a.vocab, a.hidden, a.ffn, a.heads, a.layers, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    model, opt = dist.parallelize(model, opt, dist.ProcessMesh(ids, dim_names=dims), config)
    x, y = next(L.batches(a))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, a.vocab), labels.reshape(-1))

    schedule = dist.pipelining.build_schedule(model, loss_fn) if "pp_config" in config else None

    def step():
        if schedule is not None:
            schedule.step(x, target=y)
        else:
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def measure(case: str, warmup: int, reps: int) -> None:
    """On real ranks: the slowest rank's seconds per step, median over `reps` after `warmup`."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    step = make_step(case)
    for _ in range(warmup):
        step()
    times, cpu = [], []
    for _ in range(reps):
        tdist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        t = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        times.append(t[0].item())
        cpu.append(t[1].item())
    if tdist.get_rank() == 0:
        print(json.dumps({"measured": times, "cpu": cpu}), flush=True)


def launched(case: str, script: str, args: list, key: str) -> dict:
    """The JSON line starting with `key` that `script` prints when launched with `args` on
    `case`'s ranks (`python -m autopar.launch`)."""
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc_per_node", str(_ranks(CASES[case][0])), script, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    for line in out.stdout.splitlines():
        line = line.split("]: ", 1)[-1]
        if line.startswith('{"' + key + '"'):
            return json.loads(line)
    raise RuntimeError(f"{case}: the launched run printed no {key}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def _measured(case: str, warmup: int, reps: int) -> list:
    found = launched(case, os.path.abspath(__file__),
                     ["--measure", case, "--warmup", str(warmup), "--reps", str(reps)], "measured")
    return found["measured"], found["cpu"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--profile", default="cpu", help="device profile: cpu (the shipped one) or a calibrated JSON")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--launches", type=int, default=3, help="separate measured jobs per case")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        return measure(args.measure, args.warmup, args.reps)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    for case in args.cases.split(","):
        ranks = _ranks(CASES[case][0])
        profile = load_profile(args.profile)
        recorded = predict_step(lambda: make_step(case), ranks, device=profile)
        loads, medians, times, cpu = [], [], [], []
        for _ in range(args.launches):
            before = machine_load(2.0)  # other programs' work around each real run
            launch_times, launch_cpu = _measured(case, args.warmup, args.reps)
            loads.append((before + machine_load(2.0)) / 2)
            medians.append(statistics.median(launch_times))
            times += launch_times
            cpu.append(statistics.median(launch_cpu))
        load = statistics.mean(loads)
        pred = job_time(recorded.recordings, profile, load)
        measured = statistics.median(medians)
        record = {
            "bench": "predict", "case": case, "ranks": ranks, "predicted_ms": round(pred.total * 1e3, 3),
            "measured_ms": round(measured * 1e3, 3), "ratio": round(pred.total / measured, 3),
            "measured_launches_ms": [round(m * 1e3, 3) for m in medians],
            "measured_min_ms": round(min(times) * 1e3, 3), "measured_max_ms": round(max(times) * 1e3, 3),
            "predicted_quiet_ms": round(recorded.total * 1e3, 3), "other_load": round(load, 2),
            "measured_cpu_ms": round(statistics.median(cpu) * 1e3, 3),  # median of the launches' medians
            "categories_ms": {k: round(v * 1e3, 3) for k, v in pred.categories.items()},
            "profile": args.profile, "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
            "autopar_commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        print(json.dumps(record), flush=True)
        with open(os.path.join(HERE, "results", f"predict.{commit}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
