"""A reduce-scatter of host tensors goes as an all-to-all of the pieces and a local reduction
(gloo's own copies its input and all-reduces all of it): each member gets the members' pieces
reduced in mesh order, bit for bit, and the log records one reduce-scatter of its bytes."""
import pytest
import torch

import autopar as dist
from autopar import comm
from distpool import run_dist


def _term(rank: int) -> torch.Tensor:
    return torch.sin(torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) * (rank + 1.7)) * 3


def _host_reduce_scatters():
    me, k = dist.get_rank(), torch.distributed.get_world_size()
    ranks = tuple(range(k))
    terms = [_term(r) for r in range(k)]
    pieces = torch.stack([t.chunk(k)[me] for t in terms])
    total = pieces[0] + pieces[1] if k == 2 else pieces.sum(0)
    with dist.comm_log() as log:
        got = {"sum": comm.reduce_scatter(terms[me], ranks),
               "sum started": comm.reduce_scatter_start(terms[me], ranks).wait(),
               "avg started": comm.reduce_scatter_start(terms[me], ranks, dist.ReduceType.AVG).wait(),
               "max": comm.reduce_scatter(terms[me], ranks, dist.ReduceType.MAX)}
    want = {"sum": total, "sum started": total, "avg started": total / k, "max": pieces.amax(0)}
    same = {name: torch.equal(got[name], want[name]) for name in want}
    return same, [(r.op, r.bytes) for r in log], terms[me].chunk(k)[me].numel() * 4


@pytest.mark.parametrize("k", [2, 3])
def test_host_reduce_scatter_is_the_mesh_order_reduction(k):
    for same, ops, piece in run_dist(_host_reduce_scatters, k):
        assert all(same.values()), same
        assert ops == [("reduce_scatter", (k - 1) * piece)] * 4, ops
