"""Rules for softmax/log_softmax, cross_entropy (nll_loss), scaled_dot_product_attention and
random ops (dropout, *_like, in-place fills): forward and backward against the single-process
run, output placements, and the communication they cost."""
import warnings

import torch
import torch.nn.functional as F

import autopar as dist
from autopar import Partial, ProcessMesh, Replicate, Shard
from autopar.spmd import engine
from distpool import run_dist
from opcheck import check
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R, P = Replicate(), Partial()
MESH_2D = [[2, 0], [1, 3]]
MY_OPS = ("softmax", "nll_loss", "mse_loss", "smooth_l1", "huber", "binary_cross_entropy", "flash_attention", "dropout", "bernoulli", "uniform", "normal", "rand")


def _comm(log):
    return [(r.op, r.shape) for r in log]


def _no_rule_warnings(caught):
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    mine = [m for m in missing if any(k in m for k in MY_OPS)]
    assert not mine, mine


# -- pure rule tests ---------------------------------------------------------------------------
def test_choices_without_processes():
    mesh = ProcessMesh([0, 1])
    call = _call(aten._log_softmax.default, _m(8, 10), 1, False)
    ins, outs, kernel = engine.choose(call, mesh, [(Shard(1),)], inplace=False)
    assert (ins, outs, kernel) == ([(Shard(1),)], [(Shard(1),)], "softmax_split_dim")
    ins, outs, kernel = engine.choose(call, mesh, [(Shard(0),)], inplace=False)
    assert (outs, kernel) == ([(Shard(0),)], None)

    t = _m(8, dtype=torch.long)
    call = _call(aten.nll_loss_forward.default, _m(8, 10), t, None, 1, -100)
    _, outs, kernel = engine.choose(call, mesh, [(Shard(1),), (R,)], inplace=False)
    assert (outs, kernel) == ([(P,), (R,)], "nll_loss")
    _, outs, kernel = engine.choose(call, mesh, [(Shard(0),), (Shard(0),)], inplace=False)
    assert (outs, kernel) == ([(R,), (R,)], "nll_loss")  # mean: (sum, total weight) reduced together
    call = _call(aten.nll_loss_forward.default, _m(8, 10), t, None, 2, -100)
    _, outs, kernel = engine.choose(call, mesh, [(Shard(0),), (Shard(0),)], inplace=False)
    assert (outs, kernel) == ([(P,), (P,)], None)

    q, kv = _m(2, 8, 6, 4), _m(2, 2, 6, 4)  # grouped-query heads: 8 query heads, 2 kv heads
    call = _call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, kv, kv)
    _, outs, _ = engine.choose(call, mesh, [(Shard(1),)] * 3, inplace=False)
    assert outs == [(Shard(1),), (Shard(1),)]
    _, outs, _ = engine.choose(call, ProcessMesh([0, 1, 2]), [(Shard(1),)] * 3, inplace=False)
    assert outs[0] != (Shard(1),)  # 2 kv heads on 3 ranks would split a group: heads do not stay split
    call = _call(aten._scaled_dot_product_flash_attention_for_cpu.default, _m(2, 4, 6, 4), _m(2, 4, 6, 4),
                 _m(2, 4, 6, 4), 0.0, True)
    _, outs, kernel = engine.choose(call, mesh, [(Shard(2),), (R,), (R,)], inplace=False)
    assert (outs, kernel) == ([(Shard(2),), (Shard(2),)], "sdpa")

    call = _call(aten.rand_like.default, _m(4, 6))
    assert engine.choose(call, mesh, [(Shard(1),)], inplace=False)[1] == [(Shard(1),)]
    assert engine.choose(call, mesh, [(P,)], inplace=False)[1] == [(R,)]
    call = _call(aten.native_dropout.default, _m(4, 6), 0.5, True)
    assert engine.choose(call, mesh, [(P,)], inplace=False)[1:] == ([(P,), (R,)], "native_dropout")


