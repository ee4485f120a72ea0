"""Matmul, pointwise and view rules: forward and backward against one process, placements and
communication, on 1-D (2, 4 ranks) and 2-D meshes, even and uneven shapes."""
import warnings

import torch
import torch.nn.functional as F

import autopar as dist
from autopar.placement import Partial, Replicate, Shard, StridedShard
from autopar.spmd import engine
from autopar.spmd.strategy import OpCall
from autopar.spec import TensorMeta
from distpool import run_dist
from opcheck import check

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
MESH_2D = [[2, 0], [1, 3]]


def _no_missing_rules(caught):
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not missing, missing


def _cases(world):
    torch.manual_seed(0)
    a, b = torch.randn(5, 6), torch.randn(6, 4)
    x3, w, bias = torch.randn(4, 5, 6), torch.randn(3, 6), torch.randn(3)
    bm, bn = torch.randn(4, 5, 6), torch.randn(4, 6, 3)
    row, col = torch.randn(6), torch.randn(5, 1)
    cases = [
        # fn, inputs, placements, expected output placements (None: not asserted), communicates?
        (torch.mm, [a, b], [[R], [S1]], [S1], False),
        (torch.mm, [a, b], [[S0], [R]], [S0], False),
        (torch.mm, [a, b], [[S1], [S0]], [P], False),
        (torch.mm, [a, b], [[R], [S0]], [P], False),  # Paddle's rule: Replicate operand sliced locally
        (torch.mm, [a, b], [[P], [R]], [P], False),
        (torch.matmul, [x3, b], [[S0], [R]], [S0], False),  # 3-D @ 2-D: view + mm + view
        (torch.matmul, [x3, b], [[S2], [S0]], [P], False),
        (F.linear, [x3, w, bias], [[S0], [R], [R]], [S0], False),
        (F.linear, [x3, w, bias], [[R], [S0], [S0]], [S2], False),  # column parallel
        (F.linear, [x3, w, bias], [[S2], [S1], [R]], [P], False),  # row parallel: bias once
        (torch.bmm, [bm, bn], [[S0], [S0]], [S0], False),
        (torch.bmm, [bm, bn], [[S2], [S1]], [P], False),
        (lambda u, v: u + v, [a, row], [[S0], [R]], [S0], False),  # broadcasting
        (lambda u, v: u * v, [a, col], [[S1], [R]], [S1], False),
        (lambda u, v: u - v, [a, a], [[P], [P]], [P], False),
        (lambda u, v: u + v, [a, a], [[P], [R]], [P], False),  # Replicate joins the sum once
        (lambda u, v: u * v, [a, a], [[P], [R]], [P], False),
        (lambda u: u * 3 - 1.5, [a], [[P]], None, True),  # a number added to a Partial(sum)
        (lambda u: torch.where(u > 0, u, u * 0.1), [a], [[S1]], [S1], False),
        (torch.where, [a > 0, a, a.flip(0)], [[R], [P], [P]], [P], False),  # linear in (u, v) together
        (lambda u: F.gelu(u).tanh().sigmoid().exp(), [a], [[S0]], [S0], False),
        (lambda u: F.silu(u) + F.relu(u), [a], [[P]], [R], True),  # non-linear: reduce first
        (lambda u: u.clone().contiguous() * 2, [a], [[P]], [P], False),
        (lambda u: u.to(torch.float64).float(), [a], [[S1]], [S1], False),
        (lambda u: u.reshape(4, 6, 5), [x3.reshape(4, 30)], [[S0]], [S0], False),  # split an unsharded dim
        (lambda u: u.reshape(20, 6), [x3], [[S0]], [S0], False),  # merge (4, 5): 4 divides
        (lambda u: u.reshape(4, 5, 6), [x3.reshape(20, 6)], [[S0]], None, None),
        (lambda u: u.flatten(1), [torch.randn(4, 4, 6)], [[S1]], [S1], False),  # merge (4, 6), 4 outer
        (lambda u: u.flatten(1), [x3], [[S1]], [S0], None),  # 5 outer does not divide: shard moves
        (lambda u: u.transpose(0, 1), [a], [[S0]], [S1], False),
        (lambda u: u.permute(2, 0, 1).contiguous(), [x3], [[S0]], [S1], False),
        (lambda u: u.t(), [a], [[P]], [P], False),
        (lambda u: u.unsqueeze(0).squeeze(0), [a], [[S1]], [S1], False),
        (lambda u: u.unsqueeze(1).expand(5, 3, 6), [a], [[S0]], [S0], False),
        (lambda u: u.view(5, 2, 3), [a], [[S0]], [S0], False),
    ]
    return cases


