"""torch's OpInfo database through autopar on 2 ranks, a few cases of every op: a wrong value fails.

The suite's cut of benchmarks/opinfo_sweep.py (which runs ten samples of every op in three
placements beside DTensor, docs/opinfo.md), with its case building and comparison: per op, in
fp32 its first sample split on dim 0 and its second on its last dim, in complex64 its first
split on its last dim (an op without fp32: its first dtype instead), forward and gradient, each
against the single process.  Errors (autopar refusing) are counted and printed, not failed.
KNOWN_WRONG lists the cases wrong today: each must still be wrong, so a fix fails this test
until its entry goes."""
import collections
import os
import sys

import distpool
from distpool import run_dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import opinfo_sweep as sweep  # noqa: E402

# (OpInfo name, placement, "fwd" | "grad"): why it is wrong, one line.  Empty at cb93751: the
# conj views, hfftn/hfft2, eig's gradient, embedding(max_norm) and complex pinv/lstsq cases wrong
# before are right now.
KNOWN_WRONG: dict = {}

CHUNKS = 6  # run_dist calls, each well inside the pool's task deadline


def _run(sel):
    """Every case of `sel`; where the ranks raised differently and their collectives no longer
    pair up, the pool restarts and the cases go on after it."""
    records, start = [], (0, 0)
    while start is not None:
        res = run_dist(sweep.run_units, 2, sel, start)[0]
        records += res["records"]
        start = res["restart"]
        if start is not None:
            distpool.shutdown(2)
    return records


def test_opinfo_fast():
    records = []
    for i in range(CHUNKS):
        records += _run(sweep.Selection(chunk=(i, CHUNKS), fast=True, libs=("autopar",)))
    cases = [r for r in records if r["class"] != "skip"]
    counts = collections.Counter(r["class"] for r in cases)
    print(f"{len(cases)} cases of {len({r['op'] for r in cases})} ops: "
          + ", ".join(f"{k} {counts[k]}" for k in sweep.SEVERITY))
    errors = collections.Counter(sweep._norm(r["msg"]) for r in cases if r["class"] == "error")
    for msg, n in errors.most_common():
        print(f"  error x{n}: {msg}")

    # every op was tried; one without a case only because it cannot run here (CUDA only, or
    # its samples are sparse: see sweep.SPARSE)
    want = {sweep.full_name(op) for op in sweep.op_db()}
    assert want == {r["op"] for r in records}, sorted(want ^ {r["op"] for r in records})
    uncovered = want - {r["op"] for r in cases}
    why = {r["msg"] for r in records if r["op"] in uncovered}
    print(f"ops without a case ({len(uncovered)}): {sorted(uncovered)}")
    assert all(m in (sweep.SPARSE, "no CPU dtype") or m.startswith("single process:") for m in why), why

    bad = {}
    for r in cases:
        if r["class"] in ("wrong", "crash"):
            bad.setdefault((r["op"], r["placement"], r["kind"]), []).append(
                f"{r['dtype']} sample {r['sample']}: {r['class']}, {r['msg']}")
    unexpected = {k: v for k, v in bad.items() if k not in KNOWN_WRONG}
    assert not unexpected, "wrong cases:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(unexpected.items()))
    fixed = sorted(set(KNOWN_WRONG) - set(bad))
    assert not fixed, f"right now: remove them from KNOWN_WRONG: {fixed}"
