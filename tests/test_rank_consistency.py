"""Ranks whose seeds, data or data order differ still build one consistent program: the data
order, random draws and tensors of rank 0 (what a single process seeded like rank 0 sees)."""
import numpy as np
import pytest
import torch

import autopar as dist
from autopar.placement import Replicate, Shard
from distpool import run_dist

R, S0 = Replicate(), Shard(0)


# -- shuffled loaders ------------------------------------------------------------------------
def _loader(sampler=None):
    data = torch.arange(16.).reshape(16, 1)
    if sampler is not None:
        return torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def _epochs(loader, n=2, set_epoch=False):
    out = []
    for e in range(n):
        if set_epoch:
            loader.set_epoch(e) if hasattr(loader, "set_epoch") else loader.sampler.set_epoch(e)
        out.append([dist.unshard_dtensor(b).flatten().tolist() if dist.is_dist_tensor(b) else b.flatten().tolist()
                    for b in loader])
    return out


def _shuffled_on_ranks(meshes):
    torch.manual_seed(100 + dist.get_rank())  # per-rank seeds, a common script pattern
    meshes = [dist.ProcessMesh(m, dim_names=["dp"]) for m in meshes]
    loader = dist.shard_dataloader(_loader(), meshes if len(meshes) > 1 else meshes[0], shard_dims="dp")
    orders = _epochs(loader)
    return orders, torch.rand(3)  # the global stream continues as rank 0's


@pytest.mark.parametrize("meshes", [[[0, 1]], [[0], [1]]])
def test_shuffled_loader_gives_every_rank_rank0s_order(meshes):
    torch.manual_seed(100)
    ref = _epochs(_loader())
    ref_next = torch.rand(3)
    for orders, after in run_dist(_shuffled_on_ranks, 2, meshes):
        assert orders == ref
        for epoch in orders:
            assert sorted(x for batch in epoch for x in batch) == list(range(16))
        torch.testing.assert_close(after, ref_next)


def _set_epoch_on_ranks():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sampler = torch.utils.data.DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=0)
    return _epochs(dist.shard_dataloader(_loader(sampler), mesh, shard_dims="dp"), set_epoch=True)


def test_set_epoch_reaches_the_sampler():
    sampler = torch.utils.data.DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=0)
    ref = _epochs(_loader(sampler), set_epoch=True)
    assert ref[0] != ref[1]
    for orders in run_dist(_set_epoch_on_ranks, 2):
        assert orders == ref


def _splitting_sampler():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sampler = torch.utils.data.DistributedSampler(range(16), num_replicas=2, rank=dist.get_rank())
    with pytest.raises(ValueError, match="already splits the data"):
        next(iter(dist.shard_dataloader(_loader(sampler), mesh, shard_dims="dp")))


def test_a_loader_that_already_splits_by_rank_is_refused():
    run_dist(_splitting_sampler, 2)


# -- random ops ------------------------------------------------------------------------------
def _dropout_under_rank_seeds(placements):
    torch.manual_seed(10 + dist.get_rank())
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(torch.ones(8, 6), mesh, placements)
    y = torch.nn.functional.dropout(x, 0.5)
    z = torch.rand_like(x)
    return y.local_value(), dist.unshard_dtensor(y), dist.unshard_dtensor(z), torch.rand(2)


@pytest.mark.parametrize("placements", [[R], [S0]])
def test_random_ops_follow_rank0s_stream_under_per_rank_seeds(placements):
    torch.manual_seed(10)
    ref_y = torch.nn.functional.dropout(torch.ones(8, 6), 0.5)
    ref_z, ref_next = torch.rand(8, 6), torch.rand(2)
    for rank, (local, y, z, after) in enumerate(run_dist(_dropout_under_rank_seeds, 2, placements)):
        torch.testing.assert_close(y, ref_y)
        torch.testing.assert_close(z, ref_z)
        torch.testing.assert_close(after, ref_next)
        expect = ref_y if placements == [R] else ref_y[4 * rank: 4 * rank + 4]
        torch.testing.assert_close(local, expect)


# -- data that differs between ranks ----------------------------------------------------------
def _differing_data():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    mine = torch.full((4, 2), float(dist.get_rank() + 1))
    rep, shard = dist.shard_tensor(mine, mesh, [R]), dist.shard_tensor(mine, mesh, [S0])
    own = dist.shard_tensor(mine, mesh, [S0], src_data_rank=None)
    from_second = dist.shard_tensor(mine, mesh, [R], src_data_rank=1)
    torch.manual_seed(dist.get_rank())  # a model initialised under per-rank seeds
    model = dist.shard_layer(torch.nn.Linear(3, 2), mesh)
    return (rep.local_value(), shard.local_value(), own.local_value(), from_second.local_value(),
            model.weight.local_value())


