"""A correct two-rank job: one sharded op and a value read, then a normal exit; rank 0 stays
argv[1] seconds longer (default 0) after the last collective, as a rank writing a plot does."""
import sys
import time

import torch

import autopar as dist

mesh = dist.ProcessMesh([0, 1])
t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
print("sum", (t * 2).sum().item())
if dist.get_rank() == 0:
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
