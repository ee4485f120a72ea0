"""A parameter's gradient is placed like the parameter (or Partial where it is Replicate), never larger."""
import torch

import autopar as dist
from autopar.placement import Replicate, Shard
from distpool import run_dist

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=g), torch.randn(3, 4, generator=g)


def _sum_of_sharded_output():
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    w_full, x = _inputs()
    w = dist.shard_tensor(torch.nn.Parameter(w_full), mesh, [S1])
    torch.sum(x @ w).backward()
    # a column-split Linear whose output is summed: the weight's gradient stays split too
    lin = torch.nn.Linear(4, 6)
    lin.weight = torch.nn.Parameter(w_full.t().contiguous())
    lin = dist.shard_layer(lin, mesh, lambda n, sub, m: setattr(sub, "weight", dist.shard_tensor(sub.weight, m, [S0])) if n == "" else None)
    lin(x).sum().backward()
    return [(t.grad.placements, tuple(t.grad.local_value().shape), dist.unshard_dtensor(t.grad)) for t in (w, lin.weight, lin.bias)]


def test_gradient_of_a_summed_sharded_output_stays_sharded():
    w_full, x = _inputs()
    w = w_full.clone().requires_grad_(True)
    torch.sum(x @ w).backward()
    lin = torch.nn.Linear(4, 6)
    lin.weight = torch.nn.Parameter(w_full.t().contiguous())
    lin(x).sum().backward()
    ref = [w.grad, lin.weight.grad, lin.bias.grad]
    for rank, got in enumerate(run_dist(_sum_of_sharded_output, 2)):
        (wp, wshape, wg), (lp, lshape, lg), (bp, bshape, bg) = got
        assert (wp, wshape) == ([S1], (4, 3)), (rank, wp, wshape)
        assert (lp, lshape) == ([S0], (3, 4)), (rank, lp, lshape)
        assert bp in ([R], [dist.Partial()]) and bshape == (6,), (rank, bp, bshape)
        for g, r in zip((wg, lg, bg), ref):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
