"""StridedShard: merging an outer dim into a sharded one keeps the split (attention heads
merged into a batched matmul's batch), and splitting it back restores the Shard."""
import pytest
import torch

import autopar as dist
from autopar.placement import Partial, Replicate, Shard, StridedShard
from autopar.spec import DistSpec, TensorMeta
from autopar.spmd import engine
from autopar.spmd.strategy import OpCall
from distpool import run_dist

aten = torch.ops.aten
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)


def _call(func, shapes, out_shapes, args=None):
    metas = [TensorMeta.contiguous(s, torch.float32) for s in shapes]
    outs = [TensorMeta.contiguous(s, torch.float32) for s in out_shapes]
    return OpCall(func, tuple(args if args is not None else metas), {}, metas, outs)


def test_merging_into_a_sharded_inner_dim_is_strided_and_splitting_back_restores_it():
    mesh = dist.ProcessMesh([0, 1])
    merge = _call(aten.view.default, [(2, 4, 5, 3)], [(8, 5, 3)], args=(None, [8, 5, 3]))
    ins, outs, _ = engine.choose(merge, mesh, [(S1,)], inplace=False)
    assert ins == [(S1,)] and outs == [(StridedShard(0, 2),)]
    split = _call(aten.view.default, [(8, 5, 5)], [(2, 4, 5, 5)], args=(None, [2, 4, 5, 5]))
    ins, outs, _ = engine.choose(split, mesh, [(StridedShard(0, 2),)], inplace=False)
    assert ins == [(StridedShard(0, 2),)] and outs == [(S1,)]
    # a batched matmul over the strided batch keeps it, no input moves
    bmm = _call(aten.bmm.default, [(8, 5, 3), (8, 3, 5)], [(8, 5, 5)])
    ss = (StridedShard(0, 2),)
    ins, outs, _ = engine.choose(bmm, mesh, [ss, ss], inplace=False)
    assert ins == [ss, ss] and outs == [ss]
    # heads that do not split evenly over the mesh dim are not strided
    odd = _call(aten.view.default, [(2, 3, 5)], [(6, 5)], args=(None, [6, 5]))
    _, outs, _ = engine.choose(odd, mesh, [(S1,)], inplace=False)
    assert outs != [(StridedShard(0, 2),)]


def test_strided_local_shape_and_no_box():
    spec = DistSpec(dist.ProcessMesh([[0, 1], [2, 3]]), (S0, StridedShard(0, 4)), TensorMeta.contiguous((8, 6), torch.float32))
    assert spec.local_shape((1, 0)) == (2, 6)  # dp cuts 8 rows into 2 blocks of 4, then half of each block's rows
    with pytest.raises(ValueError, match="not a box"):
        spec.local_box((0, 0))


def _attention(q, k, v):
    b, h, s, d = q.shape
    w = (q @ k.transpose(-1, -2)) * d ** -0.5
    return (w.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h * d)


def _heads_split(mesh_ids, names, placements):
    mesh = dist.ProcessMesh(mesh_ids, dim_names=names)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(4, 4, 5, 3, generator=g) for _ in range(3)]
    ref_in = [t.clone().requires_grad_() for t in qkv]
    ref = _attention(*ref_in)
    ref.pow(2).sum().backward()
    xs = [dist.shard_tensor(t, mesh, placements, stop_gradient=False) for t in qkv]
    with dist.comm_log() as fwd:
        out = _attention(*xs)
    with dist.comm_log() as bwd:
        out.pow(2).sum().backward()
    return (dist.unshard_dtensor(out), ref, [dist.unshard_dtensor(x.grad) for x in xs], [r.grad for r in ref_in],
            out.placements, [r.op for r in fwd], [r.op for r in bwd])


