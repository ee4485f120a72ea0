"""The plots BENCHMARKS.md embeds, drawn from the benchmarks' JSON lines (matplotlib, PNG).

    python benchmarks/summarize.py --plot benchmarks/plots benchmarks/results/*.jsonl

Every bar is the median over runs of each run's figure; a whisker spans the runs' range.
"""
from __future__ import annotations

import os
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEERS = ("dtensor", "dtensor_dptp", "ddp", "ddp_syncbn", "fsdp2", "torch_1f1b")


def _median_range(values: list) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _group(recs: list, keep) -> dict:
    """{(bench, ranks, impl): [rec per run]} for the records `keep` accepts."""
    out = defaultdict(list)
    for r in recs:
        if "median_ms" in r and keep(r):
            out[(r["bench"] if r["bench"].startswith(("dispatch", "reshard", "scaling")) else r["_name"],
                 r.get("ranks"), r.get("variant") or r.get("impl"))].append(r)
    return out


def _bars(ax, labels: list, stats: list, xlabel: str, reference: float | None = None) -> None:
    meds = [m for m, _, _ in stats]
    err = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
    ax.barh(range(len(labels)), meds, xerr=err, color="#4c72b0", ecolor="#333", capsize=2)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if reference is not None:
        ax.axvline(reference, color="#c44e52", lw=1)


def plot_peer_ratios(recs: list, path: str) -> bool:
    """autopar's step time over the torch peer's (DTensor, DDP, FSDP2, pipelining), per workload."""
    labels, stats = [], []
    for (bench, ranks, impl), runs in sorted(_group(recs, lambda r: not r["bench"].startswith("dispatch")).items(),
                                             key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        for peer in PEERS:
            vals = [r[f] for r in runs for f in (f"ratio_vs_{peer}", f"ratio_time_vs_{peer}") if r.get(f) is not None]
            if vals and str(impl).startswith("autopar"):
                labels.append(f"{bench} {impl.replace('autopar_', '')} vs {peer}")
                stats.append(_median_range(vals))
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(labels) + 1.2))
    _bars(ax, labels, stats, "time / peer's time (below 1: autopar faster)", reference=1.0)
    ax.set_title("autopar vs torch peers, same run, same machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_dispatch(recs: list, path: str) -> bool:
    """Per-op overhead (time above the plain op) for each way of running an op, per case."""
    groups = _group(recs, lambda r: r["bench"].startswith("dispatch") and "us_per_op" in r)
    cases = sorted({(b, k) for b, k, _ in groups})
    if not cases:
        return False
    impls = ["autopar", "dispatch_floor", "autopar_module", "autopar_static", "dtensor"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(cases) + 1.5))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        ys, xs = [], []
        for c, (bench, ranks) in enumerate(cases):
            # every distributed run computes on the local pieces: the plain op on those shapes
            plain = [r["us_per_op"] for r in groups.get((bench, ranks, "plain_local"), groups.get((bench, ranks, "plain"), []))]
            mine = [r["us_per_op"] for r in groups.get((bench, ranks, impl), [])]
            if plain and mine:
                ys.append(c + n * width)
                xs.append(statistics.median(mine) - statistics.median(plain))
        ax.barh(ys, xs, height=width, label=impl)
    ax.set_yticks([c + 0.4 - width / 2 for c in range(len(cases))],
                  [f"{b.replace('dispatch_', '')} ({k} rank{'s' if k > 1 else ''})" for b, k in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("overhead per op, µs (time minus the plain torch op on the local shapes)")
    ax.legend(fontsize=8)
    ax.set_title("per-op overhead")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_reshard(recs: list, path: str) -> bool:
    """Reshard time and bytes sent per rank, autopar vs DTensor vs the raw collective."""
    groups = _group(recs, lambda r: r["bench"].startswith("reshard_") and "small" not in r["bench"]
                    and "cross" not in r["bench"])
    benches = sorted({b for b, _, _ in groups})
    if not benches:
        return False
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 0.5 * len(benches) + 1.5), sharey=True)
    impls = [("autopar", "autopar"), ("dtensor", "dtensor"), ("raw_collective", "raw collective")]
    width = 0.8 / len(impls)
    for n, (impl, label) in enumerate(impls):
        ys, ts, bs = [], [], []
        for c, bench in enumerate(benches):
            runs = next((v for (b, _, i), v in groups.items() if b == bench and i == impl), [])
            if runs:
                ys.append(c + n * width)
                ts.append(statistics.median(r["median_ms"] for r in runs))
                bs.append(runs[0].get("bytes_sent_per_rank", 0) / 2**20)
        ax_t.barh(ys, ts, height=width, label=label)
        ax_b.barh(ys, bs, height=width, label=label)
    ax_t.set_yticks([c + 0.4 - width / 2 for c in range(len(benches))], [b.replace("reshard_", "") for b in benches])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("ms (median)")
    ax_b.set_xlabel("MiB sent per rank")
    ax_t.legend(fontsize=8)
    fig.suptitle("reshard of a 2048x2048 fp32 tensor on 4 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_scaling(recs: list, path: str) -> bool:
    """TP MLP step time over width, one line per rank count, with the one-process step."""
    groups = _group(recs, lambda r: r["bench"] == "scaling_tp_mlp")
    by_ranks = defaultdict(dict)
    plain = {}
    for runs in groups.values():
        for r in runs:
            by_ranks[r["ranks"]].setdefault(r["hidden"], []).append(r["median_ms"])
            plain.setdefault(r["hidden"], []).append(r["plain_median_ms"])
    if not by_ranks:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    hs = sorted(plain)
    ax.plot(hs, [statistics.median(plain[h]) for h in hs], "k--", label="one process")
    for ranks in sorted(by_ranks):
        h = sorted(by_ranks[ranks])
        ax.plot(h, [statistics.median(by_ranks[ranks][x]) for x in h], "o-", label=f"autopar TP, {ranks} ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden size (ffn = 4 x hidden)")
    ax.set_ylabel("step ms")
    ax.legend(fontsize=8)
    ax.set_title("TP MLP step over width")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_all(recs: list, out_dir: str) -> list:
    """Write every plot the records allow into `out_dir`; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fn in (("peer_ratios", plot_peer_ratios), ("dispatch", plot_dispatch), ("reshard", plot_reshard),
                     ("scaling", plot_scaling)):
        path = os.path.join(out_dir, f"{name}.png")
        if fn(recs, path):
            written.append(path)
    return written
