"""ZeRO's collectives per step on units wider than DDP's 1 MiB first bucket: a ZeRO-3 unit
reduce-scatters all its gradients in one collective once its backward is done (they are all
ready at once: a small first bucket would only add a collective), with the numbers of one
process."""
import torch

import autopar as dist
from distpool import run_dist

WIDTH = 384  # two 384x384 weights and biases: 1.2 MB of gradients per block, over DDP's 1 MiB


class _Wide(torch.nn.Module):
    """Two blocks in a ModuleList (ZeRO-3: a unit each) and a head outside it (a third)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH))
            for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, WIDTH, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _train(model, opt, data, place=lambda t: t):
    losses, logs = [], []
    for x, y in data:
        with dist.comm_log() as log:
            loss = torch.nn.functional.mse_loss(model(place(x)), place(y))
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logs.append([(r.op, r.bytes) for r in log])
    return losses, logs, {k: dist.unshard_dtensor(v.detach()) if isinstance(v, dist.DistTensor) else v.detach()
                          for k, v in model.state_dict().items()}


def _zero3(steps):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(_Wide(), mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dist.ShardingStage3("dp"))
    return _train(model, opt, _data(steps), lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)]))


def test_zero3_unit_reduces_its_gradients_in_one_collective():
    model = _Wide()
    ref_losses, _, ref_weights = _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _data(3))
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    head = sum(p.numel() for p in model.head.parameters()) * 4
    for losses, logs, weights in run_dist(_zero3, 2, 3):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        for log in logs[1:]:  # (the first step's regions verify)
            scatters = sorted(b for op, b in log if op == "reduce_scatter")
            assert scatters == sorted([block // 2] * 2 + [head // 2]), log  # one per unit: half its bytes sent
