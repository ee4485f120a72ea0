"""A step's local regions timed on a real rank against what `predict_step` prices for them.

    python benchmarks/trace_predict_regions.py [--case dp2] [--profile cpu.json] [--steps 10]

A local region (runtime/local_region.py) runs a module's forward as plain torch on the local
pieces; its backward is torch's autograd over those ops between the region's two boundary
Functions (`_Exit` where the gradients arrive, `_Enter` where they leave for the parameters
and inputs).  This script marks each region call's forward and the three parts of its
backward (exit boundary, the plain autograd inside, enter boundary) in two runs of the same
step (`bench_predict.make_step(case)`):

- predicted: rank 0 recorded under `simulate` as `predict_step` records it, each part's ops,
  autograd nodes and DistTensor dispatches priced per category (`predict._segments`, host
  work scaled as the playback scales it);
- measured: rank 0 of the real job (`autopar.launch`, gloo), each part's wall and thread CPU
  time (`time.thread_time`: robust where other programs share the machine), the median per
  call over `--steps` steps after warm-up; then one more step with the recorder's dispatch
  mode counting the plain aten ops and autograd nodes each part runs.

It prints, per region kind and part, the calls per step, plain ops, nodes, the measured wall
and CPU ms and the predicted ms per category, then the whole step and the step outside the
regions, and writes the same text to benchmarks/results/predict_regions_trace.<commit>.txt
(appended).
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
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import bench_predict as B  # noqa: E402
from autopar.planner import predict as P  # noqa: E402
from autopar.planner.cost import load_profile  # noqa: E402
from autopar.planner.profile_check import _profile_constants, measure_constants  # noqa: E402
from autopar.runtime import local_region as R  # noqa: E402

PARTS = ("fwd", "bwd_exit", "bwd_inner", "bwd_enter")  # fwd_inner, the module's own forward, is within fwd
_SINK: list = []  # where marks go: callables taking (kind, label)


def _mark(kind: str, label: str) -> None:
    for sink in _SINK:
        sink(kind, label)


def _install_marks() -> None:
    """Mark each region call's forward and its backward's three parts."""
    run, exit_bwd, enter_bwd = R.Region.run, R._Exit.backward, R._Enter.backward

    def marked_run(self, inner, args, kwargs):
        label = type(getattr(inner, "__self__", None)).__name__
        self.trace_label = label
        _mark("fwd_begin", label)

        def marked_inner(*a, **kw):
            _mark("inner_begin", label)
            try:
                return inner(*a, **kw)
            finally:
                _mark("inner_end", label)
        try:
            return run(self, marked_inner, args, kwargs)
        finally:
            _mark("fwd_end", label)

    def marked_backward_part(backward, begin: str, end: str):
        def marked(ctx, *grads):
            label = getattr(ctx.call.region, "trace_label", "?")
            _mark(begin, label)
            try:
                return backward(ctx, *grads)
            finally:
                _mark(end, label)
        return staticmethod(marked)

    R.Region.run = marked_run
    R._Exit.backward = marked_backward_part(exit_bwd, "exit_begin", "exit_end")
    R._Enter.backward = marked_backward_part(enter_bwd, "enter_begin", "enter_end")
    backward = torch.autograd.backward

    def marked_backward(*args, **kwargs):
        _mark("backward_begin", "step")
        try:
            return backward(*args, **kwargs)
        finally:
            _mark("backward_end", "step")

    torch.autograd.backward = marked_backward


def marked_step(case: str):
    """`bench_predict.make_step(case)`'s step, its start and end marked."""
    step = B.make_step(case)

    def run():
        _mark("step_begin", "step")
        step()
        _mark("step_end", "step")
    return run


# mark kind -> the part it opens, the part it closes; the step's phases (label "step") are the
# forward up to `backward()`, the backward, and the rest (optimizer, zero_grad): one backward
# per step (a pipeline's schedule runs several: its phases mean nothing)
_OPENS = {"fwd_begin": "fwd", "inner_begin": "fwd_inner", "exit_begin": "bwd_exit", "exit_end": "bwd_inner", "enter_begin": "bwd_enter",
          "step_begin": "forward", "backward_begin": "backward", "backward_end": "optimizer"}
_CLOSES = {"fwd_end": "fwd", "inner_end": "fwd_inner", "exit_end": "bwd_exit", "enter_begin": "bwd_inner", "enter_end": "bwd_enter",
           "backward_begin": "forward", "backward_end": "backward", "step_end": "optimizer"}