# -- softmax / log_softmax ---------------------------------------------------------------------
def _softmax_rank(world):
    rank = dist.get_rank()
    mesh = ProcessMesh(list(range(world)))
    x = torch.randn(5, 7)
    fns = {
        "softmax": lambda x: F.softmax(x, -1),
        "log_softmax": lambda x: F.log_softmax(x, 1),
        "softmax0": lambda x: F.softmax(x, 0),
    }
    for name, fn in fns.items():
        for pl in ([R], [Shard(0)], [Shard(1)], [P]):
            out, log = check(fn, [x], [pl], mesh)
            if pl == [P]:  # non-linear: one reduction of the input, then as above
                assert len(log) == 1 and log[0].op in ("all_reduce", "reduce_scatter"), _comm(log)
                continue
            assert out.placements == pl, (name, pl, out.placements)
            split = name != "softmax0" and pl == [Shard(1)] or name == "softmax0" and pl == [Shard(0)]
            if split:  # class dim sharded: row max and row sum, two (rows x 1) all-reduces
                rows = (5, 1) if name != "softmax0" else (1, 7)
                assert _comm(log) == [("all_reduce", rows)] * 2, (name, _comm(log))
            else:
                assert _comm(log) == [], (name, pl, _comm(log))

    # backward of class-sharded log_softmax / softmax: one (rows x 1) all-reduce each
    for fn in (F.log_softmax, F.softmax):
        xd = dist.shard_tensor(x.clone(), mesh, [Shard(1)], stop_gradient=False)
        out = fn(xd, 1)
        g = torch.randn(5, 7)
        gd = dist.shard_tensor(g, mesh, [Shard(1)])
        with dist.comm_log() as log:
            out.backward(gd)
        assert _comm(log) == [("all_reduce", (5, 1))], _comm(log)
        xr = x.clone().requires_grad_()
        fn(xr, 1).backward(g)
        torch.testing.assert_close(dist.unshard_dtensor(xd.grad), xr.grad)
        assert xd.grad.placements == [Shard(1)]

    # a Partial gradient passes through the backward
    y = F.log_softmax(dist.shard_tensor(x.clone(), mesh, [R], stop_gradient=False), 1)
    gp = dist.dtensor_from_local(torch.full((5, 7), float(rank + 1)), mesh, [P])
    grad = torch.ops.aten._log_softmax_backward_data.default(gp, y.detach(), 1, torch.float32)
    assert grad.placements == [P]
    ref = torch.ops.aten._log_softmax_backward_data.default(
        torch.full((5, 7), world * (world + 1) / 2), F.log_softmax(x, 1), 1, torch.float32)
    torch.testing.assert_close(dist.unshard_dtensor(grad), ref)

    # half precision upcast by dtype= (reaches _to_copy with a device argument, then _softmax)
    check(lambda x: F.softmax(x, 1, dtype=torch.float32), [x.bfloat16()], [[Shard(1)]], mesh, rtol=1e-2, atol=1e-2)

    # _safe_softmax (math attention path): fully masked rows give 0 with the class dim split
    xm = x.clone()
    xm[1] = float("-inf")
    safe = lambda x: torch.ops.aten._safe_softmax.default(x, 1)  # noqa: E731
    check(safe, [xm], [[Shard(1)]], mesh, grad=False)
    return True


def _softmax_2d_rank():
    x = torch.randn(6, 9)
    # class dim split over both mesh dims: one group of 4 for each all-reduce
    for pl in ([Shard(1), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Shard(0)], [P, Shard(1)]):
        for fn in (lambda x: F.log_softmax(x, 1), lambda x: F.softmax(x, 1)):
            out, log = check(fn, [x], [pl], MESH_2D)
    assert [len(r.ranks) for r in log] == [2, 2, 2]  # reduce the Partial, then max and sum
    out, log = check(lambda x: F.softmax(x, 1), [x], [[Shard(1), Shard(1)]], MESH_2D)
    assert [(r.op, len(r.ranks), r.shape) for r in log] == [("all_reduce", 4, (6, 1))] * 2
    return True


def test_softmax_2_and_4_ranks():
    run_dist(_softmax_rank, 2, 2)
    run_dist(_softmax_rank, 4, 4)


def test_softmax_2d_mesh():
    run_dist(_softmax_2d_rank, 4)


