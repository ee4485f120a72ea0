"""Rules that raise torch's errors and handle torch's edge cases (issue 26): softmax of an
integer tensor, empty gather indices, views of empty tensors, squeeze() of a piece holding
one row, out= overloads (linear_cross_entropy's chunks write the logits with mm(out=)).

Pure tests check the rules' strategies; numeric ones run on a real 2-rank world against the
single process (tests/opcheck.py), on Shard(0), Shard(-1) and Replicate inputs.
"""
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import Partial, Replicate, Shard
from autopar.spec import TensorMeta
from autopar.spmd import engine
from autopar.spmd.registry import rule_for
from autopar.spmd.strategy import OpCall
from distpool import run_dist
from opcheck import check

aten = torch.ops.aten
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _call(func, *args, **kwargs) -> OpCall:
    """OpCall of func on these (meta) tensors, as the dispatcher builds it."""
    metas = []

    def meta(a):
        if isinstance(a, torch.Tensor):
            metas.append(TensorMeta.of(a))
            return metas[-1]
        if isinstance(a, (list, tuple)):
            return type(a)(meta(x) for x in a)
        return a

    margs = tuple(meta(a) for a in args)  # before the call: an out= op resizes its out tensor
    mkwargs = {k: meta(v) for k, v in kwargs.items()}
    out = func(*args, **kwargs)
    outs = out if isinstance(out, (list, tuple)) else [out]
    return OpCall(func, margs, mkwargs, metas, [TensorMeta.of(o) for o in outs])


def _m(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _choose(call, current):
    return engine.choose(call, dist.ProcessMesh([0, 1]), current, False)


# -- pure rule tests -------------------------------------------------------------------------------
def test_softmax_of_a_dtype_torch_refuses_runs_whole():
    """No split for an integer softmax: the meta kernel accepts it, an empty piece returns,
    so only the whole tensor on every rank raises torch's error on every rank."""
    call = _call(aten._softmax.default, _m(3, 4, dtype=torch.long), 1, False)
    assert rule_for(call.func)(call) == []
    assert _choose(call, [(S1,)])[1] == [(R,)]
    float_call = _call(aten._softmax.default, _m(3, 4), 1, False)
    assert _choose(float_call, [(S1,)])[1:] == ([(S1,)], "softmax_split_dim")


def test_edge_shapes_give_strategies_not_index_errors():
    # an empty index of another rank than self lines up no dim, but may still split its own
    call = _call(aten.gather.default, _m(5), 0, _m(2, 0, dtype=torch.long))
    assert _choose(call, [(R,), (S0,)])[1] == [(S0,)]
    # an empty tensor's view: the leading equal dims keep their shards
    call = _call(aten.view.default, _m(4, 0), [4, 2, 0, 0, 0])
    assert _choose(call, [(S0,)])[1] == [(S0,)]
    call = _call(aten.view.default, _m(0, 6), [0, 2, 3])
    assert _choose(call, [(S0,)])[1] == [(S0,)]


def test_squeeze_all_squeezes_the_global_size_one_dims():
    """(1, 2, 2) split on dim 1 leaves pieces (1, 1, 2): a plain squeeze() of the piece would
    squeeze the split dim too."""
    call = _call(aten.squeeze.default, _m(1, 2, 2))
    assert _choose(call, [(S1,)])[1:] == ([(S0,)], "squeeze_global")
    assert _choose(_call(aten.squeeze.dim, _m(1, 2, 2), 0), [(S1,)])[1:] == ([(S0,)], None)


def test_out_overloads_place_the_out_tensor_as_the_output():
    a, b, out = _m(4, 3), _m(3, 5), _m(4, 5)
    call = _call(aten.mm.out, a, b, out=out)
    in_pl, out_pl, kernel = _choose(call, [(S0,), (R,), (S0,)])
    assert in_pl == [(S0,), (R,), (S0,)] and out_pl == [(S0,)] and kernel is None
    assert _choose(call, [(R,), (S1,), (S1,)])[1] == [(S1,)]
    # an out tensor torch resizes stays whole
    assert rule_for(aten.mm.out)(_call(aten.mm.out, a, b, out=_m(0))) == []


# -- numeric tests on 2 ranks ------------------------------------------------------------------------
def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the error itself is the result compared
        return type(e).__name__, str(e).split("\n")[0]
    return None


def _torch_errors():
    """The distributed op raises torch's error (type and message) on every rank."""
    mesh = dist.ProcessMesh([0, 1])
    x = torch.arange(12).reshape(3, 4)
    results = []
    for fn in (lambda t: torch.softmax(t, 1), lambda t: torch.log_softmax(t, 1), lambda t: torch.softmax(t, 0)):
        want = _raises(fn, x)
        assert want is not None
        for p in (S0, S1, R):
            got = _raises(fn, dist.shard_tensor(x, mesh, [p]))
            assert got == want, (p, got, want)
            results.append(got)
    # one row on two ranks: rank 1's piece is empty, where torch's kernel would not raise
    assert _raises(torch.softmax, dist.shard_tensor(x[:1], mesh, [S0]), 1) == _raises(torch.softmax, x[:1], 1)
    return results


def test_integer_softmax_raises_torchs_error_on_every_rank():
    ranks = run_dist(_torch_errors, 2)
    assert ranks[0] == ranks[1] and len(ranks[0]) == 9


def _placed(inputs, kind):
    """Every input of 1 dim or more split on dim 0 / its last dim, or Replicate."""
    return [[R if kind == "R" or x.dim() == 0 else Shard(0 if kind == "S0" else x.dim() - 1)] for x in inputs]


def _edge_values():
    torch.manual_seed(0)
    mesh = dist.ProcessMesh([0, 1])
    chunked = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    lce = lambda red: lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction=red, options=chunked)  # noqa: E731
    cases = [
        (lambda a, b: torch.tensordot(a, b, dims=([0, 1], [2, 0])), [torch.randn(2, 2, 1), torch.randn(2, 1, 2)]),
        (lambda a, b: torch.tensordot(a, b, dims=2), [torch.randn(2, 3, 4), torch.randn(3, 4, 5)]),
        (lambda a, i: torch.gather(a, 0, i), [torch.randn(5), torch.zeros(2, 0, dtype=torch.long)]),
        (lambda a, i: torch.gather(a, 0, i), [torch.randn(5), torch.zeros(0, dtype=torch.long)]),
        (lambda a: a.unflatten(1, (2, 0, 0, 0)), [torch.randn(4, 0)]),
        (lambda a: a.unflatten(0, (2, 2)), [torch.randn(4, 0)]),
        (lambda a: a.squeeze(), [torch.randn(1, 2, 2)]),
        (lambda a: a.squeeze() * 2, [torch.randn(2, 1, 3)]),
        (lce("none"), [torch.randn(8, 3), torch.randn(4, 3), torch.randint(0, 4, (8,))]),
        (lce("sum"), [torch.randn(8, 3), torch.randn(4, 3), torch.randint(0, 4, (8,))]),
        (lce("mean"), [torch.randn(5, 3), torch.randn(4, 3), torch.randint(0, 4, (5,))]),
        (lce("none"), [torch.randn(3), torch.randn(4, 3), torch.tensor(2)]),
    ]
    n = 0
    for i, (fn, inputs) in enumerate(cases):
        for kind in ("S0", "S-1", "R"):
            try:
                check(fn, inputs, _placed(inputs, kind), mesh)
            except AssertionError as e:
                raise AssertionError(f"case {i} on {kind}: {e}") from e
            n += 1
    return n


def test_edge_shapes_give_torchs_values():
    assert run_dist(_edge_values, 2)[0] == 36
