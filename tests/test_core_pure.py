"""Mesh, placements, specs and the reshard planner: pure, no processes."""
import pytest
import torch

import autopar as dist
from autopar.placement import Partial, Replicate, Shard, normalize_placements
from autopar.redistribute.plan import plan_bytes, plan_steps
from autopar.spec import DistSpec, TensorMeta, split_range

R = Replicate()


def test_placements_compare_by_value():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert Partial() == Partial("sum") == Partial(dist.ReduceType.SUM)
    assert Partial("max") != Partial("min")
    assert len({Shard(1), Shard(1), R, Replicate(), Partial(), Partial("avg")}) == 4
    assert Partial("avg").reduce_type == "avg"
    with pytest.raises(ValueError, match="sum/avg/max/min"):
        Partial("prod")
    with pytest.raises(TypeError):
        Shard("0")


def test_mesh_any_rank_order_and_submeshes():
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    assert mesh.shape == [2, 3] and mesh.ndim == 2
    assert mesh.process_ids == [2, 4, 5, 0, 1, 3]
    assert mesh == dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    assert hash(mesh) == hash(dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"]))
    assert mesh != dist.ProcessMesh([[2, 4, 5], [0, 1, 3]])
    assert mesh.coordinate(1) == (1, 1) and mesh.coordinate(7) is None
    assert mesh.get_mesh_with_dim("y").shape == [3, 2]
    assert mesh.get_mesh_with_dim("y", 0).process_ids == [2, 0]
    assert mesh[1].process_ids == [0, 1, 3] and mesh[1].dim_names == ["y"]
    assert mesh[:, 0].process_ids == [2, 0] and mesh[:, 0].dim_names == ["x"]
    assert mesh.dim_groups("x") == [(2, 0), (4, 1), (5, 3)]
    assert mesh.dim_group_of(4, 1) == (2, 4, 5)
    assert mesh.get_dim_size("y") == 3


@pytest.mark.parametrize(
    "bad, err, match",
    [
        ([0, 1, 1], ValueError, "more than once"),
        ([[0, 1], [2]], TypeError, "rectangular"),
        ([0, -1], ValueError, "non-negative"),
        ("ab", TypeError, "ints"),
    ],
)
def test_mesh_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        dist.ProcessMesh(bad)


def test_placement_validation_names_the_fault():
    with pytest.raises(ValueError, match=r"Shard\(2\) is out of range for a 2-D tensor"):
        normalize_placements([Shard(2)], 1, 2, "tensor of shape [4, 3]")
    with pytest.raises(ValueError, match="2 placements .* for a 1-D mesh"):
        normalize_placements([R, R], 1, 2)
    with pytest.raises(TypeError, match="not a Placement"):
        normalize_placements(["S0"], 1, 2)
    assert normalize_placements([Shard(-1)], 1, 3) == (Shard(2),)


def test_split_rule_is_array_split():
    import numpy as np

    for n in range(0, 12):
        for k in range(1, 6):
            pieces = np.array_split(np.arange(n), k)
            for i, p in enumerate(pieces):
                a, b = split_range(n, k, i)
                assert list(range(a, b)) == p.tolist()


def test_seed_shard_example_local_shapes():
    """The guide's §2.2: a (4, 3) tensor on mesh [[2,4,5],[0,1,3]] with [Shard(0), Shard(1)] gives (2, 1) pieces."""
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    spec = DistSpec(mesh, (Shard(0), Shard(1)), TensorMeta.contiguous((4, 3), torch.int64))
    for r in mesh.process_ids:
        assert spec.local_shape(mesh.coordinate(r)) == (2, 1)
    assert spec.local_box(mesh.coordinate(1)) == [(2, 4), (1, 2)]


def test_nested_shards_follow_mesh_dim_order():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]])
    spec = DistSpec(mesh, (Shard(0), Shard(0)), TensorMeta.contiguous((7,), torch.float32))
    boxes = [spec.local_box(mesh.coordinate(r))[0] for r in range(4)]
    assert boxes == [(0, 2), (2, 4), (4, 6), (6, 7)]


