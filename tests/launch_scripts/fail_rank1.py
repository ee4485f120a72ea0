"""Rank 1 raises after init; rank 0 writes its pid to argv[1] and blocks in argv[2] ("sleep" or "barrier")."""
import os
import sys
import time

import torch.distributed as dist

pid_file, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("boom from rank 1")
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
if mode == "barrier":
    dist.barrier()
else:
    time.sleep(60)
print("rank 0 outlived rank 1")
