"""Rules of autopar/spmd/tensor_ops.py and embedding.py: cat/stack/split/slice/select, index ops,
gather/scatter, tril/roll/flip/repeat, embedding (batch, column and vocab sharded).

Numeric checks run forward and backward against the single process (tests/opcheck.py) on 1-D
meshes of 2 and 4 ranks and on the 2-D mesh [[2, 0], [1, 3]], with uneven sizes.
"""
import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import Partial, Replicate, Shard
from autopar.placement import StridedShard
from autopar.spmd import engine
from autopar.spmd.registry import rule_for
from distpool import run_dist
from opcheck import check
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
PMAX = Partial("max")
MESH_2D = [[2, 0], [1, 3]]
# unruled ops these tests reach that belong to other families (reductions)
OTHERS = {"aten.sum.default", "aten.sum.dim_IntList"}


# -- helpers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _only_others_unruled():
    """Fail if an op without a rule, other than the reductions the losses use, is reached."""
    engine._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught]
    names = {m.split("rule for ")[1].split(";")[0] for m in messages if "no sharding rule" in m}
    assert names <= OTHERS, f"ops without a rule: {sorted(names - OTHERS)}"


def _placements(out):
    if isinstance(out, (list, tuple)):
        return [_placements(o) for o in out]
    return out.placements


def _run(mesh, cases):
    """cases: (fn, inputs, placements, expected output placements or None, communicates?)."""
    mesh = dist.ProcessMesh(mesh)
    with _only_others_unruled():
        for i, (fn, inputs, placements, expect, comm) in enumerate(cases):
            out, log = check(fn, inputs, placements, mesh)
            if expect is not None:
                assert _placements(out) == expect, f"case {i}: {_placements(out)} != {expect}"
            if not comm:
                assert len(log) == 0, f"case {i}: communicated {list(log)}"


def _grad_placements(fn, arg, seen):
    """fn that records the placements of the gradient reaching its input `arg` (distributed run)."""

    def wrapped(*xs):
        if dist.is_dist_tensor(xs[arg]) and xs[arg].requires_grad:
            xs[arg].register_hook(lambda g: seen.append(g.placements))
        return fn(*xs)

    return wrapped


# -- pure rule tests -------------------------------------------------------------------------------
def test_rules_registered():
    ops = [
        aten.cat.default, aten.stack.default, aten.split.Tensor, aten.split_with_sizes.default,
        aten.unbind.int, aten.slice.Tensor, aten.select.int, aten.slice_backward.default,
        aten.select_backward.default, aten.index_select.default, aten.index_add.default,
        aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
        aten.scatter_.src, aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
        aten._index_put_impl_.default, aten.tril.default, aten.triu_.default, aten.roll.default,
        aten.flip.default, aten.repeat.default, aten.embedding.default, aten.embedding_dense_backward.default,
    ]
    assert [op for op in ops if rule_for(op) is None] == []


