"""Every rank joins one collective; then rank argv[1] leaves with status argv[2] and the others
go on into a collective it never joins. argv[3] says how it leaves: "sys_exit" (default),
"os_exit" (no exit handlers, no stamp), or "linger": sys.exit, then at exit it closes its
groups (its peers fail at once) and stays alive 20 s, so that they end before it does."""
import atexit
import os
import sys
import time

import torch

import autopar as dist
from autopar.comm.backend import destroy_groups

leaver, code = int(sys.argv[1]), int(sys.argv[2])
how = sys.argv[3] if len(sys.argv) > 3 else "sys_exit"
if how == "linger" and os.environ["RANK"] == str(leaver):
    atexit.register(time.sleep, 20)  # registered before autopar's exit handler: runs after it
    atexit.register(destroy_groups)
mesh = dist.ProcessMesh(list(range(dist.get_world_size())))
t = dist.shard_tensor(torch.ones(dist.get_world_size()), mesh, [dist.Shard(0)])
print("first read", dist.unshard_dtensor(t).tolist())
if dist.get_rank() == leaver:
    if how == "os_exit":
        os._exit(code)
    sys.exit(code)
print("second read", dist.unshard_dtensor(t * 2).tolist())
