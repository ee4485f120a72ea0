"""Rank 1 leaves with exit code argv[1] after one collective (printing when); rank 0 goes on
into the next collective, which rank 1 never joins."""
import sys
import time

import torch

import autopar as dist

mesh = dist.ProcessMesh([0, 1])
t = dist.shard_tensor(torch.ones(4), mesh, [dist.Shard(0)])
print("first read", dist.unshard_dtensor(t).tolist())
if dist.get_rank() == 1:
    print(f"leaving at {time.time()}")
    sys.exit(int(sys.argv[1]))
print("second read", dist.unshard_dtensor(t * 2).tolist())
print("rank 0 outlived rank 1")
