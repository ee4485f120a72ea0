"""A tqdm bar on stderr between two stdout lines, on every rank."""
import os
import time

from tqdm import tqdm

print(f"start rank {os.environ['RANK']}", flush=True)
for _ in tqdm(range(5), desc="train", mininterval=0, ascii=True, bar_format="{desc} {n_fmt}/{total_fmt}"):
    time.sleep(0.05)
print(f"end rank {os.environ['RANK']}", flush=True)