def test_engine_choices():
    mesh = dist.ProcessMesh([0, 1])
    # cat moves a shard off the cat dim (all-to-all is cheaper than a gather); another dim keeps it
    call = _call(aten.cat.default, [_m(4, 6), _m(3, 6)], 0)
    assert engine.choose(call, mesh, [(S0,), (S0,)], False)[1] == [(S1,)]
    assert engine.choose(call, mesh, [(S1,), (S1,)], False)[1] == [(S1,)]
    # a slice taking the whole dim keeps its shard; a real slice of it does not
    assert engine.choose(_call(aten.slice.Tensor, _m(5, 6), 0, 0, 5), mesh, [(S0,)], False)[1] == [(S0,)]
    assert engine.choose(_call(aten.slice.Tensor, _m(5, 6), 0, 1, 5), mesh, [(S0,)], False)[1] == [(S1,)]
    # non-adjacent advanced indexing puts the index dims first: x[i, :, j] keeps x's dim 1 as dim 1
    i = _m(4, dtype=torch.long)
    call = _call(aten.index.Tensor, _m(5, 6, 7), [i, None, i])
    assert engine.choose(call, mesh, [(S1,), (R,), (R,)], False)[1] == [(S1,)]
    assert engine.choose(call, mesh, [(R,), (S0,), (S0,)], False)[1] == [(S0,)]
    # vocab-sharded embedding: Partial forward with the masking kernel; the weight gradient from a
    # Replicate grad is built for this rank's rows only (the memory tie-break beats all-Replicate)
    ids = _m(3, 5, dtype=torch.long)
    _, out, kernel = engine.choose(_call(aten.embedding.default, _m(10, 4), ids), mesh, [(S0,), (R,)], False)
    assert (out, kernel) == ([(P,)], "vocab_embedding")
    call = _call(aten.embedding_dense_backward.default, _m(3, 5, 4), ids, 10, -1, False)
    assert engine.choose(call, mesh, [(R,), (R,)], False)[1:] == ([(S0,)], "vocab_embedding_backward")
    assert engine.choose(call, mesh, [(S0,), (S0,)], False)[1] == [(P,)]
    assert engine.choose(call, mesh, [(S2,), (R,)], False)[1] == [(S1,)]
    # batch-sharded backward would count frequencies locally: not offered with scale_grad_by_freq
    call = _call(aten.embedding_dense_backward.default, _m(3, 5, 4), ids, 10, -1, True)
    assert engine.choose(call, mesh, [(S0,), (S0,)], False)[1] != [(P,)]


# -- numeric tests ------------------------------------------------------------------------------------
def _join_cut(world):
    torch.manual_seed(0)
    a, b, c = torch.randn(5, 6), torch.randn(3, 6), torch.randn(5, 2)
    cat0 = lambda x, y: torch.cat([x, y])  # noqa: E731
    cat1 = lambda x, y: torch.cat([x, y], 1)  # noqa: E731
    whole = lambda x: x.narrow(0, 0, 5)  # noqa: E731
    cases = [
        (cat0, [a, b], [[S1], [S1]], [S1], False),
        (cat0, [a, b], [[S0], [R]], None, True),
        (cat1, [a, c], [[S0], [S0]], [S0], False),
        (cat1, [a, c], [[P], [P]], [P], False),
        # equal pieces split on the cat dim give a StridedShard, an empty one too (each block empty)
        (cat0, [torch.randn(0), torch.randn(0)], [[S0], [S0]], [StridedShard(0, 2)], False),
        (lambda x, y: torch.cat([x, y]) * 2, [torch.randn(0, 3), torch.randn(0, 3)], [[S0], [S0]], None, False),
        (lambda x: torch.stack([x, x * 2], 1), [a], [[S0]], [S0], False),
        (lambda x: torch.stack([x, x]), [a], [[S1]], [S2], False),
        (lambda x: x.split(2, 1), [a], [[S0]], [[S0]] * 3, False),
        (lambda x: x.split([1, 5], 1), [a], [[S0]], [[S0]] * 2, False),
        (lambda x: x.chunk(2, 0), [a], [[S1]], [[S1]] * 2, False),
        (lambda x: x.split(2, 0), [a], [[S0]], None, True),
        (lambda x: x.unbind(0), [a], [[S1]], [[S0]] * 5, False),
        (lambda x: x.unbind(1), [a], [[P]], [[P]] * 6, False),
        (lambda x: x.narrow(1, 1, 3), [a], [[S0]], [S0], False),
        (lambda x: x[:, 1:5:2], [a], [[S0]], [S0], False),
        (lambda x: x[1:4], [a], [[S0]], None, True),
        (whole, [a], [[S0]], [S0], False),
        (lambda x: x[:, -1], [a], [[S0]], [S0], False),
        (lambda x: x[3], [a], [[S1]], [S0], False),
        (lambda x: x[1:3, 2], [a], [[P]], [P], False),
    ]
    _run(list(range(world)), cases)
    if world == 4:
        _run(MESH_2D, [
            (cat1, [a, c], [[S0, P], [S0, P]], [S0, P], False),
            (lambda x: x.split(4, 1), [a], [[S0, S0]], [[S0, S0]] * 2, False),
            (lambda x: x[:, 2:5], [a], [[R, S0]], [R, S0], False),
            (lambda x: torch.stack([x, x], 2)[:, :, 1], [a], [[S0, S1]], [S0, S1], False),
        ])


