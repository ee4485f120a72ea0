"""Every rank joins one collective; then rank argv[1] leaves with status argv[2] and the others
go on into a collective it never joins. argv[3] says how it leaves: "sys_exit" (default),
"os_exit" (no exit handlers, no stamp), or "linger" (sys.exit, but a non-daemon thread keeps
the process alive 20 s: its peers time out, with AUTOPAR_TIMEOUT short, before it is gone)."""
import os
import sys
import threading
import time

import torch

import autopar as dist

leaver, code = int(sys.argv[1]), int(sys.argv[2])
how = sys.argv[3] if len(sys.argv) > 3 else "sys_exit"
mesh = dist.ProcessMesh(list(range(dist.get_world_size())))
t = dist.shard_tensor(torch.ones(dist.get_world_size()), mesh, [dist.Shard(0)])
print("first read", dist.unshard_dtensor(t).tolist())
if dist.get_rank() == leaver:
    if how == "os_exit":
        os._exit(code)
    if how == "linger":
        threading.Thread(target=time.sleep, args=(20,)).start()
    sys.exit(code)
print("second read", dist.unshard_dtensor(t * 2).tolist())
