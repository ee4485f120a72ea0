"""A correct two-rank job: one sharded op and a value read, then a normal exit."""
import torch

import autopar as dist

mesh = dist.ProcessMesh([0, 1])
t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
print("sum", (t * 2).sum().item())
