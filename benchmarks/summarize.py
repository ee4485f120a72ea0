"""One markdown table from the benchmarks' JSON lines (one or several runs), and plots.

    python benchmarks/summarize.py benchmarks/results/*.jsonl
    python benchmarks/summarize.py --plot benchmarks/plots benchmarks/results/*.jsonl
    python benchmarks/summarize.py --headline benchmarks/results/*.jsonl   # BENCHMARKS.md's first table

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
import re
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


# (goal, measurement files, bench names (prefixes), autopar impls, ratio field, target: the ratio at most)
HEADLINE = [
    ("per-op overhead, ops in a module's forward (a local region), 1 rank", ("dispatch_1rank",), ("dispatch",), ("autopar_module",), "overhead_ratio_vs_dtensor", 0.5),
    ("per-op overhead, a captured step (`to_static`), 1 rank", ("dispatch_1rank",), ("dispatch",), ("autopar_static",), "overhead_ratio_vs_dtensor", 0.5),
    ("per-op overhead, one op at a time at top level, 1 rank", ("dispatch_1rank",), ("dispatch",), ("autopar",), "overhead_ratio_vs_dtensor", 0.5),
    ("reshard S(0)->S(1), 16 MiB, 4 ranks (all-to-all, 1/4 of the bytes)", ("reshard_4ranks",), ("reshard_S0->S1",), ("autopar",), "ratio_vs_dtensor", 1.0),
    ("reshard S(0)->R, P->R, P->S(0), R->S(0), 16 MiB, 4 ranks", ("reshard_4ranks",), ("reshard_S0->R", "reshard_P->R", "reshard_P->S0", "reshard_R->S0"), ("autopar",), "ratio_vs_dtensor", 1.0),
    ("tensor-parallel MLP step, 2 ranks", ("tp_mlp_2ranks",), ("tp_mlp",), ("autopar",), "ratio_vs_dtensor", 1.0),
    ("tensor-parallel MLP step, 4 ranks", ("tp_mlp_4ranks",), ("tp_mlp",), ("autopar",), "ratio_vs_dtensor", 1.0),
    ("GPT 3.7 M, data parallel, 2 ranks: dynamic", ("gpt_3m7_2ranks",), ("gpt",), ("autopar_dp",), "ratio_vs_ddp", 1.0),
    ("GPT 3.7 M, data parallel, 2 ranks: static", ("gpt_3m7_2ranks",), ("gpt",), ("autopar_dp_static",), "ratio_vs_ddp", 1.0),
    ("GPT 3.7 M, tensor parallel, 2 ranks: dynamic / static", ("gpt_3m7_2ranks",), ("gpt",), ("autopar_dptp", "autopar_dptp_static"), "ratio_vs_dtensor_dptp", 1.0),
    ("GPT tiny, data parallel, 2 ranks: dynamic", ("gpt_2ranks",), ("gpt",), ("autopar_dp",), "ratio_vs_ddp", 1.0),
    ("GPT tiny, data parallel, 4 ranks on 2 cores: dynamic", ("gpt_4ranks",), ("gpt",), ("autopar_dp",), "ratio_vs_ddp", 1.0),
    ("GPT tiny, data parallel, 2 / 4 ranks: static", ("gpt_2ranks", "gpt_4ranks"), ("gpt",), ("autopar_dp_static",), "ratio_vs_ddp", 1.0),
    ("GPT tiny, dp x tp 2x2, 4 ranks: dynamic / static", ("gpt_4ranks",), ("gpt",), ("autopar_dptp", "autopar_dptp_static"), "ratio_vs_dtensor_dptp", 1.0),
    ("GPT 3.7 M, 4 micro-batches accumulated, 2 ranks", ("gpt_accum4_3m7_2ranks",), ("gpt",), ("autopar_dp_accum",), "ratio_vs_ddp_accum_no_sync", 1.0),
    ("AdamW step over TP-placed GPT parameters (dim 256 and 64), 2 ranks", ("optim_2ranks", "optim_small_2ranks"), ("adamw",), ("autopar",), "ratio_vs_dtensor", 1.0),
    ("HF Llama data parallel (ZeRO level 0), 2 ranks", ("zero_2ranks",), ("zero",), ("autopar_z0",), "ratio_time_vs_ddp", 1.0),
    ("HF Llama ZeRO-3, 2 ranks", ("zero_2ranks",), ("zero",), ("autopar_z3",), "ratio_time_vs_fsdp2", 1.1),
    ("HF Llama ZeRO-3, 4 ranks on 2 cores", ("zero_4ranks",), ("zero",), ("autopar_z3",), "ratio_time_vs_fsdp2", 1.1),
    ("HF Llama ZeRO-1 / ZeRO-2 against autopar's level 0, 2 ranks", ("zero_2ranks",), ("zero",), ("autopar_z1", "autopar_z2"), "ratio_time_vs_autopar_z0", 1.25),
    ("pipeline 1F1B, 8 micro-batches, 2 stages", ("pipeline_2ranks",), ("pipeline",), ("autopar_1f1b",), "ratio_vs_torch_1f1b", 1.0),
    ("pipeline, 4 ranks on 2 cores, 2 stages each, 8 micro-batches: interleaved 1F1B", ("pipeline_4ranks",), ("pipeline",), ("autopar_vpp",), "ratio_vs_torch_interleaved", 0.9),
    ("pipeline, 4 ranks on 2 cores, 2 stages each, 8 micro-batches: interleaved zero bubble", ("pipeline_4ranks",), ("pipeline",), ("autopar_zbvpp",), "ratio_vs_torch_interleaved_zb", 0.9),
    ("ResNet data parallel with global BatchNorm, 2 ranks", ("resnet_2ranks",), ("resnet",), ("autopar_dp",), "ratio_vs_ddp_syncbn", 1.0),
    ("Mixtral MoE layer, expert parallel, 2 ranks", ("moe_2ranks",), ("moe_layer",), ("autopar",), "ratio_vs_hand_all_to_all", 1.0),
    ("context parallel attention, ring / Ulysses, 2 ranks", ("cp_2ranks",), ("context_parallel_attention",), ("ring", "ulysses"), "ratio_vs_gathered", 1.0),
    ("context parallel attention, ring / Ulysses, 4 ranks on 2 cores", ("cp_4ranks",), ("context_parallel_attention",), ("ring", "ulysses"), "ratio_vs_gathered", 1.0),
]
PEER_OF = {"overhead_ratio_vs_dtensor": "DTensor's overhead", "ratio_vs_dtensor": "DTensor", "ratio_vs_ddp": "DDP",
           "ratio_vs_dtensor_dptp": "DTensor", "ratio_vs_ddp_accum_no_sync": "DDP with no_sync",
           "ratio_time_vs_fsdp2": "FSDP2", "ratio_time_vs_ddp": "DDP", "ratio_time_vs_autopar_z0": "autopar ZeRO-0",
           "ratio_vs_torch_1f1b": "torch.distributed.pipelining",
           "ratio_vs_torch_interleaved": "torch's ScheduleInterleaved1F1B",
           "ratio_vs_torch_interleaved_zb": "torch's ScheduleInterleavedZeroBubble", "ratio_vs_ddp_syncbn": "DDP + SyncBatchNorm",
           "ratio_vs_hand_all_to_all": "the dispatch by hand (all_to_all_single)",
           "ratio_vs_gathered": "sdpa on gathered K/V (autopar's rule without context parallel)"}


def commands(run_all: str) -> dict:
    """{measurement name: its command} from run_all.sh's `run NAME COMMAND` lines."""
    out = {}
    for line in open(run_all):
        m = re.match(r"\s*run\s+(\S+)\s+(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).replace('"$bench/', "benchmarks/").replace('.py"', ".py")
    return out


def headline_markdown(recs) -> None:
    """One row per goal: the ratio's median over runs (and cases), its range, the target, met."""
    cmds = commands(os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_all.sh"))
    print("| goal | against | ratio (range) | target | met | command |")
    print("|---|---|---|---|---|---|")
    for goal, names, benches, impls, field, target in HEADLINE:
        def values(impls):
            return [r[field] for r in recs if r["_name"] in names and r["bench"].startswith(benches)
                    and (r.get("variant") or r.get("impl")) in impls and r.get(field) is not None]

        vals = values(impls)
        if not vals:
            continue
        per_impl = [values((impl,)) for impl in impls]
        met = " / ".join("yes" if v and statistics.median(v) <= target else "**no**" for v in per_impl)
        cmd = " ; ".join(f"`{cmds[n]}`" for n in names if n in cmds)
        ratios = " / ".join(_cell(v) for v in per_impl)
        print(f"| {goal} | {PEER_OF.get(field, field)} | {ratios} | <= {target} | {met} | {cmd} |")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--headline"]:
        headline_markdown(load(args[1:]))
        return
    if args[:1] == ["--plot"]:
        from plots import plot_all

        for path in plot_all(load(args[2:]), args[1]):
            print(path)
        return
    table_markdown(load(args))


if __name__ == "__main__":
    main()
