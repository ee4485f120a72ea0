"""Each rank prints its pid, writes argv[1]/ready<rank> and waits (at most 60 s) for argv[1]/go,
then joins an all_reduce: a job that runs while a test looks at, or attacks, its launcher."""
import os
import sys
import time

import torch
import torch.distributed as dist

folder = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(folder, f"ready{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
x = torch.tensor([rank])
dist.all_reduce(x)
print(f"sum={x.item()}")
dist.destroy_process_group()
