import time, torch, autopar as dist
import autopar.comm.collectives as CC
from autopar.comm import all_reduce
torch.set_num_threads(1)
r = dist.get_rank()
all_reduce(torch.ones(1), (0, 1))
x = torch.randn(160, 160)
res = {}
for rep in range(5):
    for n in (1, 2, 8, 16, 64):
        for skew in (0, 1):
            for gathered in (True, False):
                CC.GATHERED_ALL_REDUCE_BYTES = (1 << 20) if gathered else 0
                t = torch.ones(n)
                for _ in range(5): all_reduce(t, (0, 1))
                tot = []
                for _ in range(80):
                    for _ in range(2 + (3 * r if skew else 0)): x @ x
                    s = time.perf_counter(); all_reduce(t, (0, 1)); tot.append(time.perf_counter() - s)
                tot.sort()
                res.setdefault((n * 4, skew, gathered), []).append(tot[40] * 1e6)
if r == 0:
    for (b, skew, g), v in sorted(res.items()):
        v = sorted(v)
        print(f"{b:>5} B {'skew' if skew else 'lock'} {'gathered' if g else 'gloo    '} median {v[2]:.0f} us  range {v[0]:.0f}-{v[-1]:.0f}")