def spans(marks: list) -> list:
    """[(label, part, start index, end index)] from a step's [(kind, label, index)] marks: the
    items between a part's opening and closing mark (a region's inner backward runs from its
    exit boundary's end to its enter boundary's start)."""
    open_: dict = {}
    out = []
    for kind, label, i in marks:
        if kind in _CLOSES and (label, _CLOSES[kind]) in open_:
            out.append((label, _CLOSES[kind], open_.pop((label, _CLOSES[kind])), i))
        if kind in _OPENS:
            open_[(label, _OPENS[kind])] = i
    return out


# -- predicted --------------------------------------------------------------------------------------
def predicted(case: str, profile) -> dict:
    """Rank 0 of `case` recorded as predict_step records it: per (label, part) the calls, ops,
    nodes, dispatches and predicted seconds per category; and the whole step's."""
    recorders = []
    init = P._Recorder.__init__

    def registering(self, *a, **kw):
        init(self, *a, **kw)
        recorders.append(self)

    P._Recorder.__init__ = registering
    _SINK.append(lambda kind, label: recorders and recorders[-1]._note(("mark", kind, label)))
    try:
        ranks = B._ranks(B.CASES[case][0])
        recording = P.record_step(lambda: marked_step(case), ranks, 0)
    finally:
        _SINK.clear()
        P._Recorder.__init__ = init
    crowding = ranks / profile.cores if profile.cores else 1.0
    slow = P.host_factor(crowding, profile)
    events = recording.events
    marks = [(e[1], e[2], i) for i, e in enumerate(events) if e[0] == "mark"]
    out: dict = {}
    for label, part, a, b in spans(marks):
        _add(out, (label, part), events[a + 1:b], profile, slow)
    _add(out, ("step", "all"), events, profile, slow)
    return out


def _add(out: dict, key, events: list, profile, slow: float) -> None:
    plain = [e for e in events if e[0] in ("op", "node", "dist", "region")]
    rec = P.Recording(0, plain)
    priced: dict = {}
    for seg in P._segments(rec, profile, slow):
        if seg[0] == "busy":
            for c, s in seg[1].items():
                priced[c] = priced.get(c, 0.0) + s
    entry = out.setdefault(key, {"calls": 0, "ops": 0, "nodes": 0, "dist": 0, "priced": {}})
    entry["calls"] += 1
    for kind, name in (("op", "ops"), ("node", "nodes"), ("dist", "dist")):
        entry[name] += rec.count(kind)
    for c, s in priced.items():
        entry["priced"][c] = entry["priced"].get(c, 0.0) + s