@pytest.mark.parametrize("world,mesh_ids,names,placements", [
    (2, [0, 1], ["mp"], [S1]),
    (4, [[0, 1], [2, 3]], ["dp", "mp"], [S0, S1]),
])
def test_matmul_attention_with_heads_split_moves_nothing(world, mesh_ids, names, placements):
    for out, ref, grads, ref_grads, out_pl, fwd, bwd in run_dist(_heads_split, world, mesh_ids, names, placements):
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
        assert out_pl == placements[:-1] + [S2]  # heads merged into the hidden dim: its outer part
        assert fwd == [] and bwd == [], (fwd, bwd)


def _strided_round_trips():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    full = torch.arange(48.).reshape(2, 4, 6)
    t = dist.shard_tensor(full, mesh, [S1]).reshape(8, 6)  # StridedShard(0, 2)
    out = {"placements": t.placements, "local": t.local_value(), "whole": dist.unshard_dtensor(t)}
    for name, target in (("R", [R]), ("S0", [S0]), ("S1", [S1])):
        moved = dist.reshard(t, mesh, target)
        out[name] = (moved.placements, dist.unshard_dtensor(moved))
    back = dist.reshard(dist.shard_tensor(full.reshape(8, 6), mesh, [R]), mesh, [StridedShard(0, 2)])
    out["from R"] = back.local_value()
    return out


def test_strided_pieces_reshard_to_and_from_everything():
    full = torch.arange(48.).reshape(2, 4, 6)
    for rank, got in enumerate(run_dist(_strided_round_trips, 2)):
        assert got["placements"] == [StridedShard(0, 2)]
        mine = full[:, 2 * rank: 2 * rank + 2].reshape(4, 6)  # two heads of each of the two blocks
        torch.testing.assert_close(got["local"], mine)
        torch.testing.assert_close(got["from R"], mine)
        torch.testing.assert_close(got["whole"], full.reshape(8, 6))
        for name in ("R", "S0", "S1"):
            torch.testing.assert_close(got[name][1], full.reshape(8, 6))


def test_strided_cuts_must_be_the_last_and_keep_blocks_whole():
    from autopar.spec import strided_cuts_valid

    ss = StridedShard(0, 4)
    assert strided_cuts_valid((ss,), (8, 3), (2,))
    assert strided_cuts_valid((S0, ss), (8, 3), (2, 2))          # dp cuts 2 whole blocks per piece
    assert not strided_cuts_valid((ss, S0), (8, 3), (2, 2))      # a Shard after it would cut its pieces
    assert not strided_cuts_valid((S0, StridedShard(0, 3)), (6, 3), (2, 2))  # 3 blocks cut in 2
    assert not strided_cuts_valid((StridedShard(0, 8),), (8, 3), (2,))  # blocks of 1 row: no even split
    with pytest.raises(ValueError, match="last cut"):
        DistSpec(dist.ProcessMesh([[0, 1], [2, 3]]), (ss, S0), TensorMeta.contiguous((8, 3), torch.float32))


def test_a_fused_projection_splits_into_its_parts_and_back_without_moving():
    """A [tokens, 3h] output split column-wise as three blocks (StridedShard(1, 3)) cut into its
    h-wide parts: each part is Shard(1) in place; unequal whole-block parts stay strided; the
    backward's cat of three equal Shard(1) parts is the strided tensor again."""
    mesh = dist.ProcessMesh([0, 1])
    ss = (StridedShard(1, 3),)
    split = _call(aten.split.Tensor, [(6, 24)], [(6, 8)] * 3, args=(None, 8, 1))
    ins, outs, _ = engine.choose(split, mesh, [ss], inplace=False)
    assert ins == [ss] and outs == [(S1,)] * 3
    uneven = _call(aten.split_with_sizes.default, [(6, 24)], [(6, 16), (6, 8)], args=(None, [16, 8], 1))
    ins, outs, _ = engine.choose(uneven, mesh, [ss], inplace=False)
    assert ins == [ss] and outs == [(StridedShard(1, 2),), (S1,)]
    cat = _call(aten.cat.default, [(6, 8)] * 3, [(6, 24)], args=(None, 1))
    ins, outs, _ = engine.choose(cat, mesh, [(S1,)] * 3, inplace=False)
    assert ins == [(S1,)] * 3 and outs == [ss]
    # parts that are not whole blocks, or a dim not strided, are cut as before (whole first)
    odd = _call(aten.split.Tensor, [(6, 24)], [(6, 12)] * 2, args=(None, 12, 1))
    ins, _, _ = engine.choose(odd, mesh, [ss], inplace=False)
    assert ins != [ss]


