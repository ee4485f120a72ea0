"""Activation checkpointing (torch.utils.checkpoint, both forms, and HF's switch) against one process.

A checkpointed block is run again in backward: whatever path its forward took (local region
or op by op), the recomputation must take too, with the same values.
"""
import contextlib

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import autopar as dist
import autopar.runtime.local_region as lr
from autopar.placement import Replicate, Shard
from distpool import run_dist
from hf_llama import assert_matches, batches, mp_plan, optimizer, reference, tiny_llama, train

R, S0 = Replicate(), Shard(0)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Net(torch.nn.Module):
    """A stem, two checkpointed blocks and a head: the stem's gradient flows through both."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.stem, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]


def _fit(model, opt, mesh=None):
    losses, grads = [], []
    for x, y in _data():
        if mesh is not None:
            x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads.append({k: dist.unshard_dtensor(p.grad) for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _net_on_mesh(reentrant, regions, ranks):
    mesh = dist.ProcessMesh(ranks, dim_names=["dp"])
    model = dist.shard_layer(_Net(reentrant), mesh)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    with contextlib.nullcontext() if regions else lr.local_regions(False):
        return _fit(model, opt, mesh)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("regions", [True, False])
@pytest.mark.parametrize("world,ranks", [(2, [0, 1]), (4, [0, 1])])
def test_checkpointed_blocks_match_one_process(reentrant, regions, world, ranks):
    model = _Net(reentrant)
    ref_losses, ref_grads = _fit(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for losses, grads in run_dist(_net_on_mesh, world, reentrant, regions, ranks):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for got, ref in zip(grads, ref_grads):
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


_MESHES = {"dp": ([0, 1], ["dp"]), "mp": ([0, 1], ["mp"]), "dpxmp": ([[0, 1], [2, 3]], ["dp", "mp"])}


def _hf_checkpointed(layout, regions):
    ids, names = _MESHES[layout]
    mesh = dist.ProcessMesh(ids, dim_names=names)
    config = {}
    if "dp" in names:
        config["dp_config"] = {"sharding_level": 0}
    if "mp" in names:
        config["mp_config"] = {"parallelize_plan": mp_plan()}
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    grads = []
    with contextlib.nullcontext() if regions else lr.local_regions(False):
        losses = train(model, opt, batches(), grads=grads)
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, grads


@pytest.mark.parametrize("regions", [True, False])
@pytest.mark.parametrize("layout", ["dp", "mp", "dpxmp"])
def test_hf_gradient_checkpointing_matches_one_process(layout, regions):
    ref_grads = []
    ref = (*reference(batches(), grads=ref_grads), ref_grads)
    world = 4 if layout == "dpxmp" else 2
    for got in run_dist(_hf_checkpointed, world, layout, regions):
        assert_matches(got, ref)