# -- measured ---------------------------------------------------------------------------------------
def trace(case: str, warmup: int, steps: int) -> None:
    """On a real rank: each part's wall and thread seconds per step, then one counted step."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    _install_marks()
    step = marked_step(case)
    for _ in range(warmup):
        step()
    reference = measure_constants()  # the machine's speed now, every rank measuring at once
    clock: list = []
    _SINK.append(lambda kind, label: clock.append((kind, label, time.perf_counter(), time.thread_time())))
    per_step = []
    for _ in range(steps):
        tdist.barrier()
        clock.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        total = (time.perf_counter() - t0, time.thread_time() - c0)
        marks = [(k, label, i) for i, (k, label, *_) in enumerate(clock)]
        parts: dict = {"step/all": list(total)}
        for label, part, a, b in spans(marks):
            key = f"{label}/{part}"
            wall, cpu = clock[b][2] - clock[a][2], clock[b][3] - clock[a][3]
            acc = parts.setdefault(key, [0.0, 0.0])
            acc[0] += wall
            acc[1] += cpu
        per_step.append(parts)
    _SINK.clear()
    # one step counted by the recorder's mode (its own cost is not timed)
    recording = P.Recording(tdist.get_rank())
    recorder = P._Recorder(recording)
    _SINK.append(lambda kind, label: recorder._note(("mark", kind, label)))
    with recorder:
        step()
    _SINK.clear()
    events = recording.events
    counts: dict = {}
    for label, part, a, b in spans([(e[1], e[2], i) for i, e in enumerate(events) if e[0] == "mark"]):
        c = counts.setdefault(f"{label}/{part}", [0, 0, {}])
        c[0] += sum(e[0] == "op" for e in events[a + 1:b])
        c[1] += sum(e[0] == "node" for e in events[a + 1:b])
        for e in events[a + 1:b]:
            if e[0] == "op":
                c[2][e[1]] = c[2].get(e[1], 0) + 1
    counts["step/all"] = [sum(e[0] == "op" for e in events), sum(e[0] == "node" for e in events)]
    if tdist.get_rank() == 0:
        median = {k: [statistics.median(s[k][j] for s in per_step) for j in (0, 1)] for k in per_step[0]}
        print(json.dumps({"trace": median, "counts": counts, "reference": reference}), flush=True)


def _measured(case: str, warmup: int, steps: int) -> dict:
    args = ["--trace", case, "--warmup", str(warmup), "--steps", str(steps)]
    return B.launched(case, os.path.abspath(__file__), args, "trace")


def report(case: str, pred: dict, real: dict) -> str:
    """The table: per region kind and part, measured against predicted."""
    ms = lambda s: f"{s * 1e3:7.2f}"  # noqa: E731
    lines = [f"case {case}: per step on rank 0 (ms); predicted categories: compute framework dispatch autograd",
             f"{'region/part':28} {'calls':>5} {'ops':>5} {'real ops':>8} {'nodes':>5} {'wall':>7} {'cpu':>7} "
             f"{'pred':>7} {'cpu/pred':>8}   compute framework dispatch autograd"]
    inside_real, inside_pred = [0.0, 0.0], 0.0
    for (label, part), p in sorted(pred.items(), key=lambda kv: (kv[0][0] == "step", kv[0])):
        key = f"{label}/{part}"
        wall, cpu = real["trace"].get(key, [float("nan")] * 2)
        n_real = real["counts"].get(key, ["?", "?"])[0]
        priced = sum(p["priced"].values())
        if label != "step" and part in PARTS:
            inside_real = [inside_real[0] + wall, inside_real[1] + cpu]
            inside_pred += priced
        cats = " ".join(f"{p['priced'].get(c, 0.0) * 1e3:8.2f}" for c in ("compute", "framework", "dispatch", "autograd"))
        lines.append(f"{key:28} {p['calls']:5d} {p['ops']:5d} {n_real!s:>8} {p['nodes']:5d} {ms(wall)} {ms(cpu)} "
                     f"{ms(priced)} {cpu / priced if priced else float('nan'):8.2f}   {cats}")
    step_pred = sum(pred[("step", "all")]["priced"].values())
    wall, cpu = real["trace"]["step/all"]
    lines.append(f"{'regions, all parts':28} {'':5} {'':5} {'':8} {'':5} {ms(inside_real[0])} {ms(inside_real[1])} "
                 f"{ms(inside_pred)} {inside_real[1] / inside_pred:8.2f}")
    for phase, parts in (("forward", ("fwd",)), ("backward", ("bwd_exit", "bwd_inner", "bwd_enter")), ("all", PARTS)):
        if ("step", phase) not in pred:
            continue
        keys = [k for k in pred if k[0] != "step" and k[1] in parts]
        r = [real["trace"][f"step/{phase}"][j] - sum(real["trace"].get(f"{a}/{b}", [0, 0])[j] for a, b in keys)
             for j in (0, 1)]
        p = sum(pred[("step", phase)]["priced"].values()) - sum(sum(pred[k]["priced"].values()) for k in keys)
        lines.append(f"{'outside the regions, ' + phase:28} {'':5} {'':5} {'':8} {'':5} {ms(r[0])} {ms(r[1])} {ms(p)} "
                     f"{r[1] / p if p else float('nan'):8.2f}")
    lines.append("(wall includes collectives and waiting; predicted is host work only, its comm is not priced here)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="dp2", choices=sorted(B.CASES))
    p.add_argument("--profile", default="cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trace:
        return trace(args.trace, args.warmup, args.steps)
    torch.set_num_threads(1)
    _install_marks()
    profile = load_profile(args.profile)
    pred = predicted(args.case, profile)
    real = _measured(args.case, args.warmup, args.steps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    want = _profile_constants(profile)
    speed = ", ".join(f"{k} {want[k] / v if k == 'kernel_latency' else v / want[k]:.2f}" for k, v in real["reference"].items())
    text = (f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')} commit {commit} profile {args.profile} "
            f"loadavg {os.getloadavg()[0]:.2f}; the machine's speed against the profile's during the run "
            f"(1: as calibrated): {speed}\n" + report(args.case, pred, real) + "\n")
    print(text)
    with open(os.path.join(HERE, "results", f"predict_regions_trace.{commit}.txt"), "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