def test_shard_tensor_takes_the_source_ranks_data():
    torch.manual_seed(0)
    ref_weight = torch.nn.Linear(3, 2).weight.detach()
    for rank, (rep, shard, own, from_second, weight) in enumerate(run_dist(_differing_data, 2)):
        torch.testing.assert_close(rep, torch.full((4, 2), 1.0))
        torch.testing.assert_close(shard, torch.full((2, 2), 1.0))
        torch.testing.assert_close(own, torch.full((2, 2), float(rank + 1)))
        torch.testing.assert_close(from_second, torch.full((4, 2), 2.0))
        torch.testing.assert_close(weight, ref_weight)


def _ragged_pieces(rows):
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    r = dist.get_rank()
    local = torch.arange(rows[r] * 2, dtype=torch.float32).reshape(rows[r], 2) + 100 * r
    try:
        t = dist.dtensor_from_local(local, mesh, [S0])
    except ValueError as e:
        return str(e)
    return tuple(t.shape), dist.unshard_dtensor(t)


def test_dtensor_from_local_infers_the_global_shape_of_uneven_pieces():
    for shape, full in run_dist(_ragged_pieces, 2, [3, 2]):
        assert shape == (5, 2)
        expect = torch.cat([torch.arange(6.).reshape(3, 2), torch.arange(4.).reshape(2, 2) + 100])
        torch.testing.assert_close(full, expect)
    for message in run_dist(_ragged_pieces, 2, [2, 3]):  # not the split rule's cut: refused on every rank
        assert "rank 0 holds [2, 2]" in message and "gives it [3, 2]" in message, message


def test_global_shape_of_pieces_is_a_pure_rule():
    from autopar.spec import global_shape_of_pieces

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
    pieces = {0: (2, 3), 1: (2, 2), 2: (1, 3), 3: (1, 2)}  # dim 0 over "a", dim 1 over "b"
    assert global_shape_of_pieces(mesh, [Shard(0), Shard(1)], pieces) == (3, 5)
    nested = {0: (2,), 1: (2,), 2: (2,), 3: (1,)}  # dim 0 cut over "a" then "b"
    assert global_shape_of_pieces(mesh, [Shard(0), Shard(0)], nested) == (7,)
    with pytest.raises(ValueError, match="rank 1 holds"):
        global_shape_of_pieces(mesh, [Shard(0), Replicate()], {0: (2,), 1: (3,), 2: (2,), 3: (2,)})


# -- resuming a loader mid-epoch ---------------------------------------------------------------
def _global(batch) -> list:
    return dist.unshard_dtensor(batch).flatten().tolist()


def _interrupted(after: int, whole_batches: bool):
    """Two epochs of a shuffled loader on every rank of this job; the loader's state and
    torch's random state taken after `after` batches of the second epoch (what a checkpoint
    saves), and the batches handed out, globally."""
    torch.manual_seed(7)
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["dp"])
    # whole_batches: two meshes make the loader read each batch whole (and cut rank 0's)
    loader = dist.shard_dataloader(_loader(), [mesh, mesh] if whole_batches else mesh, shard_dims="dp")
    seen, saved = [], None
    for epoch in range(2):
        for i, batch in enumerate(loader):
            seen.append(_global(batch))
            if epoch == 1 and i + 1 == after:
                saved = (loader.state_dict(), torch.get_rng_state())
    return seen, saved


def _resumed(saved, whole_batches: bool):
    """A fresh job (another world size) restores torch's random state and the loader's and
    reads the rest of the epoch; torch's stream then goes on as the uninterrupted job's."""
    state, rng_state = saved
    torch.manual_seed(1234)  # the fresh job's own seed, overridden by the checkpoint's state
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["dp"])
    # whole_batches: two meshes make the loader read each batch whole (and cut rank 0's)
    loader = dist.shard_dataloader(_loader(), [mesh, mesh] if whole_batches else mesh, shard_dims="dp")
    torch.set_rng_state(rng_state)
    loader.load_state_dict(state)
    rest = [_global(b) for b in loader]
    return rest, torch.rand(2).tolist()


@pytest.mark.parametrize("whole_batches", [False, True])
def test_a_loader_resumes_mid_epoch_on_another_data_parallel_degree(whole_batches):
    seen, saved = run_dist(_interrupted, 2, 2, whole_batches)[0]
    first_epoch, second_epoch = seen[:4], seen[4:]
    assert sorted(x for b in second_epoch for x in b) == list(range(16)) and second_epoch != first_epoch
    state, rng_state = saved
    assert state["batches"] == 2
    torch.set_rng_state(rng_state)
    after_save = torch.rand(2).tolist()  # (the uninterrupted job's stream, from the same state)
    for world in (1, 4):
        for rest, stream in run_dist(_resumed, world, saved, whole_batches):
            assert rest == second_epoch[2:], (world, rest, second_epoch)
            assert stream == after_save
