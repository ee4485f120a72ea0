import torch, time, autopar as dist
mesh = dist.ProcessMesh([0, 1])
t = dist.shard_tensor(torch.ones(4), mesh, [dist.Shard(0)])
if dist.get_rank() == 1:
    raise RuntimeError("boom from rank 1")
time.sleep(1)
print(dist.unshard_dtensor(t))
