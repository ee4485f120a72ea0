"""Reductions, scans and layer/RMS norm: rule choices (pure) and numbers vs one process (gloo)."""
import math
import warnings

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

import autopar as dist
from autopar.placement import Partial, Replicate, Shard
from autopar.spec import TensorMeta
from autopar.spmd.engine import choose
from autopar.spmd.registry import rule_for
from autopar.spmd.strategy import OpCall
from distpool import run_dist
from opcheck import check

aten = torch.ops.aten
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
P, PAVG, PMAX, PMIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
MESH1 = dist.ProcessMesh([0, 1])
MESH2 = dist.ProcessMesh([[2, 0], [1, 3]])


# ---- pure rule tests ---------------------------------------------------------------------------
def _m(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def make_call(func, *args, **kwargs) -> OpCall:
    """The OpCall dispatch builds: tensors -> TensorMeta, outputs from the meta run."""
    out = func(*args, **kwargs)
    metas = lambda tree: [TensorMeta.of(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    conv = lambda a: TensorMeta.of(a) if isinstance(a, torch.Tensor) else a
    return OpCall(func, tuple(tree_map(conv, list(args))), tree_map(conv, kwargs), metas((args, kwargs)), metas(out))


def pick(func, args, current, mesh=MESH1, kwargs=None):
    """(input placements, output placements, kernel) the engine picks from `current`."""
    call = make_call(func, *args, **(kwargs or {}))
    return choose(call, mesh, [tuple(c) for c in current], inplace=False)


def test_sum_rules():
    x = _m(4, 6)
    # reduced sharded dim -> Partial(sum), no conversion; kept dim keeps (shifted) shard
    assert pick(aten.sum.dim_IntList, (x, [1]), [[S1]]) == ([(S1,)], [(P,)], None)
    assert pick(aten.sum.dim_IntList, (x, [0]), [[S1]]) == ([(S1,)], [(S0,)], None)
    assert pick(aten.sum.dim_IntList, (x, [0], True), [[S1]]) == ([(S1,)], [(S1,)], None)
    assert pick(aten.sum.default, (x,), [[S0]]) == ([(S0,)], [(P,)], None)
    assert pick(aten.sum.dim_IntList, (x, [1]), [[PAVG]], kwargs={"dtype": torch.float64})[1] == [(PAVG,)]
    # 2-D mesh: both mesh dims shard the reduced dim
    assert pick(aten.sum.dim_IntList, (x, [0]), [[S0, S0]], MESH2)[1] == [(P, P)]
    assert pick(aten.sum.dim_IntList, (x, [0]), [[S0, S1]], MESH2)[1] == [(P, S0)]


def test_mean_rules_even_and_uneven():
    assert pick(aten.mean.dim, (_m(4, 6), [0]), [[S0]]) == ([(S0,)], [(PAVG,)], None)
    assert pick(aten.mean.dim, (_m(5, 6), [0]), [[S0]]) == ([(S0,)], [(PAVG,)], "mean_uneven")
    assert pick(aten.mean.default, (_m(5, 6),), [[S1]])[2] is None
    # mesh dim 0 cuts 4 rows evenly but mesh dim 1 cuts the 2-row pieces... 5 columns: uneven
    assert pick(aten.mean.default, (_m(4, 5),), [[S0, S1]], MESH2) == ([(S0, S1)], [(PAVG, PAVG)], "mean_uneven")
    assert pick(aten.mean.dim, (_m(4, 6), [1]), [[P]])[1] == [(P,)]


def test_extreme_and_arg_rules():
    x = _m(4, 6)
    assert pick(aten.amax.default, (x, [1]), [[S1]]) == ([(S1,)], [(PMAX,)], "extreme")
    assert pick(aten.amin.default, (x, [1]), [[PMIN]]) == ([(PMIN,)], [(PMIN,)], None)
    assert pick(aten.max.default, (x,), [[PMAX]])[1] == [(PMAX,)]
    # a Partial(max) input to a non-max op is reduced first
    assert pick(aten.amin.default, (x, [1]), [[PMAX]])[0] == [(R,)]
    assert pick(aten.max.dim, (x, 1), [[S1]]) == ([(S1,)], [(R,), (R,)], "arg_extreme")
    assert pick(aten.min.dim, (x, 1), [[S0]]) == ([(S0,)], [(S0,), (S0,)], None)
    assert pick(aten.argmax.default, (x,), [[S0]]) == ([(S0,)], [(R,)], "arg_extreme")
    assert pick(aten.argmin.default, (x, 0, True), [[S1]]) == ([(S1,)], [(S1,)], None)


def test_norm_lse_any_scan_rules():
    x = _m(4, 6)
    assert pick(aten.linalg_vector_norm.default, (x, 2, [1]), [[S1]]) == ([(S1,)], [(R,)], "vector_norm")
    assert pick(aten.linalg_vector_norm.default, (x, 2, [1]), [[S0]]) == ([(S0,)], [(S0,)], None)
    assert pick(aten.linalg_vector_norm.default, (x,), [[P]])[0] == [(R,)]  # |x| is not linear
    assert pick(aten.logsumexp.default, (x, [1]), [[S1]]) == ([(S1,)], [(R,)], "logsumexp")
    b = _m(4, 6, dtype=torch.bool)
    assert pick(aten.any.dims, (b, [1]), [[S1]])[1] == [(PMAX,)]
    assert pick(aten.all.default, (b,), [[S0]])[1] == [(PMIN,)]
    assert pick(aten.any.dims, (b, []), [[S1]])[1] == [(S1,)]  # dim=[] reduces nothing
    # the scanned dim must be whole: moving the shard to the other dim (all-to-all) beats a gather
    assert pick(aten.cumsum.default, (x, 1), [[S1]]) == ([(S0,)], [(S0,)], None)
    assert pick(aten.cumsum.default, (x, 1), [[S0]])[1] == [(S0,)]
    assert pick(aten.cumsum.default, (x, 1), [[PAVG]])[1] == [(PAVG,)]
    assert pick(aten.cumprod.default, (x, 1), [[P]])[0] == [(R,)]
    assert pick(aten._foreach_norm.Scalar, ([x, x], 2), [[S0], [S0]]) == ([(S0,), (S0,)], [(R,), (R,)], "foreach_norm")


def test_kept_only_rules():
    x = _m(4, 6)
    for func, args in [(aten.var.correction, (x, [1])), (aten.std.correction, (x, [1])),
                       (aten.prod.dim_int, (x, 1)), (aten.var_mean.correction, (x, [1]))]:
        assert pick(func, args, [[S1]])[0] == [(S0,)], func  # reduced dim made whole by an all-to-all
        assert pick(func, args, [[S0]])[1][0] == (S0,), func
    assert pick(aten.prod.default, (x,), [[S0]])[0] == [(R,)]
    assert pick(aten.var.correction, (x,), [[P]])[0] == [(R,)]


def test_layer_norm_rules():
    x, w, b = _m(2, 4, 6), _m(6), _m(6)
    out = pick(aten.native_layer_norm.default, (x, [6], w, b, 1e-5), [[S1], [R], [R]])
    assert out == ([(S1,), (R,), (R,)], [(S1,), (S1,), (S1,)], None)
    # a sharded normalized dim moves to a row dim (all-to-all) and stays there
    ln2 = pick(aten.native_layer_norm.default, (x, [4, 6], w.new_empty(4, 6), None, 1e-5), [[S1], [R]])
    assert ln2 == ([(S0,), (R,)], [(S0,), (S0,), (S0,)], None)
    mean = _m(2, 4, 1)
    grads = pick(aten.native_layer_norm_backward.default, (x, x, [6], mean, mean, w, b, [True, True, True]),
                 [[S0], [S0], [S0], [S0], [R], [R]])
    assert grads[1] == [(S0,), (P,), (P,)]
    masked = pick(aten.native_layer_norm_backward.default, (x, x, [6], mean, mean, w, None, [False, True, False]),
                  [[S1], [S1], [S1], [S1], [R]])
    assert masked[1] == [(P,)]
    partial = pick(aten.native_layer_norm_backward.default, (x, x, [6], mean, mean, w, b, [True, True, True]),
                   [[PAVG], [R], [R], [R], [R], [R]])
    assert partial[1] == [(PAVG,)] * 3
    rms = pick(aten._fused_rms_norm_backward.default, (x, x, [6], mean, w, [True, True]),
               [[S0], [S0], [S0], [R]])
    assert rms[1] == [(S0,), (P,)]
    assert pick(aten._fused_rms_norm.default, (x, [6], w, 1e-5), [[S1], [R]])[1] == [(S1,), (S1,)]


# Reached but not ours: a factory (no DistTensor operand, never dispatched to autopar) and the
# foreach scaling of clip_grad_norm_ (optimizer family).
_NOT_OURS = {"aten.ones.default", "aten._foreach_mul_.Tensor"}


def test_every_reached_op_has_a_rule():
    """Forward+backward of every op of the family on plain tensors: each aten op reached has a rule."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func)
            return func(*args, **(kwargs or {}))

    fns = [lambda x: x.sum(), lambda x: x.sum(1, keepdim=True, dtype=torch.float64), lambda x: x.mean(),
           lambda x: x.mean(0), lambda x: x.max(), lambda x: x.max(1)[0], lambda x: x.min(1)[0], lambda x: x.min(),
           lambda x: x.amax(1), lambda x: x.amin((0, 1)), lambda x: x.prod(), lambda x: x.prod(1),
           lambda x: x.var(1), lambda x: x.std(), lambda x: torch.var_mean(x, 1)[0], lambda x: x.norm(),
           lambda x: torch.linalg.vector_norm(x, math.inf, 1), lambda x: torch.logsumexp(x, 1),
           lambda x: x.cumsum(1), lambda x: F.layer_norm(x, (6,), w), lambda x: F.rms_norm(x, (6,), w)]
    xs = [torch.randn(4, 6, requires_grad=True) for _ in fns]
    w = torch.ones(6, requires_grad=True)
    y = torch.randn(4, 6)
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))]
    for p in params:
        p.grad = torch.randn_like(p)
    rec = Record()
    with rec:
        for fn, x in zip(fns, xs):
            fn(x).sum().backward()
        (y.argmax(), y.argmin(1), (y > 0).any(), (y > 0).all(1), y.cumprod(0), y.logcumsumexp(0), y.cummax(0))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    missing = {str(op) for op in rec.ops if rule_for(op) is None}
    assert missing <= _NOT_OURS, missing


# ---- multi-process numeric tests ------------------------------------------------------------
# placements of a 2-D input: on a 1-D mesh, and on a 2-D one (nested shards of one dim included)
_ONE_D = [[R], [S0], [S1]]
_TWO_D = [[S0, S1], [S1, S0], [S0, S0], [R, S1], [S1, R], [S0, R]]


def _sweep(cases, mesh, shapes):
    """check(fn) (forward and backward) for every case, 2-D shape and placement; returns how many ran."""
    n = 0
    for fn, partials, grad in cases:
        for shape in shapes:
            x = torch.randn(shape)
            for pl in (_ONE_D if mesh.ndim == 1 else _TWO_D) + [[p] * mesh.ndim for p in partials]:
                check(fn, [x], [pl], mesh, grad=grad)
                n += 1
    return n


SUM_MEAN = [
    (lambda x: x.sum(), (P, PAVG), True),
    (lambda x: x.sum(0), (P, PAVG), True),
    (lambda x: x.sum((0, 1), keepdim=True), (P,), True),
    (lambda x: x.sum(-1, dtype=torch.float64), (PAVG,), True),
    (lambda x: x.mean(), (P, PAVG), True),
    (lambda x: x.mean(0), (PAVG,), True),
    (lambda x: x.mean(1, keepdim=True), (P,), True),
    (lambda x: x.mean((0, 1)) + 1.0, (PAVG,), True),
]
EXTREMES = [
    (lambda x: x.amax(1), (PMAX,), True),
    (lambda x: x.amin(0, keepdim=True), (PMIN,), True),
    (lambda x: x.amax((0, 1)), (), True),
    (lambda x: x.max(), (PMAX,), True),
    (lambda x: x.min(), (PMIN,), True),
    (lambda x: x.max(1), (), True),
    (lambda x: x.min(0, keepdim=True), (), True),
    (lambda x: (x.argmax(), x.argmin(1), x.argmax(0, keepdim=True), x.argmin(keepdim=True)), (), False),
]
OTHERS = [
    (lambda x: torch.linalg.vector_norm(x), (), True),
    (lambda x: torch.linalg.vector_norm(x, 1, dim=0), (), True),
    (lambda x: torch.linalg.vector_norm(x, math.inf, dim=1, keepdim=True), (), True),
    (lambda x: torch.linalg.vector_norm(x, -math.inf), (), True),
    (lambda x: torch.linalg.vector_norm(x, 3.0, dim=(0, 1), dtype=torch.float64), (), True),
    (lambda x: torch.linalg.vector_norm(x, 0, dim=1), (), False),
    (lambda x: torch.logsumexp(x, 1), (), True),
    (lambda x: torch.logsumexp(x, (0, 1), keepdim=True), (), True),
    (lambda x: (x.var(1), x.std(0, correction=0), torch.var_mean(x, 1, keepdim=True)), (), True),
    (lambda x: (x.prod(), x.prod(1)), (), True),
    (lambda x: x.cumsum(1), (P, PAVG), True),
    (lambda x: (x.cumprod(0), torch.logcumsumexp(x, 1), x.cummax(0)[0]), (), True),
    (lambda x: ((x > 0).any(), (x > 0).all(1), (x > 0).any(0, keepdim=True), (x > -1).all()), (), False),
]


def _family_rank(cases_name, mesh_ids, shapes):
    """Runs a sweep; fails if any op on the way (forward or backward) fell back for lack of a rule."""
    mesh = dist.ProcessMesh(mesh_ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = _sweep(globals()[cases_name], mesh, shapes)
    unruled = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not unruled, unruled
    return n


# 5 rows on 4 ranks and 3 columns on 4 ranks leave uneven and empty pieces
SHAPES_2 = [(4, 6), (5, 3)]
SHAPES_4 = [(5, 3), (3, 8)]


def test_sum_mean_numeric():
    assert run_dist(_family_rank, 2, "SUM_MEAN", [0, 1], SHAPES_2)[0] > 0
    assert run_dist(_family_rank, 4, "SUM_MEAN", [0, 1, 2, 3], SHAPES_4)[0] > 0
    assert run_dist(_family_rank, 4, "SUM_MEAN", [[2, 0], [1, 3]], SHAPES_4)[0] > 0


def test_extremes_numeric():
    assert run_dist(_family_rank, 2, "EXTREMES", [0, 1], SHAPES_2)[0] > 0
    assert run_dist(_family_rank, 4, "EXTREMES", [0, 1, 2, 3], SHAPES_4)[0] > 0
    assert run_dist(_family_rank, 4, "EXTREMES", [[2, 0], [1, 3]], SHAPES_4)[0] > 0


def test_norms_scans_and_others_numeric():
    assert run_dist(_family_rank, 2, "OTHERS", [0, 1], SHAPES_2)[0] > 0
    assert run_dist(_family_rank, 4, "OTHERS", [0, 1, 2, 3], SHAPES_4)[0] > 0
    assert run_dist(_family_rank, 4, "OTHERS", [[2, 0], [1, 3]], SHAPES_4)[0] > 0


def _placement_and_comm_rank():
    """The cases where the choice matters: outputs' placements and the forward's collectives."""
    mesh = dist.ProcessMesh([0, 1])
    x = torch.randn(5, 6)
    # sum over a sharded dim: Partial(sum), no communication
    out, log = check(lambda t: t.sum(0), [x], [[S0]], mesh)
    assert out.placements == [P] and len(log) == 0
    # mean over an uneven sharded dim (5 rows on 2 ranks): Partial(avg) from the kernel, right value
    out, log = check(lambda t: t.mean(0), [x], [[S0]], mesh)
    assert out.placements == [PAVG] and len(log) == 0
    # ... and a scalar added afterwards is added once (avg, not sum)
    check(lambda t: t.mean(0) + 1.0, [x], [[S0]], mesh)
    # amax over a sharded dim: Partial(max), no communication
    out, log = check(lambda t: t.amax(1), [x], [[S1]], mesh)
    assert out.placements == [PMAX] and len(log) == 0
    # max.dim over a sharded dim: two small all-reduces (values, indices), no gather of x
    (vals, idx), log = check(lambda t: t.max(1), [x], [[S1]], mesh)
    assert vals.placements == [R] and idx.placements == [R]
    assert log.ops() == ["all_reduce", "all_reduce"] and all(r.shape == (5, 1) for r in log)
    # vector norm over a sharded dim: one all-reduce of the (5,) shares
    out, log = check(lambda t: torch.linalg.vector_norm(t, dim=1), [x], [[S1]], mesh)
    assert out.placements == [R] and log.ops() == ["all_reduce"] and log[0].shape == (5, 1)
    # argmax with ties: the first maximal position wins, as in torch
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    for pl in ([S1], [S0]):
        check(lambda t: (t.argmax(), t.argmax(1), t.max(1), t.argmin(0)), [ties], [pl], mesh, grad=False)
    # logsumexp over a sharded dim with a fully -inf row
    neg = torch.randn(3, 6)
    neg[1] = -math.inf
    out, log = check(lambda t: torch.logsumexp(t, 1), [neg], [[S1]], mesh, grad=False)
    assert out.placements == [R] and len(log) == 2
    # cumsum along the sharded dim gathers it; along another dim keeps the shard
    out, log = check(lambda t: t.cumsum(0), [x], [[S1]], mesh)
    assert out.placements == [S1] and len(log) == 0
    # any over a sharded dim: Partial(max) of booleans
    out, log = check(lambda t: (t > 1).any(1), [x], [[S1]], mesh, grad=False)
    assert out.placements == [PMAX] and len(log) == 0
    return True


def test_placements_and_comm():
    assert all(run_dist(_placement_and_comm_rank, 2))


def _check_complex(fn, x, placements, mesh):
    """fn of a complex x, distributed as `placements`, against the single process: the value and
    the gradient of sum(re(fn(x) * w)) (NaN where the single process has NaN)."""
    w = torch.randn(fn(x).shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    ref = x.clone().requires_grad_()
    want = fn(ref)
    (want * w).real.sum().backward()
    dx = dist.shard_tensor(x, mesh, placements, stop_gradient=False)
    got = fn(dx)
    torch.testing.assert_close(dist.unshard_dtensor(got), want.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
    (got.clone() * w).real.sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(dx.grad), ref.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


def _complex_norm_rank():
    """A complex norm in a wider dtype takes |x| in that dtype, as torch does: the max modulus is
    torch's to the bit, so renorm's gradient (which compares |x| with that norm) follows the
    single process, its NaNs included (its complex64 |x| never equals the complex128 norm)."""
    mesh = dist.ProcessMesh([0, 1])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 3, dtype=torch.complex64, generator=gen) * 5
    for ord in (math.inf, -math.inf, 2):
        for dims, pl in (((0, 1), S0), ((0, 2), S2), ((1,), S1)):
            want = torch.linalg.vector_norm(x, ord, dims, dtype=torch.complex128)
            got = dist.unshard_dtensor(torch.linalg.vector_norm(dist.shard_tensor(x, mesh, [pl]), ord, dims,
                                                                dtype=torch.complex128))
            assert got.dtype == torch.float64
            if math.isinf(ord):
                assert torch.equal(got, want), (ord, dims)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    xs = [x, x[:, 0]]
    got = torch._foreach_norm([dist.shard_tensor(t, mesh, [S0]) for t in xs], math.inf, dtype=torch.complex128)
    assert all(torch.equal(dist.unshard_dtensor(g), w)
               for g, w in zip(got, torch._foreach_norm(xs, math.inf, dtype=torch.complex128)))
    for pl in (S0, S1, S2):
        _check_complex(lambda t: torch.renorm(t, math.inf, 2, 0.5), x, [pl], mesh)
    real = x.real.contiguous()
    for pl in ([S0], [S1], [S2]):
        check(lambda t: torch.renorm(t, math.inf, 2, 0.5), [real], [pl], mesh)
    return True


def test_complex_norm_in_wide_dtype():
    assert all(run_dist(_complex_norm_rank, 2))


def _complex_logsumexp_rank(mesh_ids):
    """Complex logsumexp over sharded dims shifts by the all-reduced max of the real parts, as
    torch does (complex values have no max), rows of -inf real parts included."""
    mesh = dist.ProcessMesh(mesh_ids)
    x = torch.randn(5, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(2)) * 4
    x[2] = torch.complex(torch.full((6,), -math.inf), torch.zeros(6))
    nd = mesh.ndim
    for dims, pl in ((1, [S1] * nd), ((0, 1), [S0] + [S1] * (nd - 1)), (0, [S0] * nd), (1, [S0] * nd)):
        _check_complex(lambda t: torch.logsumexp(t, dims), x, pl, mesh)
        _check_complex(lambda t: torch.logsumexp(t, dims, keepdim=True), x, pl, mesh)
    return True


def test_complex_logsumexp():
    assert all(run_dist(_complex_logsumexp_rank, 2, [0, 1]))
    assert all(run_dist(_complex_logsumexp_rank, 4, [[2, 0], [1, 3]]))


def _clip_rank(mesh_ids, foreach):
    mesh = dist.ProcessMesh(mesh_ids)
    nd = mesh.ndim
    shapes_pl = [((5, 6), [S0] + [S1] * (nd - 1)), ((6,), [S0] * nd), ((3, 4), [R] * nd),
                 ((7, 2), [S1] + [R] * (nd - 1))]
    ref, got = [], []
    for shape, pl in shapes_pl:
        g = torch.randn(shape)
        ref.append(torch.nn.Parameter(torch.randn(shape)))
        ref[-1].grad = g.clone()
        p = torch.nn.Parameter(dist.shard_tensor(ref[-1].detach().clone(), mesh, pl))
        p.grad = dist.shard_tensor(g.clone(), mesh, pl)
        got.append(p)
    for norm_type in (2.0, math.inf, 1):
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type, foreach=foreach)
        with dist.comm_log() as log:
            total = torch.nn.utils.get_total_norm([p.grad for p in got], norm_type, foreach=foreach)
        torch.testing.assert_close(dist.unshard_dtensor(total), want)
        # no grad is ever gathered: only small all-reduces of norm shares
        assert all(r.op == "all_reduce" and math.prod(r.shape) <= 4 for r in log), log
        torch.nn.utils.clip_grads_with_norm_(got, 0.5, total, foreach=foreach)
        for r, p in zip(ref, got):
            torch.testing.assert_close(dist.unshard_dtensor(p.grad), r.grad)
    # the foreach op directly, several specs in one call
    xs = [torch.randn(5, 6), torch.randn(5, 6), torch.randn(4)]
    dxs = [dist.shard_tensor(xs[0], mesh, [S0] * nd), dist.shard_tensor(xs[1], mesh, [S0] * nd),
           dist.shard_tensor(xs[2], mesh, [S0] * nd)]
    for o, want in zip(torch._foreach_norm(dxs, 3), torch._foreach_norm(xs, 3)):
        torch.testing.assert_close(dist.unshard_dtensor(o), want)
    return True


def test_clip_grad_norm():
    assert all(run_dist(_clip_rank, 2, [0, 1], True))
    assert all(run_dist(_clip_rank, 4, [[2, 0], [1, 3]], True))
    assert all(run_dist(_clip_rank, 4, [0, 1, 2, 3], False))


def _norm_rank(mesh_ids, shape):
    mesh = dist.ProcessMesh(mesh_ids)
    nd = mesh.ndim
    x, w, b = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape[-1])
    ln = lambda t, w_, b_: F.layer_norm(t, (shape[-1],), w_, b_)
    rms = lambda t, w_: F.rms_norm(t, (shape[-1],), w_, eps=1e-6)
    rep = [R] * nd
    layouts = [[Shard(d)] * nd for d in range(len(shape))] + [rep]
    if nd == 2:
        layouts += [[S0, S1], [S1, S0]]
    for pl in layouts:
        check(ln, [x, w, b], [pl, rep, rep], mesh)
        check(rms, [x, w], [pl, rep], mesh)
        check(lambda t: F.layer_norm(t, shape[-2:]), [x], [pl], mesh)
        check(lambda t: F.rms_norm(t, shape[-2:]), [x], [pl], mesh)
    # batch-sharded layer norm: no communication forward; weight/bias grads are Partial(sum)
    xd = dist.shard_tensor(x, mesh, [S0] * nd)
    wd = dist.shard_tensor(w, mesh, rep, stop_gradient=False)
    bd = dist.shard_tensor(b, mesh, rep, stop_gradient=False)
    with dist.comm_log() as log:
        y = ln(xd, wd, bd)
    assert len(log) == 0 and y.placements == [S0] * nd
    y.sum().backward()
    assert wd.grad.placements == [P] * nd and bd.grad.placements == [P] * nd
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ln(x, ref_w, ref_b).sum().backward()
    torch.testing.assert_close(dist.unshard_dtensor(wd.grad), ref_w.grad, rtol=1e-5, atol=1e-5)
    # row-sharded RMS norm: no communication either; hidden-sharded: only the row statistics are
    # all-reduced (one all-reduce over the ranks of every mesh dim sharding the hidden dim)
    with dist.comm_log() as log:
        rms(xd, wd)
    assert len(log) == 0
    _, log = check(rms, [x, w], [[Shard(len(shape) - 1)] * nd, rep], mesh)
    assert len(log) == 1 and log[0].op == "all_reduce" and len(log[0].ranks) == mesh.size
    assert math.prod(log[0].shape) * shape[-1] == x.numel()
    # the fused RMS op (what F.rms_norm reaches on GPU) runs on CPU forward
    out, log = check(lambda t, w_: aten._fused_rms_norm(t, [shape[-1]], w_, 1e-6), [x, w], [[S0] * nd, rep],
                     mesh, grad=False)
    assert len(log) == 0 and out[1].placements == [S0] * nd
    return True


def test_layer_and_rms_norm():
    assert all(run_dist(_norm_rank, 2, [0, 1], (5, 3, 8)))
    assert all(run_dist(_norm_rank, 4, [0, 1, 2, 3], (3, 5, 6)))
    assert all(run_dist(_norm_rank, 4, [[2, 0], [1, 3]], (5, 3, 8)))
