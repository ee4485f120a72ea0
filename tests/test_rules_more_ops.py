"""Rules that raise torch's errors and handle torch's edge cases (issue 26): softmax of an
integer tensor, empty gather indices, views of empty tensors, squeeze() of a piece holding
one row, out= overloads (linear_cross_entropy's chunks write the logits with mm(out=)).

Pure tests check the rules' strategies; numeric ones run on a real 2-rank world against the
single process (tests/opcheck.py), on Shard(0), Shard(-1) and Replicate inputs.
"""
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar import Partial, Replicate, Shard
from autopar.spmd import engine
from autopar.spmd.registry import RULE_FNS, RULES, register, rule_for
from autopar.spmd.strategy import OpStrategy
from distpool import run_dist
from opcheck import check
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


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


def test_where_keeps_partial_values_under_a_whole_condition():
    """where(c, a, b) is linear in (a, b) together: Partial a and b stay Partial (out= too)."""
    c, a, b, out = _m(4, 3, dtype=torch.bool), _m(4, 3), _m(4, 3), _m(4, 3)
    assert _choose(_call(aten.where.self, c, a, b), [(R,), (P,), (P,)])[:2] == ([(R,), (P,), (P,)], [(P,)])
    call = _call(aten.where.self_out, c, a, b, out=out)
    assert _choose(call, [(R,), (P,), (P,), (R,)])[:2] == ([(R,), (P,), (P,), (P,)], [(P,)])
    # a number in place of a or b would join every rank's term: only splits
    assert all(P not in s.inputs for s in rule_for(aten.where.ScalarOther)(_call(aten.where.ScalarOther, c, a, 2.0)))


_LIB = torch.library.Library("autopar_rules_test", "DEF")
_LIB.define("twice(Tensor t) -> Tensor")
_LIB.impl("twice", lambda t: t * 2, "CompositeExplicitAutograd")


def test_a_second_rule_for_an_op_overload_raises_naming_both():
    op = torch.ops.autopar_rules_test.twice.default

    def first_rule(call):
        return []

    def second_rule(call):
        return []

    register(op)(first_rule)
    try:
        with pytest.raises(ValueError, match=r"autopar_rules_test\.twice\.default .*first_rule.*second_rule"):
            register(op)(second_rule)
        assert rule_for(op) is first_rule
    finally:
        del RULES[op], RULE_FNS[op]


