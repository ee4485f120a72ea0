"""Reshard on real gloo worlds: every transition, pieces rank by rank, bytes from comm_log."""
import itertools

import torch

import autopar as dist
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
PLACEMENTS = [R, S0, S1, P, Partial("max")]


def _expected_piece(full, mesh, placements):
    return dist.shard_tensor(full, mesh, placements).local_value()


def _matrix(mesh_ids, dim_names, shapes):
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dim_names)
    checked = 0
    for shape in shapes:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) - 7
        for src in itertools.product(PLACEMENTS, repeat=mesh.ndim):
            t = dist.shard_tensor(full, mesh, list(src))
            for dst in itertools.product(PLACEMENTS, repeat=mesh.ndim):
                r = dist.reshard(t, mesh, list(dst))
                assert r.placements == list(dst)
                if not any(p.is_partial() for p in dst):
                    # pieces rank by rank: exactly the split rule's piece
                    assert torch.equal(r.local_value(), _expected_piece(full, mesh, list(dst))), (src, dst, shape)
                assert torch.equal(dist.unshard_dtensor(r), full), (src, dst, shape)
                checked += 1
    return checked


def test_full_matrix_1d_even_and_uneven():
    counts = run_dist(_matrix, 4, [0, 1, 2, 3], ["x"], [(8, 4), (5, 7)])
    assert counts[0] == 2 * 25


def test_full_matrix_2d_seed_rank_order():
    counts = run_dist(_matrix, 6, [[2, 4, 5], [0, 1, 3]], ["x", "y"], [(6, 6), (5, 7)])
    assert counts[0] == 2 * 625


def _bytes_per_transition():
    mesh = dist.ProcessMesh([0, 1, 2, 3])
    full = torch.randn(64, 32)
    nbytes = full.numel() * 4
    out = {}
    for name, src, dst in [
        ("S0->R", S0, R), ("P->R", P, R), ("P->S0", P, S0), ("S0->S1", S0, S1),
        ("R->S0", R, S0), ("R->P", R, P), ("S1->R", S1, R),
    ]:
        t = dist.shard_tensor(full, mesh, [src])
        with dist.comm_log() as log:
            dist.reshard(t, mesh, [dst])
        out[name] = [(r.op, r.bytes) for r in log]
    return out, nbytes


