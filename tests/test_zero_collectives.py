"""ZeRO's collectives per step on gradients wider than DDP's 1 MiB first bucket, where they are
all ready at once (a small first bucket would only add a collective): a ZeRO-3 unit
reduce-scatters its gradients in one collective once its backward is done, ZeRO-1's pre-step
all of them in one; with the numbers of one process."""
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


def _zero(level, steps):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(_Wide(), mesh)
    stage = {1: dist.ShardingStage1, 3: dist.ShardingStage3}[level]
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stage("dp"))
    return _train(model, opt, _data(steps), lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)]))


def _reference():
    model = _Wide()
    losses, _, weights = _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _data(3))
    return model, losses, weights


def _check_numbers(got, ref):
    losses, _, weights = got
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[1]), rtol=1e-5, atol=1e-6)
    for k, v in ref[2].items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _scatters(log):
    return sorted(b for op, b in log if op == "reduce_scatter")


def test_zero3_unit_reduces_its_gradients_in_one_collective():
    ref = _reference()
    block = sum(p.numel() for p in ref[0].blocks[0].parameters()) * 4
    head = sum(p.numel() for p in ref[0].head.parameters()) * 4
    for got in run_dist(_zero, 2, 3, 3):
        _check_numbers(got, ref)
        for log in got[1][1:]:  # (the first step's regions verify)
            assert _scatters(log) == sorted([block // 2] * 2 + [head // 2]), log  # one per unit: half its bytes


def test_zero1_pre_step_reduces_every_gradient_in_one_collective():
    ref = _reference()
    total = sum(p.numel() for p in ref[0].parameters()) * 4
    for got in run_dist(_zero, 2, 1, 3):
        _check_numbers(got, ref)
        for log in got[1]:
            assert _scatters(log) == [total // 2], log
            assert [b for op, b in log if op == "all_gather"] == [total // 2], log


def _zero2_accumulating(steps, micro=2):
    """ZeRO-2, `micro` backwards per step: per backward its collectives and whether every
    gradient is a shard when it ends."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(_Wide(), mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dist.ShardingStage2("dp"))
    place = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)])  # noqa: E731
    logs, sharded = [], []
    for x, y in _data(steps):
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with dist.comm_log() as log:
                (torch.nn.functional.mse_loss(model(place(xs)), place(ys)) / micro).backward()
            logs.append([(r.op, r.bytes) for r in log if r.op not in ("send", "recv")])  # (the batch handed out)
            sharded.append(all(p.grad.placements == [dist.Shard(0)] for p in model.parameters() if p.dim()))
        opt.step()
        opt.zero_grad()
    return logs, sharded, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


def test_zero2_reduces_each_backward_in_one_collective_and_adds_the_shards():
    ref = _reference()
    total = sum(p.numel() for p in ref[0].parameters()) * 4
    for logs, sharded, weights in run_dist(_zero2_accumulating, 2, 3):
        for k, v in ref[2].items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        assert all(sharded), sharded  # no whole gradient outlives its backward
        for log in logs:
            assert [op for op, _ in log if op != "all_reduce"] == ["reduce_scatter"], log
            assert _scatters(log) == [total // 2], log