# -- cross_entropy ----------------------------------------------------------------------------
def _ce_rank(world):
    mesh = ProcessMesh(list(range(world)))
    n, c = 7, 6
    x = torch.randn(n, c)
    t = torch.randint(0, c, (n,))
    t[:3] = 2  # ignore_index=2 removes rows from the first shards only: uneven counts
    w = torch.rand(c) + 0.5
    cases = [
        dict(),
        dict(reduction="sum"),
        dict(reduction="none"),
        dict(weight=w),
        dict(weight=w, ignore_index=2),
        dict(ignore_index=2, reduction="sum"),
        dict(weight=w, ignore_index=2, reduction="none"),
    ]
    placements = [([Shard(0)], [Shard(0)]), ([Shard(1)], [R]), ([R], [Shard(0)]), ([P], [R])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kw in cases:
            fn = lambda x, t: F.cross_entropy(x, t, **kw)  # noqa: E731
            for xp, tp in placements:
                out, log = check(fn, [x, t], [xp, tp], mesh)
                if xp == [Shard(1)]:  # vocab-parallel: only log_softmax's two (rows x 1) all-reduces
                    assert _comm(log) == [("all_reduce", (n, 1))] * 2, (kw, _comm(log))
                    assert out.placements == [P]
                if xp == [Shard(0)]:  # mean: (sum, total weight) in one all-reduce, the loss comes out whole
                    mean = kw.get("reduction", "mean") == "mean"
                    # (unweighted, the pair is reduced where the loss is first read: `deferred_mean`)
                    in_forward = mean and "weight" in kw
                    assert _comm(log) == ([("all_reduce", (2,))] if in_forward else []), (kw, _comm(log))
                    if mean:
                        assert out.placements == [R]
            # nll_loss alone: total_weight (second output) is right too
            for xp, tp in placements:
                check(lambda x, t: torch.ops.aten.nll_loss_forward.default(
                    x, t, kw.get("weight"), {"none": 0, "mean": 1, "sum": 2}[kw.get("reduction", "mean")],
                    kw.get("ignore_index", -100)), [x.log_softmax(1), t], [xp, tp], mesh)
        # (B, C, d) logits reach nll_loss2d; a (B, S, V) LM head views to 2-D first
        x3, t3 = torch.randn(3, c, 5), torch.randint(0, c, (3, 5))
        for xp, tp in (([Shard(0)], [Shard(0)]), ([Shard(1)], [R]), ([Shard(2)], [Shard(1)])):
            for kw in (dict(), dict(reduction="none", ignore_index=1), dict(weight=w, reduction="sum")):
                check(lambda x, t: F.cross_entropy(x, t, **kw), [x3, t3], [xp, tp], mesh)
        for xp, tp in placements[:2]:  # label smoothing adds reductions over the class dim
            check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), [x, t], [xp, tp], mesh)
        # unbatched: logits (C,), target ()
        check(lambda x, t: F.cross_entropy(x, t), [x[0], t[3]], [[Shard(0)], [R]], mesh)
        lm, lab = torch.randn(2, 5, c), torch.randint(0, c, (2, 5))
        lm_fn = lambda x, t: F.cross_entropy(x.view(-1, c), t.view(-1))  # noqa: E731
        out, log = check(lm_fn, [lm, lab], [[Shard(2)], [R]], mesh)
        assert _comm(log) == [("all_reduce", (10, 1))] * 2 and out.placements == [P]
        check(lm_fn, [lm, lab], [[Shard(0)], [Shard(0)]], mesh)
    _no_rule_warnings(caught)
    return True


def _ce_2d_rank():
    x, t, w = torch.randn(9, 7), torch.randint(0, 7, (9,)), torch.rand(7)
    t[0] = -100
    for kw in (dict(), dict(reduction="sum", weight=w), dict(reduction="none"), dict(weight=w, reduction="none")):
        fn = lambda x, t: F.cross_entropy(x, t, **kw)  # noqa: E731
        for xp, tp in (([Shard(0), Shard(1)], [Shard(0), R]), ([Shard(1), Shard(0)], [R, Shard(0)]),
                       ([Shard(1), Shard(1)], [R, R]), ([Shard(0), Shard(0)], [Shard(0), Shard(0)])):
            check(fn, [x, t], [xp, tp], MESH_2D)
    return True


def test_cross_entropy_2_and_4_ranks():
    run_dist(_ce_rank, 2, 2)
    run_dist(_ce_rank, 4, 4)


def test_cross_entropy_2d_mesh():
    run_dist(_ce_2d_rank, 4)