def test_each_transition_uses_the_cheapest_collective_and_minimal_bytes():
    (out, nbytes), *_ = run_dist(_bytes_per_transition, 4)
    k = 4
    assert out["S0->R"] == [("all_gather", nbytes // k * (k - 1))]
    assert out["S1->R"] == [("all_gather", nbytes // k * (k - 1))]
    assert out["P->R"] == [("all_reduce", 2 * (k - 1) * nbytes // k)]
    assert out["P->S0"] == [("reduce_scatter", nbytes // k * (k - 1))]
    # all-to-all: each rank keeps 1/k of its piece and sends the rest: the minimum
    assert out["S0->S1"] == [("all_to_all", nbytes // k * (k - 1) // k)]
    assert out["R->S0"] == [] and out["R->P"] == []


def _cross_mesh_seed():
    """The guide's §2.3: Replicate on [0, 1] -> Shard(0) on [2, 3]."""
    mesh0 = dist.ProcessMesh([0, 1], dim_names=["x"])
    mesh1 = dist.ProcessMesh([2, 3], dim_names=["x"])
    dense = torch.tensor([[1, 2, 3], [4, 5, 6]])
    t = dist.shard_tensor(dense, mesh0, [dist.Replicate()])
    with dist.comm_log() as log:
        r = dist.reshard(t, mesh1, [dist.Shard(0)])
    return r.local_value().tolist(), [(x.op, x.ranks, x.bytes) for x in log], dist.unshard_dtensor(r).tolist()


def test_cross_mesh_seed_example():
    res = run_dist(_cross_mesh_seed, 4)
    assert [r[0] for r in res] == [[], [], [[1, 2, 3]], [[4, 5, 6]]]
    # each receiver gets exactly its row from one sender: 24 bytes cross, nothing more
    assert res[0][1] == [("send", (0, 2), 24)] and res[1][1] == [("send", (1, 3), 24)]
    assert res[2][1] == [("recv", (0, 2), 0)] and res[3][1] == [("recv", (1, 3), 0)]
    assert all(r[2] == [[1, 2, 3], [4, 5, 6]] for r in res)


def _cross_mesh_matrix():
    meshes = [
        dist.ProcessMesh([0, 1]),
        dist.ProcessMesh([3, 2, 1]),
        dist.ProcessMesh([[0, 1], [2, 3]]),
        dist.ProcessMesh([[3, 1], [0, 2]]),
    ]
    full = torch.arange(35.0).reshape(5, 7)
    n = 0
    for a, b in itertools.permutations(meshes, 2):
        for src in itertools.product([R, S0, S1, P], repeat=a.ndim):
            t = dist.shard_tensor(full, a, list(src))
            for dst in itertools.product([R, S0, S1, P], repeat=b.ndim):
                r = dist.reshard(t, b, list(dst))
                assert r.process_mesh == b
                if dist.get_rank() not in b:
                    assert r.local_value().numel() == 0
                assert torch.equal(dist.unshard_dtensor(r), full), (a, src, b, dst)
                n += 1
    return n


def test_cross_mesh_any_shapes_and_placements():
    assert run_dist(_cross_mesh_matrix, 4)[0] > 300


def _grad_through_reshard():
    mesh0, mesh1 = dist.ProcessMesh([0, 1]), dist.ProcessMesh([[2, 3], [0, 1]])
    x = torch.arange(12.0).reshape(4, 3)
    t = dist.shard_tensor(x, mesh0, [S0], stop_gradient=False)
    same = dist.reshard(t, mesh0, [S1])
    other = dist.reshard(same, mesh1, [P, S0])
    w = torch.arange(12.0).reshape(4, 3) / 10
    loss = (other * w).sum()
    loss.backward()
    return dist.unshard_dtensor(t.grad), t.grad.placements


def test_reshard_is_differentiable_within_and_across_meshes():
    for grad, placements in run_dist(_grad_through_reshard, 4):
        assert torch.allclose(grad, torch.arange(12.0).reshape(4, 3) / 10)
        assert placements == [S0]


def _layout_after_reshard():
    """A reshard is a no-op on the value: views valid on the global tensor stay valid."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    full = torch.randn(4, 8, 6)
    x = dist.shard_tensor(full, mesh, [Replicate()])
    y = dist.reshard(x.transpose(0, 1), mesh, [Shard(0)])  # gathered below into a fresh buffer
    v = dist.reshard(y, mesh, [Replicate()]).transpose(0, 1)  # the global tensor is contiguous again
    z = dist.reshard(dist.shard_tensor(full, mesh, [Replicate()]), mesh, [Shard(1)])
    return (
        torch.equal(dist.unshard_dtensor(v.view(32, 6)), full.view(32, 6)),
        z.local_value().is_contiguous(),  # a column piece of a row-major tensor is dense too
    )


def test_a_reshard_keeps_the_layout_a_view_relies_on():
    assert run_dist(_layout_after_reshard, 2) == [(True, True)] * 2


def _expanded_resharded():
    """HF's repeat of one kv head: an expand (stride 0) of a sharded tensor, resharded."""
    mesh = dist.ProcessMesh([0, 1])
    torch.manual_seed(0)
    full = torch.randn(2, 1, 4, 6)
    x = dist.shard_tensor(full, mesh, [Shard(3)])
    y = x.expand(2, 3, 4, 6)  # the repeated dim has stride 0
    z = dist.reshard(y, mesh, [Shard(0)])
    return z._local.stride(), z._local, dist.unshard_dtensor(z)


def test_an_expanded_tensor_resharded_keeps_its_last_dim_innermost():
    """A broadcast dim is laid out where row-major order puts it, not innermost: kernels that
    assume a unit last-dim stride (CPU flash attention) get one."""
    torch.manual_seed(0)
    full = torch.randn(2, 1, 4, 6).expand(2, 3, 4, 6)
    for rank, (stride, piece, whole) in enumerate(run_dist(_expanded_resharded, 2)):
        assert stride[-1] == 1, stride
        torch.testing.assert_close(piece, full[rank:rank + 1])
        torch.testing.assert_close(whole, full)


def _pair_all_reduces():
    """A pair's all-reduces below and above GATHERED_ALL_REDUCE_BYTES (gathered and reduced
    here, or gloo's own) against the terms gathered by hand: exact, and the same bits on both."""
    import torch.distributed as tdist

    from autopar.comm import collectives
    from autopar.placement import ReduceType

    dist.ProcessMesh([0, 1])
    local = {ReduceType.SUM: torch.add, ReduceType.AVG: lambda a, b: (a + b) / 2,
             ReduceType.MAX: torch.maximum, ReduceType.MIN: torch.minimum}
    sizes = (1, 1000, collectives.GATHERED_ALL_REDUCE_BYTES // 4 + 1)  # the last: gloo's all_reduce
    for n in sizes:
        torch.manual_seed(dist.get_rank())
        t = torch.randn(n)
        terms = [torch.empty(n) for _ in range(2)]
        tdist.all_gather(terms, t)
        for reduce_type, want in local.items():
            with dist.comm_log() as log:
                got = collectives.all_reduce(t, (0, 1), reduce_type)
            assert [(r.op, r.bytes) for r in log] == [("all_reduce", 4 * n)]
            if n < sizes[-1]:  # gloo's own ring sums in its order: equal to a + b up to rounding
                assert torch.equal(got, want(*terms)), (n, reduce_type)
            else:
                torch.testing.assert_close(got, want(*terms), rtol=1e-6, atol=1e-6)
            seen = [torch.empty(n) for _ in range(2)]
            tdist.all_gather(seen, got)
            assert torch.equal(seen[0], seen[1]), (n, reduce_type)
    return collectives.gathered_all_reduce(4, 2, True), collectives.gathered_all_reduce(4, 4, True)


def test_a_pairs_small_all_reduce_is_exact_and_the_same_on_both_ranks():
    """Between two ranks a small all-reduce gathers the two terms (one exchange where gloo's
    ring makes two, the same bytes) and reduces them in mesh order on each."""
    for pair, four in run_dist(_pair_all_reduces, 2):
        assert pair and not four