def _fused_qkv(fused):
    """A fused q/k/v linear under ColWiseParallel(fused=3), split into q, k, v: its pieces, the
    step's collectives and gradients against one process."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 12)
    x = torch.randn(2, 5, 4)
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    plan = {"": dist.ColWiseParallel(fused=fused)}
    layer, _ = dist.parallelize(layer, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    with dist.comm_log() as log:
        q, k, v = layer(x).split(4, dim=-1)
        loss = (q * k).sum() + v.pow(2).sum()
        loss.backward()
    return (layer.weight.placements, layer.weight.local_value().detach(), [r.op for r in log], loss.item(),
            dist.unshard_dtensor(layer.weight.grad), dist.unshard_dtensor(layer.bias.grad))


def test_col_wise_fused_holds_each_ranks_heads_of_q_k_v_and_moves_no_activation():
    torch.manual_seed(0)
    ref, x = torch.nn.Linear(4, 12), torch.randn(2, 5, 4)
    q, k, v = ref(x).split(4, dim=-1)
    loss = (q * k).sum() + v.pow(2).sum()
    loss.backward()
    for rank, (placements, local, ops, value, wgrad, bgrad) in enumerate(run_dist(_fused_qkv, 2, 3)):
        assert placements == [StridedShard(0, 3)]
        rows = [r for part in range(3) for r in range(4 * part + 2 * rank, 4 * part + 2 * rank + 2)]
        torch.testing.assert_close(local, ref.weight.detach()[rows])  # q, k, v rows of this rank's heads
        assert ops == [], ops  # nothing moves (the loss stays Partial until it is read)
        torch.testing.assert_close(value, loss.item(), rtol=1e-5, atol=0)
        torch.testing.assert_close(wgrad, ref.weight.grad)
        torch.testing.assert_close(bgrad, ref.bias.grad)
    with pytest.raises(ValueError, match=r"fused=0"):
        dist.ColWiseParallel(fused=0)


def _fused_checkpoint(path, layout):
    """Save a ColWiseParallel(fused=3) linear; load it into a fresh one parallelized as
    `layout` ("fused" again, "plain" column split, "replicated"): the full weights."""
    from autopar.checkpoint import load_state_dict, save_state_dict

    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    plans = {"fused": dist.ColWiseParallel(fused=3), "plain": dist.ColWiseParallel()}

    def make(seed, how):
        torch.manual_seed(seed)
        config = {"mp_config": {"parallelize_plan": {"": plans[how]} if how in plans else {}}}
        return dist.parallelize(torch.nn.Linear(4, 12), mesh=mesh, config=config)[0]

    saved = make(0, "fused")
    save_state_dict(saved.state_dict(), path)
    fresh = make(1, layout)
    sd = fresh.state_dict()
    load_state_dict(sd, path)
    return {k: dist.unshard_dtensor(v.detach()) for k, v in sd.items()}, [str(p) for p in fresh.weight.placements]


@pytest.mark.parametrize("layout", ["fused", "plain", "replicated"])
def test_a_fused_split_saves_and_loads_across_layouts(tmp_path, layout):
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 12)
    for weights, placements in run_dist(_fused_checkpoint, 2, str(tmp_path / "ckpt"), layout):
        torch.testing.assert_close(weights["weight"], ref.weight.detach())
        torch.testing.assert_close(weights["bias"], ref.bias.detach())
        assert (placements == ["StridedShard(0, split_factor=3)"]) == (layout == "fused"), placements