def _kinds(mesh_shape, shape, src, dst):
    return [s.kind for s in plan_steps(mesh_shape, shape, 4, tuple(src), tuple(dst))]


def test_planner_uses_the_cheapest_collective_per_transition():
    S0, S1, P = Shard(0), Shard(1), Partial()
    assert _kinds((4,), (8, 8), [S0], [R]) == ["all_gather"]
    assert _kinds((4,), (8, 8), [P], [R]) == ["all_reduce"]
    assert _kinds((4,), (8, 8), [P], [S0]) == ["reduce_scatter"]
    assert _kinds((4,), (8, 8), [S0], [S1]) == ["all_to_all"]
    assert _kinds((4,), (8, 8), [R], [S1]) == ["slice"]
    assert _kinds((4,), (8, 8), [R], [P]) == ["to_partial"]
    assert _kinds((4,), (8, 8), [S0], [P]) == ["shard_to_partial"]
    assert _kinds((2, 2), (8, 8), [P, P], [S0, S1]) == ["reduce_scatter", "reduce_scatter"]
    # shards nest in mesh-dim order: the inner mesh dim must be gathered first
    assert _kinds((2, 2), (8, 8), [S0, S0], [R, R]) == ["all_gather", "all_gather"]
    steps = plan_steps((2, 2), (8, 8), 4, (S0, S0), (R, R))
    assert [s.mesh_dim for s in steps] == [1, 0]


def test_planner_reduces_several_mesh_dims_in_one_all_reduce():
    """P on two mesh dims -> R: one all-reduce over the 4 ranks, not one per mesh dim."""
    steps = plan_steps((2, 2), (8, 8), 4, (Partial(), Partial()), (R, R))
    assert [(s.kind, s.mesh_dims) for s in steps] == [("all_reduce", (0, 1))]
    src = DistSpec(dist.ProcessMesh([[0, 1], [2, 3]]), [Partial(), Partial()], TensorMeta((8, 8), (8, 1), torch.float32))
    assert plan_bytes(src, DistSpec(src.mesh, [R, R], src.meta)) == 2 * 256 * 3 / 4
    # different reduce ops stay two steps
    steps = plan_steps((2, 2), (8, 8), 4, (Partial("max"), Partial()), (R, R))
    assert sorted(s.kind for s in steps) == ["all_reduce", "all_reduce"]


def test_same_pieces_ignores_mesh_dims_of_size_one():
    mesh = dist.ProcessMesh([[0, 1]], dim_names=["dp", "mp"])  # dp has size 1
    meta = TensorMeta.contiguous((4, 6), torch.float32)
    spec = DistSpec(mesh, (Shard(0), Shard(1)), meta)
    assert spec.same_pieces(DistSpec(mesh, (Replicate(), Shard(1)), meta))
    assert spec.same_pieces(DistSpec(mesh, (Partial(), Shard(1)), meta))
    assert not spec.same_pieces(DistSpec(mesh, (Shard(0), Replicate()), meta))
    assert not spec.same_pieces(DistSpec(mesh, (Shard(0), Shard(1)), TensorMeta.contiguous((4, 8), torch.float32)))
    assert not spec.same_pieces(DistSpec(dist.ProcessMesh([[1, 0]]), (Shard(0), Shard(1)), meta))


def test_planner_skips_mesh_dims_of_size_one():
    """On a mesh dim of size 1 every placement is the whole tensor: nothing to do."""
    assert plan_steps((4, 1), (8, 8), 4, (R, Shard(0)), (R, R)) == ()
    assert _kinds((4, 1), (8, 8), [Partial(), Partial()], [R, Shard(1)]) == ["all_reduce"]


def test_planner_reduces_before_gathering():
    """P on one mesh dim and S on another: reduce while the tensor is small."""
    steps = plan_steps((2, 2), (8, 8), 4, (Partial(), Shard(0)), (R, R))
    assert [s.kind for s in steps] == ["all_reduce", "all_gather"]