# -- scaled_dot_product_attention ------------------------------------------------------------
def _sdpa_rank(world):
    mesh = ProcessMesh(list(range(world)))
    b, h, s, e = 3, 4, 5, 4
    q, k, v = torch.randn(b, h, s, e), torch.randn(b, h, s, e), torch.randn(b, h, s, e)
    mask = torch.randn(s, s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for causal in (False, True):
            fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            for d in (0, 1):  # batch / heads: no communication
                out, log = check(fn, [q, k, v], [[Shard(d)]] * 3, mesh)
                assert _comm(log) == [] and out.placements == [Shard(d)]
            out, log = check(fn, [q, k, v], [[Shard(2)], [R], [R]], mesh)  # query rows
            assert _comm(log) == [] and out.placements == [Shard(2)]
        # an additive mask (no gradient: with one, torch takes the math path)
        for pl, mask_pl in (([Shard(0)], [R]), ([Shard(1)], [R]), ([Shard(2)], [Shard(0)])):
            mask_d = dist.shard_tensor(mask, mesh, mask_pl)
            kv_pl = [R] if pl == [Shard(2)] else pl
            masked = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, attn_mask=mask_d if dist.is_dist_tensor(q) else mask, scale=0.7)
            out, log = check(masked, [q, k, v], [pl, kv_pl, kv_pl], mesh)
            assert _comm(log) == [] and out.placements == pl
        # grouped-query attention: 4 query heads share 2 kv heads / a single kv head
        kg, vg = torch.randn(b, 2, s, e), torch.randn(b, 2, s, e)
        gqa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        if world == 2:
            out, log = check(gqa, [q, kg, vg], [[Shard(1)]] * 3, mesh)
            assert _comm(log) == [] and out.placements == [Shard(1)]
        out, log = check(gqa, [q, kg[:, :1], vg[:, :1]], [[Shard(1)], [R], [R]], mesh)
        assert _comm(log) == [] and out.placements == [Shard(1)]
        # uneven batch
        check(fn, [q[:, :3], k[:, :3], v[:, :3]], [[Shard(1)]] * 3, mesh)
    _no_rule_warnings(caught)

    # the backward is linear in grad_out: a Partial gradient gives Partial gradients
    qd, kd, vd = (dist.shard_tensor(t.clone(), mesh, [R], stop_gradient=False) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd)
    g = torch.randn(b, h, s, e)
    terms = dist.dtensor_from_local(g * (dist.get_rank() + 1) * 2 / (world * (world + 1)), mesh, [P])
    grads = torch.autograd.grad(out, (qd, kd, vd), terms)
    assert [gr.placements for gr in grads] == [[P]] * 3
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr), (qr, kr, vr), g)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(dist.unshard_dtensor(got), ref)
    return True


def _sdpa_2d_rank():
    q, k, v = torch.randn(3, 5, 6, 4), torch.randn(3, 5, 6, 4), torch.randn(3, 5, 6, 4)
    for causal in (False, True):
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        out, log = check(fn, [q, k, v], [[Shard(0), Shard(1)]] * 3, MESH_2D)
        assert _comm(log) == [] and out.placements == [Shard(0), Shard(1)]
        check(fn, [q, k, v], [[Shard(1), Shard(2)], [Shard(1), R], [Shard(1), R]], MESH_2D)
    return True


