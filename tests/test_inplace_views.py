"""In-place writes through views of distributed tensors, and in-place shape ops: the result
of one process, or an error naming the op and the placement -- never a lost write."""
import pytest
import torch

import autopar as dist
from autopar.placement import Replicate, Shard
from distpool import run_dist

CASES = {
    "select_add_": lambda t: t[0].add_(1),
    "view_mul_": lambda t: t.view(16).mul_(2),
    "column_zero_": lambda t: t[:, 1].zero_(),
    "t_add_": lambda t: t.t().add_(1),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "transpose_": lambda t: t.transpose_(0, 1),
    "squeeze_": lambda t: t.unsqueeze(0).squeeze_(0),
    "setitem_row": lambda t: t.__setitem__(0, 5.0),
    "setitem_columns": lambda t: t.__setitem__((slice(None), slice(2, 4)), 7.0),
    "reshape_add_": lambda t: t.reshape(4, 4).add_(1),
    "narrow_fill_": lambda t: t.narrow(1, 2, 4).fill_(3),
    "chained_views": lambda t: t.view(16)[2:6].add_(1),
}
PLACEMENTS = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}


def _all_cases():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    out = {}
    for pname, placements in PLACEMENTS.items():
        for name, fn in CASES.items():
            t = dist.shard_tensor(torch.arange(16.).reshape(2, 8), mesh, placements)
            try:
                result = fn(t)
                out[pname, name] = ("value", dist.unshard_dtensor(t), tuple(t.shape), dist.unshard_dtensor(result))
            except ValueError as e:
                out[pname, name] = ("error", str(e))
    return out


def test_in_place_writes_through_views_are_right_or_refused():
    results = run_dist(_all_cases, 2)
    refused = set()
    for (pname, name), got in results[0].items():
        ref = torch.arange(16.).reshape(2, 8)
        ref_result = CASES[name](ref)
        for rank_results in results:
            assert rank_results[pname, name][0] == got[0], (pname, name)  # every rank decides alike
        if got[0] == "error":
            refused.add((pname, name))
            assert "writes in place into a view" in got[1] and "placed [Shard(" in got[1], got[1]
            continue
        _, value, shape, result = got
        assert shape == tuple(ref.shape), (pname, name, shape)
        torch.testing.assert_close(value, ref, msg=f"{pname} {name}")
        torch.testing.assert_close(result, ref_result, msg=f"{pname} {name}")
    assert not any(p == "R" for p, _ in refused)  # a replicated tensor's views are local
    # writes through views that stay local work on sharded tensors too
    for ok in [("S1", "select_add_"), ("S0", "view_mul_"), ("S0", "column_zero_"), ("S0", "narrow_fill_"),
               ("S1", "t_add_"), ("S0", "unsqueeze_"), ("S1", "unsqueeze_"), ("S1", "transpose_")]:
        assert ok not in refused, ok
