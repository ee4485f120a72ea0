"""Every rank contributes its rank to a gloo all_reduce and prints the sum."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.tensor([dist.get_rank()])
dist.all_reduce(x)
print(f"allreduce rank={dist.get_rank()} world={dist.get_world_size()} sum={x.item()}")
dist.destroy_process_group()