# -- elementwise losses ---------------------------------------------------------------------------
def _elementwise_losses_rank(mesh_ids):
    mesh = ProcessMesh(mesh_ids)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    p, t = torch.rand(7, 5, generator=g) * 0.9 + 0.05, torch.rand(7, 5, generator=g)
    losses = {
        "mse": (F.mse_loss, x, y), "smooth_l1": (lambda a, b, **k: F.smooth_l1_loss(a, b, beta=0.5, **k), x, y),
        "huber": (lambda a, b, **k: F.huber_loss(a, b, delta=0.7, **k), x, y), "bce": (F.binary_cross_entropy, p, t),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, (fn, a, b) in losses.items():
            for reduction in ("mean", "sum", "none"):
                for pl in ([Shard(0)] * mesh.ndim, [Shard(1)] + [Shard(0)] * (mesh.ndim - 1)):  # 7 rows: uneven
                    out, log = check(lambda a, b: fn(a, b, reduction=reduction), [a, b], [pl, pl], mesh)
                    assert _comm(log) == [], (name, reduction, pl, _comm(log))  # the loss itself: local
                    if reduction != "none":
                        assert all(type(q) is Partial for q in out.placements), (name, reduction, out.placements)
    _no_rule_warnings(caught)
    return True


def test_elementwise_losses_shard_and_reduce_once():
    run_dist(_elementwise_losses_rank, 2, [0, 1])
    run_dist(_elementwise_losses_rank, 4, MESH_2D)


def test_attention_2_and_4_ranks():
    run_dist(_sdpa_rank, 2, 2)
    run_dist(_sdpa_rank, 4, 4)


def test_attention_2d_mesh():
    run_dist(_sdpa_2d_rank, 4)


# -- dropout and random ops ---------------------------------------------------------------------
def _seeded(fn):
    """fn drawn from the same generator state in the reference and the distributed run."""
    def run(*xs):
        torch.manual_seed(7)
        return fn(*xs)
    return run


def _random_rank(mesh):
    mesh = ProcessMesh(mesh)
    x = torch.randn(5, 6)
    fns = {
        "dropout": lambda x: F.dropout(x, 0.4),
        "native_dropout": lambda x: torch.native_dropout(x, 0.4, True),
        "native_dropout_eval": lambda x: torch.native_dropout(x, 0.4, False),
        "dropout_twice": lambda x: F.dropout(F.dropout(x, 0.3) * 2, 0.5),
        "dropout2d": lambda x: F.dropout2d(x.view(1, 5, 6, 1), 0.5),
        "rand_like": lambda x: x * torch.rand_like(x),
        "randn_like": lambda x: x + torch.randn_like(x),
        "randint_like": lambda x: x * torch.randint_like(x, 0, 9),
        "uniform_": lambda x: x * x.detach().clone().uniform_(-1, 2),
        "normal_": lambda x: x * x.detach().clone().normal_(1, 3),
        "bernoulli_": lambda x: x * x.detach().clone().bernoulli_(0.3),
        "exponential_": lambda x: x * x.detach().clone().exponential_(),
        "bernoulli_float_p": lambda x: x * torch.bernoulli(x.detach(), 0.3),
        "bernoulli_tensor_p": lambda x: x * torch.bernoulli(x.detach().sigmoid()),  # drawn whole
    }
    if mesh.ndim == 1:
        shards = [[Shard(0)], [Shard(1)], [R], [P]]
    else:
        shards = [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [P, Shard(0)]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fn in fns.items():
            for pl in shards:
                out, log = check(_seeded(fn), [x], [pl], mesh)
                if name == "native_dropout" and P not in pl:
                    assert out[0].placements == pl and out[1].placements == pl and _comm(log) == []
                if name == "native_dropout" and pl == [P]:
                    assert out[0].placements == [P] and out[1].placements == [R]
    _no_rule_warnings(caught)

    # placements of fresh random tensors follow the input; the generator advances as in one process
    xs = dist.shard_tensor(x, mesh, shards[0])
    torch.manual_seed(3)
    r1 = torch.rand_like(xs)
    r2 = torch.randn_like(xs)
    torch.manual_seed(3)
    torch.testing.assert_close(dist.unshard_dtensor(r1), torch.rand_like(x))
    torch.testing.assert_close(dist.unshard_dtensor(r2), torch.randn_like(x))
    assert r1.placements == shards[0]
    assert torch.rand_like(dist.shard_tensor(x, mesh, [P] * mesh.ndim)).placements == [R] * mesh.ndim
    return True


def test_random_ops_2_and_4_ranks():
    run_dist(_random_rank, 2, [0, 1])
    run_dist(_random_rank, 4, [0, 1, 2, 3])


def test_random_ops_2d_mesh():
    run_dist(_random_rank, 4, MESH_2D)


def _pipeline_dropout():
    """Stage 0 draws a dropout mask, stage 1 draws another: ranks of stage 1 must have
    advanced their generator through stage 0's draw to match the single process."""
    mesh0, mesh1 = dist.ProcessMesh([0, 1]), dist.ProcessMesh([2, 3])
    torch.manual_seed(7)
    x = torch.randn(6, 4)
    ref = F.dropout(F.dropout(x, 0.5), 0.5)
    torch.manual_seed(7)
    x = torch.randn(6, 4)
    y = F.dropout(dist.shard_tensor(x, mesh0, [Shard(0)]), 0.5)
    z = F.dropout(dist.reshard(y, mesh1, [Shard(0)]), 0.5)
    return torch.equal(dist.unshard_dtensor(z), ref)


def test_random_ops_keep_every_rank_on_the_single_process_stream_across_meshes():
    assert run_dist(_pipeline_dropout, 4) == [True] * 4