def _index_ops(world):
    torch.manual_seed(0)
    a = torch.randn(5, 6)
    idx = torch.tensor([4, 0, 2, 2, 1])
    uniq = torch.tensor([3, 0, 4])
    gi = torch.randint(0, 6, (5, 3))
    gi0 = torch.randint(0, 5, (7, 6))
    src = torch.randn(5, 3)
    x3 = torch.randn(4, 5, 3)
    i2 = torch.tensor([[0, 3], [2, 2], [1, 0]])
    put = lambda x, i, v: x.index_put((i,), v)  # noqa: E731
    put_acc = lambda x, i, v: x.index_put((i,), v, accumulate=True)  # noqa: E731
    put_cols = lambda x, i, v: aten.index_put(x, [None, i], v, True)  # noqa: E731
    cases = [
        (lambda x, i: x.index_select(0, i), [a, idx], [[S1], None], [S1], False),
        (lambda x, i: x.index_select(1, i), [a, idx], [[R], [S0]], [S1], False),
        (lambda x, i: x.index_select(0, i), [a, idx], [[P], None], [P], False),
        (lambda x, i: x.gather(1, i), [a, gi], [[S0], [S0]], [S0], False),
        (lambda x, i: x.gather(0, i), [a, gi0], [[R], [S0]], [S0], False),
        (lambda x, i, s: x.scatter(1, i, s), [a, gi, src], [[S0], [S0], [S0]], [S0], False),
        (lambda x, i, s: x.scatter(1, i, s), [a, gi, src], [[P], None, [P]], [P], False),
        (lambda x, i: x.scatter(1, i, 0.5), [a, gi], [[PMAX], None], [PMAX], False),
        (lambda x, i, s: x.scatter_add(1, i, s), [a, gi, src], [[S0], [S0], [S0]], [S0], False),
        (lambda x, i, s: x.scatter_add(0, i, s), [a, gi0, torch.randn(7, 6)], [[R], [S0], [S0]], [P], False),
        (lambda x, i: x[i], [a, idx], [[S1], None], [S1], False),
        (lambda x, i: x[i], [a, idx], [[R], [S0]], [S0], False),
        (lambda x, i: x[:, i], [a, idx], [[S0], None], [S0], False),
        (lambda x, i: x[i], [a, i2], [[R], [S1]], [S1], False),
        (lambda x, i: x[i, :, i], [x3, torch.tensor([2, 0])], [[S1], None], [S1], False),
        (put, [a, uniq, torch.randn(3, 6)], [[S1], None, [S1]], [S1], False),
        (put_acc, [a, idx, torch.randn(5, 6)], [[R], [S0], [S0]], [P], False),
        (put_cols, [a, idx, torch.randn(5)], [[S0], None, [R]], [S0], False),
    ]
    _run(list(range(world)), cases)
    if world == 4:
        _run(MESH_2D, [
            (lambda x, i: x[i], [a, idx], [[S1, R], [R, S0]], [S1, S0], False),
            (lambda x, i: x.gather(1, i), [a, gi], [[S0, P], [S0, R]], [S0, P], False),
            (lambda x, i: x.index_select(1, i), [a, idx], [[S0, R], [R, S0]], [S0, S1], False),
        ])