def test_a_count_rides_a_bucket_exactly_for_every_count_and_world_its_pieces_allow():
    """A rider's pieces, summed over the ranks in float32 in any order, give the exact sum of
    the counts: the largest counts and the most ranks the pieces allow (every partial sum below
    2**24); a count or a world beyond them is not offered (it is posted on its own)."""
    import random

    from autopar.tensor import riders

    biggest, most = (1 << (riders.BITS * riders.PIECES)) - 1, 1 << (24 - riders.BITS)
    rng = random.Random(0)
    for k, top in [(2, 10), (3, 1 << 30), (most, biggest)]:
        counts = [rng.randint(0, top) for _ in range(k)] + [top]
        pieces = [riders.pieces(n, torch.float32, torch.device("cpu")) for n in counts]
        rng.shuffle(pieces)
        summed = torch.zeros(riders.PIECES)
        for p in pieces:
            summed += p
        rider = riders.Count(counts[0], ())
        rider.arrived(summed)
        assert rider.summed.dtype == torch.int64 and int(rider.summed) == sum(counts), k
    ranks = (0, 1)
    assert riders.offer(biggest + 1, ranks) is None and riders.offer(-1, ranks) is None
    assert riders.offer(5, tuple(range(most + 1))) is None
    rider = riders.offer(5, ranks)
    try:  # taken only by a bucket summed over the same ranks, in a dtype that sums it exactly
        assert riders.take((0, 2), torch.float32, dist.ReduceType.SUM) == []
        assert riders.take(ranks, torch.bfloat16, dist.ReduceType.SUM) == []
        assert riders.take(ranks, torch.float32, dist.ReduceType.AVG) == []
        started = riders.buckets_started(ranks)
        assert riders.take(ranks, torch.float64, dist.ReduceType.SUM) == [rider]
        assert riders.buckets_started(ranks) == started + 1
        assert not rider.withdraw()  # (taken: it arrives with its bucket)
    finally:
        rider.withdraw()


def test_a_mean_loss_rides_a_bucket_beside_a_loaders_count():
    """A loss's (sum, count) rides as the count's pieces (read off a tensor on its device, the
    same pieces as the integer's) and the sum; summed over the ranks it gives back the total
    count exactly and the sum of the sums.  A bucket takes the riders waiting over its ranks in
    the order offered, as many as its spare elements hold: a loader's count and a loss's pair."""
    from autopar.tensor import riders

    cpu = torch.device("cpu")
    for n in (0, 1, 4095, 4096, 123456789, (1 << 47) + 5):
        assert torch.equal(riders.pieces(torch.tensor(float(n), dtype=torch.float64), torch.float64, cpu),
                           riders.pieces(n, torch.float64, cpu)), n
    sums, counts = [1.5, -0.25, 3.0], [7, 0, 4096 * 3 + 1]
    parts = [riders.MeanParts(torch.tensor(x), torch.tensor(float(c)), ()) for x, c in zip(sums, counts)]
    summed = sum(p.values(torch.float32, cpu) for p in parts)
    parts[0].arrived(summed)
    loss_sum, count = parts[0].summed
    assert count.dtype == torch.int64 and int(count) == sum(counts) and float(loss_sum) == sum(sums)
    ranks = (0, 1)
    count_rider, pair, another = riders.offer(5, ranks), riders.offer_mean(torch.tensor(1.0), torch.tensor(2.0), ranks), \
        riders.offer_mean(torch.tensor(1.0), torch.tensor(2.0), ranks)
    try:
        assert riders.take(ranks, torch.float32, dist.ReduceType.SUM) == [count_rider, pair]
        assert sum(r.width for r in (count_rider, pair)) <= riders.SPARE
        assert riders.take(ranks, torch.float32, dist.ReduceType.SUM) == [another]
    finally:
        for r in (count_rider, pair, another):
            r.withdraw()
