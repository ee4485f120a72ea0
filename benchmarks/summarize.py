"""Markdown tables from the benchmarks' JSON lines (one or several runs).

    python benchmarks/summarize.py benchmarks/results/*.jsonl

Files named <name>.<TAG>.jsonl are runs TAG of the same benchmark.  With several runs a cell
is the median over runs of the per-run medians, times in brackets are the min/max over all
repetitions of all runs, and ratios are the median of the per-run ratios with their range.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict

MiB = 1 << 20


def load(paths):
    recs = []
    for p in paths:
        parts = os.path.basename(p).split(".")
        run = parts[1] if len(parts) > 2 else "r"
        for line in open(p):
            line = line.strip()
            if line.startswith("[rank0]: "):
                line = line[len("[rank0]: "):]
            if line.startswith('{"bench"'):
                r = json.loads(line)
                r["_run"] = run
                recs.append(r)
    return recs


def r2(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def mib(b):
    return "—" if b is None else f"{b / MiB:g}"


def human_bytes(b):
    if b is None:
        return "—"
    return f"{b} B" if b < 1024 else f"{b / MiB:g} MiB"


def group(recs, pred, key, impl_key):
    """{key: {impl: {run: rec}}}"""
    out = defaultdict(lambda: defaultdict(dict))
    for r in recs:
        if pred(r):
            out[key(r)][r[impl_key]][r["_run"]] = r
    return out


def med(runs: dict, field: str, scale: float = 1.0):
    vals = [r[field] * scale for r in runs.values() if field in r]
    return statistics.median(vals) if vals else None


def ratio(a_runs: dict, b_runs: dict, field="median_ms", bold=False) -> str:
    rs = [a_runs[k][field] / b_runs[k][field] for k in a_runs if k in b_runs and field in b_runs[k]]
    if not rs:
        return "—"
    m = statistics.median(rs)
    text = f"**{m:.2f}**" if bold else f"{m:.2f}"
    return text + (f" ({min(rs):.2f}–{max(rs):.2f})" if len(rs) > 1 else "")


def ms_cell(runs: dict, nd=1) -> str:
    if not runs or not any("median_ms" in r for r in runs.values()):
        return "not supported"
    lo = min(r["min_ms"] for r in runs.values())
    hi = max(r["max_ms"] for r in runs.values())
    return f"{r2(med(runs, 'median_ms'), nd)} [{r2(lo, nd)}–{r2(hi, nd)}]"


def nruns(g) -> int:
    return max((len(runs) for v in g.values() for runs in v.values()), default=0)


def dispatch_table(recs):
    g = group(recs, lambda r: r["bench"].startswith("dispatch_") and "variant" in r,
              lambda r: (r["ranks"], r["bench"]), "variant")
    if not g:
        return
    print(f"Per-op time, µs/op (wall clock; median over repetitions, median over {nruns(g)} run(s)):\n")
    print("| op, placement | ranks | plain | plain, local piece | autopar | DTensor | autopar overhead | DTensor overhead | autopar / DTensor | autopar / plain | decide() calls in timed loops |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (ranks, bench), v in sorted(g.items()):
        ap, dt, pl = v["autopar"], v["dtensor"], v["plain"]
        us = {k: med(x, "median_ms", 1e3) for k, x in v.items()}
        decides = sum(r["decide_calls_timed_loops"] for r in ap.values())
        calls = sum(r["timed_calls"] for r in ap.values())
        print(f"| {bench.replace('dispatch_', '')} | {ranks} | {r2(us['plain'])} | {r2(us['plain_local'])} | "
              f"{r2(us['autopar'])} | {r2(us['dtensor'])} | +{r2(us['autopar'] - us['plain'])} | "
              f"+{r2(us['dtensor'] - us['plain'])} | {ratio(ap, dt, bold=True)} | {ratio(ap, pl)} | {decides} of {calls} |")
    print()


def proto_table(recs):
    g = group(recs, lambda r: r["bench"].startswith("proto_") and not r["bench"].startswith("proto_reshard"),
              lambda r: r["bench"], "impl")
    if not g:
        return
    impls = ["plain", "floor_subclass", "autopar_shipped", "autopar_fastpath_proto", "dtensor"]
    print(f"Fast-path experiment, 1 rank, µs/op (median over {nruns(g)} run(s)):\n")
    print("| op | " + " | ".join(impls) + " | proto / DTensor |")
    print("|---|" + "---|" * (len(impls) + 1))
    for bench, v in sorted(g.items()):
        print(f"| {bench.replace('proto_', '')} | " + " | ".join(r2(med(v[i], 'median_ms', 1e3)) for i in impls)
              + f" | {ratio(v['autopar_fastpath_proto'], v['dtensor'], bold=True)} |")
    print()


def proto_reshard_table(recs):
    g = group(recs, lambda r: r["bench"].startswith("proto_reshard"), lambda r: r["bench"], "impl")
    if not g:
        return
    print(f"Copy-lean reshard experiment, 4 ranks, 2048×2048 fp32, ms per call ({nruns(g)} run(s)):\n")
    print("| transition | shipped | copy-lean variant | raw collective | variant / shipped | shipped / raw |")
    print("|---|---|---|---|---|---|")
    for bench, v in g.items():
        print(f"| {bench.replace('proto_reshard_', '')} | {ms_cell(v['shipped'])} | {ms_cell(v['copy_lean_proto'])} | "
              f"{ms_cell(v['raw'])} | {ratio(v['copy_lean_proto'], v['shipped'], bold=True)} | "
              f"{ratio(v['shipped'], v['raw'])} |")
    print()


def reshard_table(recs):
    g = group(recs, lambda r: r["bench"].startswith("reshard_") and not r["bench"].startswith("reshard_small"),
              lambda r: r["bench"], "impl")
    if g:
        print(f"Reshard, 4 ranks, 2048×2048 fp32, ms per call (max over ranks; median [min–max], {nruns(g)} run(s)):\n")
        print("| transition | autopar | DTensor | raw collective | autopar / DTensor | autopar / raw | "
              "MiB sent per rank: autopar / DTensor / minimum | autopar does | DTensor does |")
        print("|---|---|---|---|---|---|---|---|---|")
        for bench, v in g.items():
            ap, dt, pl = v["autopar"], v.get("dtensor", {}), v["plain"]
            dt_ok = any("median_ms" in r for r in dt.values())
            a0 = next(iter(ap.values()))
            d0 = next(iter(dt.values())) if dt_ok else {}
            print(f"| {bench.replace('reshard_', '')} | {ms_cell(ap)} | {ms_cell(dt) if dt_ok else 'not supported'} | "
                  f"{ms_cell(pl)} | {ratio(ap, dt, bold=True) if dt_ok else '—'} | {ratio(ap, pl)} | "
                  f"{mib(a0['bytes_sent_per_rank'])} / {mib(d0.get('bytes_sent_per_rank')) if dt_ok else '—'} / "
                  f"{mib(a0['min_bytes_per_rank'])} | {'+'.join(a0.get('collectives') or ['local slice'])} | "
                  f"{('+'.join(d0.get('collectives') or ['local slice'])) if dt_ok else '—'} |")
        print()
    s = group(recs, lambda r: r["bench"].startswith("reshard_small"), lambda r: r["bench"], "impl")
    if s:
        print("Fixed cost per reshard call, 4 ranks, 64×64, µs per call:\n")
        print("| transition | autopar | DTensor | raw | autopar / DTensor |")
        print("|---|---|---|---|---|")
        for bench, v in s.items():
            print(f"| {bench.replace('reshard_small_', '')} | {r2(med(v['autopar'], 'median_ms', 1e3), 1)} | "
                  f"{r2(med(v['dtensor'], 'median_ms', 1e3), 1)} | {r2(med(v['plain'], 'median_ms', 1e3), 1)} | "
                  f"{ratio(v['autopar'], v['dtensor'], bold=True)} |")
        print()


def mlp_table(recs):
    g = group(recs, lambda r: r["bench"].startswith("tp_mlp"), lambda r: (r["bench"], r["world"]), "variant")
    if not g:
        return
    print(f"TP MLP training step, ms (max over ranks; median [min–max], {nruns(g)} run(s)):\n")
    print("| world | autopar | DTensor | 1 proc × 1 thread | 1 proc × 2 threads | autopar / DTensor | "
          "autopar / plain 2 thr | autopar / plain 1 thr | param MiB per rank: autopar / DTensor / plain | "
          "optimizer-state MiB per rank: autopar / DTensor | sent per rank per step: autopar / DTensor | max loss diff (abs / rel) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (bench, world), v in sorted(g.items()):
        ap, dt = v["autopar"], v["dtensor"]
        p1, p2 = v.get("plain_1thread", {}), v.get("plain_2threads", {})
        a0, d0 = next(iter(ap.values())), next(iter(dt.values()))
        absd = max(r["max_abs_loss_diff"] for r in ap.values())
        reld = max(r.get("max_rel_loss_diff", 0.0) for r in ap.values())
        name = "" if bench == "tp_mlp_step" else f" ({bench})"
        print(f"| {world}{name} | {ms_cell(ap)} | {ms_cell(dt)} | {ms_cell(p1)} | {ms_cell(p2)} | {ratio(ap, dt, bold=True)} | "
              f"{ratio(ap, p2)} | {ratio(ap, p1)} | {mib(a0['param_bytes_per_rank'])} / {mib(d0['param_bytes_per_rank'])} / "
              f"{mib(next(iter(p1.values()))['param_bytes_per_rank']) if p1 else '—'} | "
              f"{mib(a0['optim_state_bytes_per_rank'])} / {mib(d0['optim_state_bytes_per_rank'])} | "
              f"{human_bytes(a0['bytes_sent_per_rank'])} / {human_bytes(d0['bytes_sent_per_rank'])} | "
              f"{absd:.1e} / {reld:.1e} |")
    print()


def main():
    recs = load(sys.argv[1:])
    for e in (r for r in recs if r["bench"] == "env"):
        print(f"<!-- run {e['_run']}: ranks={e.get('ranks')} torch={e['torch']} date={e['date']} "
              f"load1m={e.get('loadavg_1m')} -->")
    print()
    dispatch_table(recs)
    proto_table(recs)
    reshard_table(recs)
    proto_reshard_table(recs)
    mlp_table(recs)
    missing = sorted({op for r in recs if r["bench"] == "rules_missing" for op in r["ops"]})
    print(f"Ops autopar warned 'no sharding rule for': {', '.join(missing) if missing else 'none'}")


if __name__ == "__main__":
    main()
