"""One markdown table from the benchmarks' JSON lines (one or several runs), and plots.

    python benchmarks/summarize.py benchmarks/results/*.jsonl
    python benchmarks/summarize.py --plot benchmarks/plots benchmarks/results/*.jsonl

Files named <name>.<TAG>.jsonl are run TAG of benchmark <name> (TAG: the commit measured,
with a run number: `3b05c9f-1`).  A row is one
(bench, ranks, impl/variant); with several runs, `ms` is the median over runs of each run's
median, [min-max] the extremes over every repetition of every run, and each `ratio_vs_*`
field the median of the per-run ratios with their range.  Byte fields are taken from the
first run (they do not vary).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict

BYTE_FIELDS = ("bytes_sent_per_rank", "param_bytes_per_rank", "optim_state_bytes_per_rank")


def load(paths):
    recs = []
    for p in paths:
        parts = os.path.basename(p).split(".")
        run = ".".join(parts[1:-1]) or "r"
        for line in open(p):
            line = line.strip().removeprefix("[rank0]: ")
            if line.startswith('{"bench"'):
                rec = json.loads(line)
                rec["_run"] = run
                rec["_name"] = parts[0]  # what the file measures: gpt_2ranks and gpt_3m7_2ranks differ
                recs.append(rec)
    return recs


def _cell(values, nd=2):
    if not values:
        return "—"
    m = statistics.median(values)
    return f"{m:.{nd}f}" if len(values) == 1 else f"{m:.{nd}f} ({min(values):.{nd}f}–{max(values):.{nd}f})"


def rows(recs):
    """{(bench, ranks, impl): [rec per run]} for every timed record (a bench over several
    widths gets one row per width)."""
    out = defaultdict(list)
    for r in recs:
        if "median_ms" in r:
            bench = r["_name"] + ": " + r["bench"] + (f" h={r['hidden']}" if r["bench"].startswith("scaling") else "")
            if r.get("world") not in (None, r.get("ranks")):  # a single-process baseline in a k-rank run
                bench += f" (in a {r['world']}-rank run)"
            out[(bench, r.get("ranks"), r.get("variant", r.get("impl")))].append(r)
    return out


def table_markdown(recs) -> None:
    table = rows(recs)
    ratio_fields = sorted({k for r in recs for k in r if k.startswith(("ratio_vs_", "ratio_time_vs", "overhead_ratio"))})
    head = ["bench", "ranks", "impl", "runs", "ms median", "[min–max]"] + ratio_fields + ["bytes sent/rank"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (bench, ranks, impl), runs in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        meds = [r["median_ms"] for r in runs]
        lo, hi = min(r.get("min_ms", r["median_ms"]) for r in runs), max(r.get("max_ms", r["median_ms"]) for r in runs)
        cells = [bench, str(ranks), impl, str(len(runs)), f"{statistics.median(meds):.4g}", f"[{lo:.4g}–{hi:.4g}]"]
        cells += [_cell([r[f] for r in runs if r.get(f) is not None]) for f in ratio_fields]
        sent = runs[0].get("bytes_sent_per_rank")
        cells.append("—" if sent is None else str(sent))
        print("| " + " | ".join(cells) + " |")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--plot"]:
        from plots import plot_all

        for path in plot_all(load(args[2:]), args[1]):
            print(path)
        return
    table_markdown(load(args))


if __name__ == "__main__":
    main()
