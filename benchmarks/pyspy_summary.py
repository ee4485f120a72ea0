"""Summarise py-spy raw (collapsed) stacks: self and inclusive share per Python function.

    py-spy record -r 2000 -f raw -o /tmp/add.txt -- python benchmarks/profile_dispatch.py --no-cprofile --op add
    python benchmarks/pyspy_summary.py /tmp/add.txt [--under loop] [--top 25]

Only samples whose stack passes through a frame named `--under` are counted (default: the
timed loop of profile_dispatch.py), so start-up and warm-up do not dilute the shares.
Native (C++) time is charged to the innermost Python frame (py-spy without --native).
"""
from __future__ import annotations

import argparse
import collections
import re


def frame_name(frame: str) -> str:
    # py-spy frames look like "func (path/to/file.py:123)"; strip the line number
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame.strip())
    if not m:
        return frame.strip()
    func, path = m.groups()
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{func}"


def frame_line(frame: str) -> str:
    m = re.match(r"(.*) \((.*?)\)$", frame.strip())
    if not m:
        return frame.strip()
    func, where = m.groups()
    for marker in ("site-packages/", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{where} {func}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--under", default="loop")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    self_n, incl_n, lines_n = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in open(args.file):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        names = [frame_name(f) for f in frames]
        idx = [i for i, n in enumerate(names) if n.endswith(args.under)]
        if not idx:
            continue
        names = names[idx[0]:]
        c = int(count)
        total += c
        self_n[names[-1]] += c
        lines_n[frame_line(frames[-1])] += c
        for n in set(names):
            incl_n[n] += c
    print(f"{total} samples under {args.under!r}")
    print(f"{'self%':>6} {'incl%':>6}  function")
    for name, c in self_n.most_common(args.top):
        print(f"{100 * c / total:6.1f} {100 * incl_n[name] / total:6.1f}  {name}")
    print("\nhottest lines (self):")
    for name, c in lines_n.most_common(args.top):
        print(f"{100 * c / total:6.1f}  {name}")
    print("\ninclusive (top):")
    for name, c in incl_n.most_common(args.top):
        print(f"{100 * c / total:6.1f}  {name}")


if __name__ == "__main__":
    main()