def _masks_perms(world):
    torch.manual_seed(0)
    a, x3 = torch.randn(5, 6), torch.randn(3, 5, 6)
    cases = [
        (lambda x: x.tril(1), [x3], [[S0]], [S0], False),
        (lambda x: x.tril(-1), [a], [[S0]], [S0], False),
        (lambda x: x.triu(2), [a], [[S1]], [S1], False),
        (lambda x: x.triu(), [x3], [[S2]], [S2], False),
        (lambda x: x.tril(), [a], [[P]], [P], False),
        (lambda x: x.roll(2, 1), [a], [[S0]], [S0], False),
        (lambda x: x.roll((1, -2), (0, 1)), [a], [[S0]], None, True),
        (lambda x: x.roll(3), [a], [[S1]], None, True),
        (lambda x: x.flip(1), [x3], [[S2]], [S2], False),
        (lambda x: x.flip(0, 2), [x3], [[S1]], [S1], False),
        (lambda x: x.repeat(2, 1), [a], [[S1]], [S1], False),
        (lambda x: x.repeat(2, 1, 1), [a], [[S0]], [S1], False),
        (lambda x: x.repeat(1, 3), [a], [[P]], [P], False),
    ]
    _run(list(range(world)), cases)
    if world == 4:
        _run(MESH_2D, [
            (lambda x: x.tril(1), [a], [[S0, S1]], [S0, S1], False),
            (lambda x: x.triu(-1), [x3], [[S2, S1]], [S2, S1], False),
            (lambda x: x.flip(0), [x3], [[S1, S2]], [S1, S2], False),
        ])


def _embedding(world):
    torch.manual_seed(0)
    w = torch.randn(11, 4)
    ids = torch.randint(0, 11, (3, 5))
    ids[0, 0] = ids[2, 3] = 7  # the padding row (on the third of four vocab pieces)
    v = torch.randn(3, 5, 4)  # multiplies the output: its placement sets the grad's
    emb = lambda w, i: F.embedding(i, w)  # noqa: E731
    pad = lambda w, i: F.embedding(i, w, padding_idx=7)  # noqa: E731
    freq = lambda w, i: F.embedding(i, w, padding_idx=7, scale_grad_by_freq=True)  # noqa: E731
    scaled = lambda w, i, v: F.embedding(i, w, padding_idx=7) * v  # noqa: E731
    seen = []
    cases = [
        # weight gradients recorded in `seen`, in this order
        (_grad_placements(pad, 0, seen), [w, ids], [[S0], None], [P], False),
        (_grad_placements(freq, 0, seen), [w, ids], [[S0], [R]], [P], False),
        (_grad_placements(scaled, 0, seen), [w, ids, v], [[S1], None, [S2]], [S2], False),
        (_grad_placements(pad, 0, seen), [w, ids], [[R], [S1]], [S1], False),
        (emb, [w, ids], [[R], [S0]], [S0], False),
        (emb, [w, ids], [[S1], None], [S2], False),
        (freq, [w, ids], [[S1], [S0]], None, True),
        (emb, [w, ids], [[P], None], [P], False),
        (emb, [torch.randn(3, 4), ids % 3], [[S0], None], [P], False),  # 4 ranks: one holds no rows
    ]
    _run(list(range(world)), cases)
    assert seen == [[S0], [S0], [S1], [P]], seen
    if world == 4:
        seen.clear()
        _run(MESH_2D, [
            (_grad_placements(scaled, 0, seen), [w, ids, v], [[S0, S1], None, [R, S2]], [P, S2], False),
            (_grad_placements(pad, 0, seen), [w, ids], [[R, S0], [S0, R]], [S0, P], False),
            (_grad_placements(freq, 0, seen), [w, ids], [[S0, S0], None], [P, P], False),
        ])
        assert seen == [[S0, S1], [P, S0], [S0, S0]], seen


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", [_join_cut, _index_ops, _masks_perms, _embedding], ids=lambda f: f.__name__[1:])
def test_numeric(family, world):
    run_dist(family, world, world)
