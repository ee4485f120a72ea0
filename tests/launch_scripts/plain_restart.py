"""A plain torch.distributed job (no autopar): rank 1 dies (os._exit) after the first
all_reduce of the first attempt; the restarted attempt's process group must start afresh."""
import os

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
if attempt == 0 and dist.get_rank() == 1:
    os._exit(9)
dist.all_reduce(x)
print(f"attempt {attempt} sum={x.item()}")
dist.destroy_process_group()