def _run(mesh_ids, cases):
    mesh = dist.ProcessMesh(mesh_ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (fn, inputs, placements, expect, comm) in enumerate(cases):
            placements = [p + [R] * (mesh.ndim - len(p)) if p is not None else None for p in placements]
            try:
                out, log = check(fn, inputs, placements, mesh)
            except AssertionError as e:
                raise AssertionError(f"case {i}: {e}") from e
            if expect is not None:
                expect = expect + [R] * (mesh.ndim - len(expect))
                assert out.placements == expect, f"case {i}: {out.placements} != {expect}"
            if comm is False:
                assert len(log) == 0, f"case {i}: communicated {list(log)}"
    _no_missing_rules(caught)
    return len(cases)


def _core_ops(world):
    return _run(list(range(world)), _cases(world))


def test_core_ops_1d_two_ranks():
    assert run_dist(_core_ops, 2, 2)[0] > 30


def test_core_ops_1d_four_ranks_uneven():
    assert run_dist(_core_ops, 4, 4)[0] > 30  # 5 rows / 6 cols on 4 ranks: uneven pieces


def _core_ops_2d():
    torch.manual_seed(0)
    x3, w = torch.randn(4, 5, 6), torch.randn(8, 6)
    a, b = torch.randn(6, 8), torch.randn(8, 4)
    cases = [
        (F.linear, [x3, w], [[S0, R], [R, S0]], [S0, S2], False),  # dp x column parallel
        (torch.mm, [a, b], [[S0, S1], [R, S0]], [S0, P], False),  # dp x row parallel
        (lambda u, v: (u @ v).relu(), [a, b], [[S1, S1], [S0, S0]], [R, R], True),
        (lambda u: u.reshape(2, 3, 8), [a], [[S0, S1]], [S0, S2], False),
        (lambda u: u.t() * 2, [a], [[P, S0]], [P, S1], False),
    ]
    return _run(MESH_2D, cases)


def test_core_ops_2d_mesh():
    assert run_dist(_core_ops_2d, 4)[0] == 5


def test_uneven_merge_falls_back_to_a_correct_layout():
    """(5, 6) -> (30,): 5 rows on 2 ranks do not cut (30,) into array_split pieces, so the
    shard cannot stay on the rows; moving it to the 6 columns (an all-to-all, half the bytes
    of a gather) and merging gives every row's block split alike: StridedShard(0, 5)."""
    meta_in, meta_out = TensorMeta.contiguous((5, 6), torch.float32), TensorMeta.contiguous((30,), torch.float32)
    call = OpCall(torch.ops.aten.view.default, (meta_in, [30]), {}, [meta_in], [meta_out])
    mesh = dist.ProcessMesh([0, 1])
    in_pl, out_pl, _ = engine.choose(call, mesh, [(S0,)], False)
    assert out_pl == [(StridedShard(0, 5),)] and in_pl == [(S1,)]
    even_in = TensorMeta.contiguous((4, 6), torch.float32)
    call = OpCall(torch.ops.aten.view.default, (even_in, [24]), {}, [even_in], [TensorMeta.contiguous((24,), torch.float32)])
    assert engine.choose(call, mesh, [(S0,)], False)[1] == [(S0,)]


def test_a_merge_cut_evenly_by_each_mesh_dim_alone_but_not_by_both_is_not_chosen():
    """(2, 4, 16, 16) -> (8, 16, 16) with the 4 heads split over both dims of a 2 x 2 mesh (tensor
    parallel, then Ulysses's "sep"): each mesh dim alone could move its cut to the 2 batch rows,
    both together cut them 4 ways, which the merge cannot take (the pieces would not be the new
    shape's); the second mesh dim takes another dim instead."""
    meta_in = TensorMeta.contiguous((2, 4, 16, 16), torch.float32)
    call = OpCall(torch.ops.aten.view.default, (meta_in, [8, 16, 16]), {}, [meta_in],
                  [TensorMeta.contiguous((8, 16, 16), torch.float32)])
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["mp", "sep"])
    in_pl, out_pl, _ = engine.choose(call, mesh, [(S1, S1)], False)
    assert [p for p in in_pl[0] if p == S0] == [S0], in_pl  # the rows cut by one mesh dim only


def test_a_partial_gradient_is_reduced_rather_than_kept_partial_by_gathering_a_weight():
    """Row-parallel backward: grad_input = grad_out(Partial) @ W(Shard(1)).  Gathering W keeps the
    product Partial, but that still needs its reduction and grad_out is reduced anyway for the
    weight gradient: one all-reduce of grad_out is the cheaper plan (Megatron's)."""
    mesh = dist.ProcessMesh([0, 1])
    g, w, out = (TensorMeta.contiguous(s, torch.float32) for s in ((256, 64), (64, 64), (256, 64)))
    call = OpCall(torch.ops.aten.mm.default, (g, w), {}, [g, w], [out])
    in_pl, out_pl, _ = engine.choose(call, mesh, [(Partial(),), (Shard(1),)], False)
    assert in_pl == [(Replicate(),), (Shard(1),)] and out_pl == [(Shard(1),)]
    # a Partial that needs no gather to stay Partial still flows on (reduced once, later)
    call = OpCall(torch.ops.aten.mm.default, (g, w), {}, [g, w], [out])
    assert engine.choose(call, mesh, [(Partial(),), (Replicate(),)], False)[1] == [(Partial(),)]
