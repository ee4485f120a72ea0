"""Print the launcher-provided environment and argv of this rank as one JSON line."""
import json
import os
import sys

keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "AUTOPAR_DEVICES", "AUTOPAR_RDZV_TOKEN"]
print("ENV " + json.dumps({**{k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}))
