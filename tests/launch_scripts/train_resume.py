"""Data-parallel training that saves every step and resumes from its checkpoint after a restart.

argv: CKPT_DIR LOSS_FILE STEPS [KILL_STEP WHO]. A tiny MLP with dropout, AdamW, every rank
taking its slice of each batch (shard_tensor over "dp"). After step s, the model, the optimizer, the
random number generator and the step counter are saved to CKPT_DIR (save_state_dict swaps a
complete checkpoint into that path atomically, so it existing means it is complete). A start
finds it and resumes at the saved step. Rank 0 appends "attempt step world loss" to LOSS_FILE
(repr of the float, compared bit for bit). On the first attempt only, at step KILL_STEP (once
its loss is known: every rank has logged the step before), WHO dies by SIGKILL: a rank number,
or "node": the ranks of the launcher whose pid is in the file $TRAIN_LOSE_LAUNCHER kill that
launcher and then themselves (a node lost for good).
"""
import os
import signal
import sys
import time

import torch

import autopar as dist

ckpt, loss_file, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
kill_step, who = (int(sys.argv[4]), sys.argv[5]) if len(sys.argv) > 5 else (-1, "")
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def doomed() -> bool:
    if who != "node":
        return dist.get_rank() == int(who)
    deadline = time.monotonic() + 30  # the test names the launcher once it knows which one to lose
    while not os.path.exists(os.environ["TRAIN_LOSE_LAUNCHER"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    with open(os.environ["TRAIN_LOSE_LAUNCHER"]) as f:
        return os.getppid() == int(f.read())


world = dist.get_world_size()
mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.25),
                            torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = dist.parallelize(model, opt, mesh, {"dp_config": {"sharding_level": 0}})
data = torch.randn(16, 12, 8, generator=torch.Generator().manual_seed(1))  # batch s is data[s % 16]
targets = torch.randn(16, 12, 4, generator=torch.Generator().manual_seed(2))


def state(step):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


start = 0
if os.path.exists(ckpt):
    saved = state(0)
    dist.load_state_dict(saved, ckpt)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])
    start = saved["step"]

for step in range(start, steps):
    x = dist.shard_tensor(data[step % 16], mesh, [dist.Shard(0)])
    y = dist.shard_tensor(targets[step % 16], mesh, [dist.Shard(0)])
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.item()
    if attempt == 0 and step == kill_step and doomed():
        if who == "node":
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.save_state_dict(state(step + 1), ckpt)
    if dist.get_rank() == 0:
        with open(loss_file, "a") as f:
            f.write(f"{attempt} {step} {world} {value!r}\n")