def test_every_rule_module_registers_on_import_and_claims_its_ops_alone():
    """A fresh process imports autopar.spmd (every rule module must be among its imports) and
    then every module in the package: register raises on an overload claimed twice."""
    script = (
        "import importlib, pkgutil, sys, autopar.spmd as spmd\n"
        "names = [m.name for m in pkgutil.iter_modules(spmd.__path__)]\n"
        "print([n for n in names if 'autopar.spmd.' + n not in sys.modules])\n"
        "for n in names: importlib.import_module('autopar.spmd.' + n)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"rule modules autopar.spmd does not import: {done.stdout}"


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


# -- rules for ops that ran replicated: pure ---------------------------------------------------------
def _strategies(func, *args, **kwargs):
    call = _call(func, *args, **kwargs)
    return call, rule_for(func)(call)


def test_order_statistics_split_every_other_dim():
    for func, args in ((aten.sort.default, (1,)), (aten.topk.default, (3, 1)), (aten.kthvalue.default, (2, 1)),
                       (aten.median.dim, (1,)), (aten.mode.default, (1,))):
        _, got = _strategies(func, _m(5, 6), *args)
        assert [s.inputs for s in got] == [(S0,)], func
    _, got = _strategies(aten.kthvalue.default, _m(5, 6, 4), 2, 1)  # keepdim=False: dim 2 moves to 1
    assert [(s.inputs, s.outputs) for s in got] == [((S0,), (S0, S0)), ((Shard(2),), (S1, S1))]
    _, got = _strategies(aten.glu.default, _m(5, 6), 1)
    assert [s.inputs for s in got] == [(S0,)]


def test_batched_linear_algebra_splits_batch_dims_only():
    call, got = _strategies(aten._linalg_solve_ex.default, _m(4, 3, 3), _m(4, 3))  # B a batch of vectors
    assert got[0] == OpStrategy((S0,) * 4, (S0, S0)) and len(got) == 3  # + Partial(sum/avg) through B
    assert got[1] == OpStrategy((P, R, R, R), (R, P))
    # broadcast batch (2, 5): A's LU keeps A's batch (2, 1), so only the batch dim A has splits
    _, got = _strategies(aten._linalg_solve_ex.default, _m(2, 1, 3, 3), _m(5, 3, 2))
    assert [(s.inputs, s.outputs[:2]) for s in got if type(s.outputs[0]) is Shard] == [((S0, R), (S0, S0))]
    _, got = _strategies(aten.linalg_inv_ex.default, _m(4, 3, 3), check_errors=True)
    assert got == []  # an op raising on some matrices runs whole: every rank raises
    info = _m(4, dtype=torch.int32)
    assert _strategies(aten._linalg_check_errors.default, info, "linalg.inv", is_matrix=False)[1] == []


def test_views_keep_the_dims_they_leave_alone():
    _, got = _strategies(aten.diagonal.default, _m(4, 5, 6), 0, 0, 2)
    assert [(s.inputs, s.outputs) for s in got if type(s.outputs[0]) is Shard] == [((S1,), (S0,))]
    _, got = _strategies(aten.diag_embed.default, _m(4, 5))
    assert [(s.inputs, s.outputs) for s in got if type(s.outputs[0]) is Shard] == [((S0,), (S0,))]
    _, got = _strategies(aten.select_scatter.default, _m(4, 5, 6), _m(4, 6), 1, 2)
    assert [s.inputs for s in got if type(s.outputs[0]) is Shard] == [(S0, S0), (Shard(2), S1)]
    # as_strided: a transposed view of a (5, 6) tensor; overlapping windows are no plain view
    _, got = _strategies(aten.as_strided.default, _m(5, 6), (6, 5), (1, 6))
    assert {(s.inputs, s.outputs, s.kernel) for s in got if type(s.outputs[0]) is Shard} == {
        ((S0,), (S1,), "as_strided_piece"), ((S1,), (S0,), "as_strided_piece")}
    assert _strategies(aten.as_strided.default, _m(5, 6), (4, 3), (1, 1))[1] == []


def test_losses_keep_a_broadcast_weight_whole():
    _, got = _strategies(aten.binary_cross_entropy_with_logits.default, _m(5, 6), _m(5, 6), None, _m(6), 1)
    assert [(s.inputs, s.outputs) for s in got] == [((S0, S0, R), (Partial("avg"),)),
                                                    ((S1, S1, S0), (Partial("avg"),))]


# -- rules for ops that ran replicated: every op against one process on 2 ranks -----------------------
# Each case: fn, inputs, and the splits to run besides all-Replicate: (placements per input, the bytes
# the forward may all-gather).  A split the rule serves gathers nothing (the checking solves gather
# each matrix's int32 info, so every rank raises on a singular one); a split on a dim the op mixes
# (sort's dim...) gathers and must still give torch's numbers.
S2 = Shard(2)
KEPT, GATHERS, INFO = 0, None, 8  # bytes a rank may all-gather: none, any, its matrices' int32 info
# backwards the dispatcher runs whole (no meta kernel infers their shape): no rule is asked
NO_META_KERNEL = {"aten.multi_margin_loss_backward.default", "aten.multilabel_margin_loss_backward.default"}


def _differentiable(fn, inputs) -> bool:
    """Whether torch has a backward for fn here (special functions mostly have none)."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    try:
        out = fn(*leaves)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            sum(o.abs().sum() for o in outs).backward()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _splits(family: str):
    """Run every case of `family` (the name of its builder: lambdas do not pickle) with its
    splits and all-Replicate; returns how many runs were checked."""
    cases = globals()[family]()
    mesh = dist.ProcessMesh([0, 1])
    engine._WARNED.clear()
    runs = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (fn, inputs, splits) in enumerate(cases):
            grad = _differentiable(fn, inputs)
            for placements, may_gather in splits + [([R] * len(inputs), KEPT)]:
                pl = [None if p is None else [Shard(p.dim % inputs[j].dim()) if type(p) is Shard else p]
                      for j, p in enumerate(placements)]
                try:
                    _, log = check(fn, inputs, pl, mesh, grad=grad, rtol=1e-4, atol=1e-5)
                except AssertionError as e:
                    raise AssertionError(f"case {i} {placements}: {e}") from e
                if may_gather is not None:
                    gathers = [r for r in log if r.op == "all_gather" and r.bytes > may_gather]
                    assert not gathers, f"case {i} {placements}: {list(log)}"
                runs += 1
    messages = [str(w.message) for w in caught]
    unruled = {m.split("rule for ")[1].split(";")[0] for m in messages if "no sharding rule" in m}
    assert not unruled - NO_META_KERNEL, sorted(unruled)
    return runs


def _run_family(builder):
    return run_dist(_splits, 2, builder.__name__)[0]


def _pointwise_cases():
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    u, v = torch.rand(5, 6) * 0.8 + 0.1, torch.rand(5, 6) * 0.8 + 0.1
    n = torch.randint(0, 4, (5, 6)).float()
    sp = torch.special
    unary = [
        (torch.acosh, 1 / u), (torch.asinh, x), (torch.atanh, u), (torch.angle, x), (torch.digamma, u),
        (torch.erfinv, u), (torch.i0, x), (torch.lgamma, u), (torch.sinc, x), (torch.isneginf, x),
        (torch.isposinf, x), (lambda t: F.hardshrink(t, 0.3), x), (lambda t: F.softshrink(t, 0.3), x),
        (lambda t: torch.mvlgamma(t, 1), u + 1), (lambda t: torch.polygamma(1, t), u), (torch.frexp, x),
        (lambda t: F.threshold(t, 0.1, 2.0), x), (torch.deg2rad, x), (torch.rad2deg, x), (F.logsigmoid, x),
        (lambda t: torch.logit(t, 1e-3), u), (lambda t: torch.complex(t, t).conj_physical(), x),
        (sp.airy_ai, x), (sp.bessel_j0, x), (sp.bessel_j1, x), (sp.bessel_y0, u), (sp.bessel_y1, u),
        (sp.entr, u), (sp.erfcx, x), (sp.i0e, x), (sp.i1, x), (sp.i1e, x), (sp.log_ndtr, x), (sp.ndtri, u),
        (sp.modified_bessel_i0, x), (sp.modified_bessel_i1, x), (sp.modified_bessel_k0, u),
        (sp.modified_bessel_k1, u), (sp.scaled_modified_bessel_k0, u), (sp.scaled_modified_bessel_k1, u),
        (sp.spherical_bessel_j0, x),
    ]
    binary = [
        (torch.igamma, u, v), (torch.igammac, u, v), (torch.logaddexp2, x, y), (torch.nextafter, x, y),
        (torch.ldexp, x, n), (torch.complex, x, y), (torch.polar, u, x), (sp.xlog1py, x, u), (sp.zeta, u + 1, v),
        (sp.chebyshev_polynomial_t, x, n), (sp.chebyshev_polynomial_u, x, n), (sp.chebyshev_polynomial_v, x, n),
        (sp.chebyshev_polynomial_w, x, n), (sp.hermite_polynomial_h, x, n), (sp.hermite_polynomial_he, x, n),
        (sp.laguerre_polynomial_l, x, n), (sp.legendre_polynomial_p, x, n),
        (sp.shifted_chebyshev_polynomial_t, u, n), (sp.shifted_chebyshev_polynomial_u, u, n),
        (sp.shifted_chebyshev_polynomial_v, u, n), (sp.shifted_chebyshev_polynomial_w, u, n),
    ]
    cases = [(fn, [t], [([S0], KEPT), ([S1], KEPT)]) for fn, t in unary]
    cases += [(fn, [a, b], [([S0, S0], KEPT), ([S1, R], KEPT)]) for fn, a, b in binary]
    w = torch.rand(3) + 0.1
    cases += [
        (F.prelu, [torch.randn(4, 3, 5), w], [([S0, R], KEPT), ([S1, S0], KEPT), ([S2, R], KEPT)]),
        (lambda t: F.glu(t, 1), [x], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda a, b: torch.linalg.cross(a, b), [torch.randn(5, 3), torch.randn(5, 3)],
         [([S0, S0], KEPT), ([S1, S1], GATHERS)]),
    ]
    return cases


def test_pointwise_rules_split_without_gathering():
    assert _run_family(_pointwise_cases) == 41 * 3 + 21 * 3 + 4 + 3 + 3


def _reduction_cases():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    ties = torch.randint(0, 3, (5, 6)).float()
    nans = x.masked_fill(x > 1, float("nan"))
    aten_norm = torch.ops.aten.norm
    along = [
        lambda t: torch.sort(t, 1), lambda t: torch.sort(t, dim=1, stable=True, descending=True),
        lambda t: torch.topk(t, 3, 1), lambda t: torch.kthvalue(t, 2, 1), lambda t: torch.kthvalue(t, 2, 1, True),
        lambda t: torch.median(t, 1), lambda t: torch.nanmedian(t, 1), lambda t: torch.msort(t.t()),
        lambda t: torch.std_mean(t, 1), lambda t: torch.var_mean(t, 1, keepdim=True),
    ]
    cases = [(fn, [x], [([S0], KEPT), ([S1], GATHERS)]) for fn in along]
    cases += [
        (lambda t: torch.mode(t, 1), [ties], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda t: torch.nanmedian(t, 1), [nans], [([S0], KEPT)]),
        (lambda t: torch.nansum(t, 1), [nans], [([S0], KEPT), ([S1], KEPT)]),
        (lambda t: torch.count_nonzero(t, 1), [ties], [([S0], KEPT), ([S1], KEPT)]),
        (lambda t: torch.aminmax(t, dim=1), [x], [([S0], KEPT), ([S1], KEPT)]),
        (lambda t: torch.aminmax(t), [x], [([S0], KEPT)]),
        (lambda t: aten_norm.ScalarOpt_dim(t, 3, [1]), [x], [([S0], KEPT), ([S1], KEPT)]),
        (lambda t: aten_norm.Scalar(t, 1), [x], [([S0], KEPT)]),
        (lambda a, b: F.pairwise_distance(a, b), [x, x.flip(0)], [([S0, S0], KEPT), ([S1, S1], KEPT)]),
        (lambda t: torch.histc(t, 4, -1, 1), [x], [([S0], KEPT), ([S1], KEPT)]),
        (lambda t: torch.renorm(t, 2, 0, 1.0), [x], [([S0], KEPT), ([S1], GATHERS)]),
        (torch.trace, [x], [([S0], KEPT), ([S1], KEPT)]),
        (torch.dist, [x, x.flip(1)], [([S0, S0], KEPT), ([S1, S1], KEPT)]),
        (lambda a, b: torch.dist(a, b, 3), [x, x.flip(1)], [([S1, S1], KEPT)]),
    ]
    return cases


def test_reduction_and_order_rules_split_without_gathering():
    assert _run_family(_reduction_cases) == 68


def _spd(b, n):
    a = torch.randn(b, n, n)
    return a @ a.mT + n * torch.eye(n)


def _linalg_cases():
    torch.manual_seed(0)
    la = torch.linalg
    A, B, b = torch.randn(4, 3, 3) + 3 * torch.eye(3), torch.randn(4, 3, 2), torch.randn(4, 3)
    spd, tri = _spd(4, 3), torch.randn(4, 3, 3).triu() + 3 * torch.eye(3)
    L = torch.linalg.cholesky(spd)
    lu, piv = torch.linalg.lu_factor(A)
    ldl, ldl_piv = torch.linalg.ldl_factor(spd)
    batch = [([S0] * 2, INFO), ([S1, S1], GATHERS)]
    one = [([S0], KEPT), ([S1], GATHERS)]
    cases = [
        (la.solve, [A, B], batch), (la.solve, [A, b], [([S0, S0], INFO), ([R, S0], INFO)]),
        (lambda a, y: la.solve_triangular(a, y, upper=True), [tri, B], batch),
        (lambda y, a: torch.triangular_solve(y, a), [B, tri], batch),
        (torch.cholesky_solve, [B, L], batch), (lambda y: la.lu_solve(lu, piv, y), [B], one),
        (lambda y: la.ldl_solve(ldl, ldl_piv, y), [B], one),
        (lambda a: la.cholesky_ex(a).L, [spd], one), (lambda a: la.inv_ex(a).inverse, [A], one),
        (lambda a: la.lu_factor_ex(a)[:2], [A], one), (lambda a: la.lu(a), [A], one),
        (lambda a: torch.lu_unpack(*la.lu_factor(a)), [A], [([S1], GATHERS)]),
        (torch.cholesky_inverse, [L], one), (la.det, [A], one), (la.slogdet, [A], one),
        (lambda a: la.eigh(a).eigenvalues, [spd], one), (la.eigvals, [A], one),
        (lambda a: la.svd(a, full_matrices=False).S, [A], one), (lambda a: la.qr(a).R.abs(), [A], one),
        (la.householder_product, [torch.randn(4, 3, 2), torch.rand(4, 2)], [([S0, S0], KEPT)]),
        (la.matrix_exp, [A * 0.1], one), (la.pinv, [A], one),
        (torch.ormqr, [*torch.geqrf(A), B], [([S0, S0, S0], KEPT), ([R, R, S2], KEPT)]),
        # the checking variants run whole on every rank (values equal, errors on every rank)
        (la.inv, [A], [([S0], INFO)]), (la.cholesky, [spd], [([S0], INFO)]), (torch.cholesky, [spd], [([S0], GATHERS)]),
    ]
    mat = [
        (lambda c, m, v: torch.addmv(c, m, v, beta=0.5), [torch.randn(5), torch.randn(5, 6), torch.randn(6)],
         [([S0, S0, R], KEPT), ([R, S1, S0], KEPT)]),
        (lambda c, p, q: torch.addr(c, p, q, alpha=2), [torch.randn(5, 6), torch.randn(5), torch.randn(6)],
         [([S0, S0, R], KEPT), ([S1, R, S0], KEPT)]),
        (torch.addbmm, [torch.randn(5, 6), torch.randn(3, 5, 4), torch.randn(3, 4, 6)],
         [([R, S0, S0], KEPT), ([S0, S1, R], KEPT)]),
        (torch.vdot, [torch.randn(7), torch.randn(7)], [([S0, S0], KEPT)]),
        (F.bilinear, [torch.randn(5, 3), torch.randn(5, 4), torch.randn(2, 3, 4), torch.randn(2)],
         [([S0, S0, R, R], KEPT), ([R, R, S0, S0], KEPT), ([S1, R, S1, R], KEPT)]),
        (torch.cdist, [torch.randn(5, 3), torch.randn(4, 3)], [([S0, R], KEPT), ([R, S0], KEPT), ([S1, S1], GATHERS)]),
        (torch.cdist, [torch.randn(2, 5, 3), torch.randn(2, 4, 3)], [([S0, S0], KEPT), ([S1, R], KEPT)]),
    ]
    return cases + mat


def test_linalg_and_matmul_rules_split_batch_dims_without_gathering():
    assert _run_family(_linalg_cases) == 95


def _view_cases():
    torch.manual_seed(0)
    x, x3 = torch.randn(5, 6), torch.randn(4, 5, 5)
    one = [([S0], KEPT), ([S1], KEPT)]
    cases = [
        (lambda t: torch.diagonal(t, 0, 1, 2), [x3], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda t: torch.diagonal(t, 1, 0, 2), [x3], [([S1], KEPT)]),
        (lambda t: torch.diag_embed(t), [x], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda t: torch.diag(t), [x], [([S0], GATHERS)]),
        (lambda t, s: torch.diagonal_scatter(t, s, 0, 1, 2), [x3, torch.randn(4, 5)], [([S0, S0], KEPT)]),
        (lambda t, s: torch.select_scatter(t, s, 1, 2), [x, torch.randn(5)], [([S0, S0], KEPT)]),
        (lambda t, s: torch.slice_scatter(t, s, 1, 1, 5, 2), [x, torch.randn(5, 2)], [([S0, S0], KEPT)]),
        (lambda t, s: torch.slice_scatter(t, s, 1), [x, torch.randn(5, 6)], [([S1, S1], KEPT)]),
        (lambda t: t.unfold(1, 2, 2), [x], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda t: torch.rot90(t, 1, (1, 2)), [x3], [([S0], KEPT), ([S1], GATHERS)]),
        (lambda t: t.as_strided((5, 6), (6, 1)), [x], one),
        (lambda t: t.as_strided((6, 5), (1, 6)) * 2, [x], one),
        (lambda t: t.as_strided((2, 3), (6, 1)), [x], [([S0], GATHERS), ([S1], GATHERS)]),
        (lambda t: torch.as_strided_copy(t, (5, 6), (6, 1)), [x], one),
        (lambda t: torch.view_copy(t, (5, 2, 3)), [x], [([S0], KEPT)]),
        (lambda t: torch.expand_copy(t, (2, 5, 6)), [x], one),
        (lambda t: torch.permute_copy(t, (1, 0)), [x], one),
        (torch.t_copy, [x], one), (lambda t: torch.transpose_copy(t, 0, 1), [x], one),
        (lambda t: torch.squeeze_copy(t), [torch.randn(1, 2, 3)], [([S1], KEPT)]),
        (lambda t: torch.unsqueeze_copy(t, 1), [x], one),
        (lambda t: torch.unbind_copy(t, 1), [x], [([S0], KEPT)]),
        (lambda t: torch.split_with_sizes_copy(t, [2, 4], 1), [x], [([S0], KEPT)]),
        (lambda t: torch.diagonal_copy(t, 0, 1, 2), [x3], [([S0], KEPT)]),
        (lambda t: torch.narrow_copy(t, 1, 1, 3), [x], [([S0], KEPT)]),
        (lambda t: torch.narrow_copy(t, 0, 0, 5), [x], [([S0], GATHERS)]),
        (torch.alias_copy, [x], one), (lambda t: torch.unfold_copy(t, 1, 3, 1), [x], [([S0], KEPT)]),
    ]
    return cases


def test_view_rules_keep_the_untouched_dims_without_gathering():
    assert _run_family(_view_cases) == 70


def _index_loss_cases():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    idx, gi = torch.tensor([4, 0, 2]), torch.randint(0, 6, (5, 3))
    sorted_rows = torch.randn(5, 6).sort(1).values
    t01 = (torch.rand(5, 6) > 0.5).float()
    sign = t01 * 2 - 1
    w, ids, offsets = torch.randn(10, 5), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 3])
    labels = torch.randint(0, 6, (5,))
    multi = torch.tensor([[3, 0, -1, 1, 2, 5]] * 5)  # each sample's labels, ended by -1
    return [
        (lambda t, s: t.index_copy(1, idx, s), [x, torch.randn(5, 3)], [([S0, S0], KEPT), ([S1, R], GATHERS)]),
        (lambda t: t.index_fill(1, idx, 2.0), [x], [([S0], KEPT)]),
        (lambda t, s: t.index_reduce(1, idx, s, "amax"), [x, torch.randn(5, 3)], [([S0, S0], KEPT)]),
        (lambda t, s: t.scatter_reduce(1, gi, s, "sum"), [x, torch.randn(5, 3)], [([S0, S0], KEPT)]),
        (lambda t, s: t.scatter_reduce(1, gi, s, "amax", include_self=False), [x, torch.randn(5, 3)],
         [([S0, S0], KEPT)]),
        (lambda t, i: torch.take(t, i), [x, torch.randint(0, 30, (4, 3))],
         [([R, S0], KEPT), ([R, S1], KEPT), ([S0, S0], GATHERS)]),
        (lambda t: torch.bucketize(t, torch.tensor([-1.0, 0.0, 1.0])), [x], [([S0], KEPT), ([S1], KEPT)]),
        (lambda s, t: torch.searchsorted(s, t), [sorted_rows, torch.randn(5, 3)],
         [([S0, S0], KEPT), ([R, S1], GATHERS)]),
        (lambda t: torch.searchsorted(torch.tensor([-1.0, 0.0, 1.0]), t), [x], [([S0], KEPT), ([S1], KEPT)]),
        (lambda a, t, w: F.binary_cross_entropy_with_logits(a, t, pos_weight=w), [x, t01, torch.rand(6) + 0.5],
         [([S0, S0, R], KEPT), ([S1, S1, S0], KEPT)]),
        (lambda a, t: F.binary_cross_entropy_with_logits(a, t, reduction="none"), [x, t01], [([S1, S1], KEPT)]),
        (lambda a, t: F.soft_margin_loss(a, t), [x, sign], [([S0, S0], KEPT), ([S1, S1], KEPT)]),
        (lambda a, t: F.soft_margin_loss(a, t, reduction="sum"), [x, sign], [([S0, S0], KEPT)]),
    ] + [
        (lambda w, i, o, m=mode: F.embedding_bag(i, w, o, mode=m), [w, ids, offsets],
         [([S1, R, R], KEPT), ([S0, R, R], GATHERS)]) for mode in ("sum", "mean", "max")
    ] + [
        (lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
         [w, ids, offsets, torch.rand(8)],
         [([S1, R, R, R], KEPT)]),
        (lambda w, i: F.embedding_bag(i, w, mode="max"), [w, ids.reshape(2, 4)], [([S1, R], KEPT)]),
    ] + [
        (lambda a, t, r=red: F.multi_margin_loss(a, t, reduction=r), [x, labels], [([S0, S0], KEPT)])
        for red in ("mean", "sum", "none")
    ] + [
        (lambda a, t, w: F.multi_margin_loss(a, t, p=2, margin=0.5, weight=w), [x, labels, torch.rand(6)],
         [([S0, S0, R], KEPT), ([S1, R, S0], GATHERS)]),
        (lambda a, t: F.multilabel_margin_loss(a, t), [x, multi], [([S0, S0], KEPT), ([S1, S1], GATHERS)]),
        (lambda a, t: F.multilabel_margin_loss(a, t, reduction="none"), [x, multi], [([S0, S0], KEPT)]),
    ]


def test_index_and_loss_rules_split_without_gathering():
    assert _run_family(_index_loss_cases) == 34 + 9 + 4 + 6 + 3 + 3 + 2


def _kernels_2d():
    """The kernels on pieces cut by two mesh dims, uneven (5 and 7 rows on 2 x 2 ranks)."""
    torch.manual_seed(0)
    mesh = dist.ProcessMesh([[2, 0], [1, 3]])
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    cases = [
        (torch.trace, [x], [[S0, S1]]), (torch.trace, [x], [[S1, S0]]),
        (lambda t: t.as_strided((7, 5), (1, 7)) * 2, [x], [[S0, S1]]),
        (lambda t: t.squeeze(), [torch.randn(1, 5, 3)], [[S1, S1]]),
        (lambda t: torch.aminmax(t, dim=1), [x], [[S1, S0]]),
        (torch.dist, [x, y], [[S0, S1], [S0, S1]]),
        (lambda t: torch.sort(t, 1), [x], [[S0, S0]]),
    ]
    for i, (fn, inputs, placements) in enumerate(cases):
        _, log = check(fn, inputs, placements, mesh)
        assert not [r for r in log if r.op == "all_gather"], (i, list(log))
    return len(cases)


def test_kernels_on_a_2d_mesh_with_uneven_pieces():
    assert run_dist(_kernels_2d, 4)[0] == 7
