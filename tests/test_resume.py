"""Training resumed from a checkpoint continues with the losses of uninterrupted training."""
import numpy as np
import pytest
import torch

import autopar as dist
from autopar.placement import Shard
from distpool import run_dist


def _setup(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if kind == "tp":
        mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])

        def plan(name, sub, mesh):
            if name == "0":
                sub.weight = dist.shard_tensor(sub.weight, mesh, [Shard(0)])
            if name == "2":
                sub.weight = dist.shard_tensor(sub.weight, mesh, [Shard(1)])

        dist.shard_layer(model, mesh, plan)
        opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    else:
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        dist.shard_layer(model, mesh)
        opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05), dist.ShardingStage2("dp"))
    return model, opt, mesh


def _steps(model, opt, mesh, first, count, static=None):
    """`count` steps from step `first`; with `static` (a DistModel) as a captured program."""
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if "dp" in mesh.dim_names:
            x, y = dist.shard_tensor(x, mesh, [Shard(0)]), dist.shard_tensor(y, mesh, [Shard(0)])
        if static is not None:
            losses.append(float(static(x, y)))
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _resume(kind, path):
    model, opt, mesh = _setup(kind)
    straight = _steps(model, opt, mesh, 0, 5)

    model, opt, mesh = _setup(kind)
    first = _steps(model, opt, mesh, 0, 2)
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    del model, opt
    model, opt, mesh = _setup(kind)  # fresh run: new weights, empty optimizer state
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    resumed = first + _steps(model, opt, mesh, 2, 3)
    return straight, resumed


@pytest.mark.parametrize("kind", ["tp", "zero2"])
def test_resumed_training_continues_with_the_same_losses(kind, tmp_path):
    for straight, resumed in run_dist(_resume, 2, kind, str(tmp_path / "ckpt")):
        np.testing.assert_allclose(resumed, straight, rtol=1e-6)


def _resume_static(kind, path):
    """Static mode: a checkpoint loaded into the running model (rolling back one step) and
    into a fresh model both continue with the uninterrupted losses."""
    model, opt, mesh = _setup(kind)
    straight = _steps(model, opt, mesh, 0, 5)

    model, opt, mesh = _setup(kind)
    dm = dist.to_static(model, None, torch.nn.functional.mse_loss, opt)
    first = _steps(model, opt, mesh, 0, 2, dm)
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    _steps(model, opt, mesh, 2, 1, dm)  # a step to roll back
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    rolled_back = first + _steps(model, opt, mesh, 2, 3, dm)  # the same captured program

    model, opt, mesh = _setup(kind)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    fresh = first + _steps(model, opt, mesh, 2, 3, dist.to_static(model, None, torch.nn.functional.mse_loss, opt))
    return straight, rolled_back, fresh


@pytest.mark.parametrize("kind", ["tp", "zero2"])
def test_static_training_resumes_from_a_checkpoint(kind, tmp_path):
    for straight, rolled_back, fresh in run_dist(_resume_static, 2, kind, str(tmp_path / "ckpt")):
        np.testing.assert_allclose(rolled_back, straight, rtol=1e-6)
        np.testing.assert_allclose(fresh, straight, rtol=1e-6)
