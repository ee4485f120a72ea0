"""A pair's small all-reduce, gathered (section 14's rule) or through gloo's own all_reduce.

    python -m autopar.launch --nproc_per_node 2 gathered_or_gloo.py bytes      # float32, 4 B to 256 B
    python -m autopar.launch --nproc_per_node 2 gathered_or_gloo.py elements   # 1 (int64), 3, 4, 6 elements

lock: both ranks compute alike between calls; skew: rank 1 computes 2.5x rank 0's.  Each line:
the median of 5 medians of 80 calls, and the range of the 5.
"""
import sys
import time

import torch

import autopar as dist
import autopar.comm.collectives as CC
from autopar.comm import all_reduce

torch.set_num_threads(1)
r = dist.get_rank()
all_reduce(torch.ones(1), (0, 1))
x = torch.randn(160, 160)
by_elements = sys.argv[1] == "elements"
sizes = (1, 3, 4, 6) if by_elements else (1, 2, 8, 16, 64)
res = {}
for rep in range(5):
    for n in sizes:
        for skew in (0, 1):
            for gathered in (True, False):
                CC.GATHERED_ALL_REDUCE_BYTES = (1 << 20) if gathered else 0
                t = torch.ones(n, dtype=torch.int64 if by_elements and n == 1 else torch.float32)
                for _ in range(5):
                    all_reduce(t, (0, 1))
                tot = []
                for _ in range(80):
                    for _ in range(2 + (3 * r if skew else 0)):
                        x @ x
                    s = time.perf_counter()
                    all_reduce(t, (0, 1))
                    tot.append(time.perf_counter() - s)
                tot.sort()
                res.setdefault((n if by_elements else n * 4, skew, gathered), []).append(tot[40] * 1e6)
if r == 0:
    for (size, skew, g), v in sorted(res.items()):
        v = sorted(v)
        print(f"{size:>5} {'el' if by_elements else 'B '} {'skew' if skew else 'lock'} {'gathered' if g else 'gloo    '} "
              f"median {v[2]:.0f} us  range {v[0]:.0f}-{v[-1]:.0f}")
