"""Optimizer ops on distributed params: single-tensor, foreach and fused SGD/Adam/AdamW give
the single-process params after several steps, keep their state with the params'
placements, and reduce a Partial gradient once per param and step."""
import warnings

import numpy as np

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as dist
from autopar import Partial, ProcessMesh, Replicate, Shard
from autopar.spec import TensorMeta
from autopar.spmd import engine
from autopar.spmd.strategy import OpCall
from distpool import run_dist

aten = torch.ops.aten
R, P = Replicate(), Partial()
MODES = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
OPTIMS = {
    "sgd": lambda ps, kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
    "sgd_nesterov_wd": lambda ps, kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
    "adam": lambda ps, kw: torch.optim.Adam(ps, lr=0.01, **kw),
    "adam_amsgrad_wd": lambda ps, kw: torch.optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.01, **kw),
    "adamw": lambda ps, kw: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **kw),
    "adagrad": lambda ps, kw: torch.optim.Adagrad(ps, lr=0.1, **kw),
}
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _meta_call(op, *args, **kwargs):
    metas = lambda a: [TensorMeta.of(x) for x in a] if isinstance(a, list) else TensorMeta.of(a) \
        if isinstance(a, torch.Tensor) else a  # noqa: E731
    flat = [t for a in list(args) + list(kwargs.values()) for t in (a if isinstance(a, list) else [a])
            if isinstance(t, torch.Tensor)]
    out = op(*args, **kwargs)
    outs = out if isinstance(out, (list, tuple)) else [] if out is None else [out]
    outs = [t for o in outs for t in (o if isinstance(o, list) else [o])]  # a functional step's lists
    return OpCall(op, tuple(metas(a) for a in args), {k: metas(v) for k, v in kwargs.items()},
                  [TensorMeta.of(t) for t in flat], [TensorMeta.of(t) for t in outs])


def _m(*shape):
    return torch.empty(shape, device="meta")


def test_foreach_and_fused_choices_without_processes():
    mesh = ProcessMesh([0, 1])
    xs, ys = [_m(4, 6), _m(4, 6)], [_m(4, 6), _m(4, 6)]
    # a Partial grad lerped into a sharded state: the grad is reduce-scattered to the state's shard
    call = _meta_call(aten._foreach_lerp_.Scalar, xs, ys, 0.1)
    ins, outs, _ = engine.choose(call, mesh, [(Shard(1),)] * 2 + [(P,)] * 2, inplace=True)
    assert ins == [(Shard(1),)] * 4 and outs == []
    # linear ops keep Partial; adding a scalar to Partial(sum) terms would add it k times
    for op, args, keeps in ((aten._foreach_mul_.Scalar, (xs, 0.9), True),
                            (aten._foreach_lerp_.Scalar, (xs, ys, 0.1), True),
                            (aten._foreach_addcmul_.Scalar, (xs, ys, ys, 0.1), True),  # t2 reduced
                            (aten._foreach_add_.List, (xs, ys), True),
                            (aten._foreach_add_.Scalar, (xs, 1.0), False),
                            (aten._foreach_sqrt_.default, (xs,), False),
                            (aten._foreach_zero_.default, (xs,), True)):
        call = _meta_call(op, *args)
        ins, _, _ = engine.choose(call, mesh, [(P,)] * len(call.inputs), inplace=True)
        assert (ins[0] == (P,)) == keeps, op
    call = _meta_call(aten._foreach_addcmul_.Scalar, xs, ys, ys, 0.1)
    ins, _, _ = engine.choose(call, mesh, [(P,)] * 4 + [(R,)] * 2, inplace=True)
    assert ins == [(P,)] * 4 + [(R,)] * 2
    call = _meta_call(aten._foreach_add.List, xs, ys)
    assert engine.choose(call, mesh, [(Shard(0),)] * 4, inplace=False)[1] == [(Shard(0),)] * 2

    # fused step: every list follows the param, the 0-dim steps stay whole
    steps = [torch.empty((), device="meta")] * 2
    call = _meta_call(aten._fused_adam_.default, xs, ys, xs, xs, [], steps, lr=0.1, beta1=0.9, beta2=0.99,
                      weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    current = [(Shard(0),)] * 2 + [(P,)] * 2 + [(Shard(0),)] * 4 + [(R,)] * 2
    ins, outs, _ = engine.choose(call, mesh, current, inplace=True)
    assert ins == [(Shard(0),)] * 8 + [(R,)] * 2 and outs == []
    # the functional step returns the new params, grads and states, each placed as its input
    call = _meta_call(aten._fused_adamw.default, xs, ys, xs, xs, [], steps, lr=0.1, beta1=0.9, beta2=0.99,
                      weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    ins, outs, _ = engine.choose(call, mesh, current, inplace=False)
    assert ins == [(Shard(0),)] * 8 + [(R,)] * 2 and outs == [(Shard(0),)] * 8


def _functional_fused_adamw(world):
    """aten._fused_adamw (what a captured optimizer calls) on Shard(0) params and a Partial
    gradient, against one process: the new lists, each where its input was."""
    mesh = ProcessMesh(list(range(world)))
    g = torch.Generator().manual_seed(5)
    params, grads, avgs, sqs = ([torch.randn(6, 3, generator=g) for _ in range(2)] for _ in range(4))
    sqs = [s.abs() for s in sqs]
    steps = [torch.tensor(3.0), torch.tensor(3.0)]
    kw = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    want = aten._fused_adamw(params, grads, avgs, sqs, [], steps, **kw)
    shard = lambda ts: [dist.shard_tensor(t, mesh, [Shard(0)]) for t in ts]  # noqa: E731
    partial = [dist.dtensor_from_local(t / world, mesh, [P]) for t in grads]
    params, avgs, sqs = shard(params), shard(avgs), shard(sqs)
    with dist.comm_log() as log:
        got = aten._fused_adamw(params, partial, avgs, sqs, [], steps, **kw)
    for got_list, want_list in zip(got, want):
        for a, b in zip(got_list, want_list):
            assert a.placements == [Shard(0)]
            torch.testing.assert_close(dist.unshard_dtensor(a), b, rtol=1e-5, atol=1e-6)
    return [(r.op, r.bytes) for r in log]


def test_the_functional_fused_step_matches_one_process():
    for ops in run_dist(_functional_fused_adamw, 2, 2):
        assert ops == [("reduce_scatter", 36)] * 2, ops  # each Partial gradient reduced to its shard, 9 floats


# -- numeric runs on 2 and 4 ranks -------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


def _partial_terms(full, mesh):
    """Per-rank terms summing to `full` over every mesh dim (what data parallelism produces)."""
    k, r = mesh.size, mesh.process_ids.index(dist.get_rank())
    local = full * (r + 1) * 2 / (k * (k + 1))
    return dist.dtensor_from_local(local, mesh, [P] * mesh.ndim, shape=full.shape)


def _run(optim, mode, mesh, placements, grad_kind, steps=3):
    """Params after `steps` steps (reference, distributed) and the reductions of each step."""
    ref, model = _model(), _model()
    params = [nn.Parameter(dist.shard_tensor(p.detach(), mesh, pl)) for p, pl in zip(model.parameters(), placements)]
    opt_ref, opt = OPTIMS[optim](ref.parameters(), MODES[mode]), OPTIMS[optim](params, MODES[mode])
    counts = []
    for step in range(steps):
        grads = _grads(ref, step)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        for p, g, pl in zip(params, grads, placements):
            p.grad = _partial_terms(g, mesh) if grad_kind == "partial" else \
                dist.shard_tensor(g.clone(), mesh, pl if grad_kind == "same" else [R] * mesh.ndim)
        opt_ref.step()
        with dist.comm_log() as log:
            opt.step()
        assert all(r.op in REDUCTIONS for r in log), log  # nothing but reductions of Partial grads
        counts.append(len(log))
    for p, want in zip(params, ref.parameters()):
        torch.testing.assert_close(dist.unshard_dtensor(p.detach()), want.detach(), rtol=1e-5, atol=1e-6)
        assert p.placements == list(p._spec.placements)
        for name, state in opt.state[p].items():
            if not isinstance(state, torch.Tensor) or state.shape != p.shape:
                continue
            assert dist.is_dist_tensor(state), name
            if name != "momentum_buffer" or mode == "fused" or grad_kind == "same":
                assert state.placements == p.placements, (name, state.placements)
            else:  # unfused SGD's buffer starts as clone(grad (+ wd * param)): it can keep the grad's
                # Replicate, or a Partial whose reduction waits for the param update
                other = R if grad_kind == "replicate" else P
                assert all(a in (b, other) for a, b in zip(state.placements, p.placements)), state.placements
    return counts


def _optim_rank(mesh, placements):
    mesh = ProcessMesh(mesh)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for optim in OPTIMS:
            for mode in MODES:
                for grad_kind in ("partial", "same", "replicate"):
                    counts = _run(optim, mode, mesh, placements, grad_kind)
                    if grad_kind == "partial":
                        out[optim, mode] = counts
                    else:
                        assert counts == [0] * len(counts), (optim, mode, grad_kind, counts)
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not missing, missing
    return out


def test_optimizers_1d_mesh():
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [R]]  # weights split on rows / columns, bias whole
    for world in (2, 4):
        counts = run_dist(_optim_rank, world, list(range(world)), placements)[0]
        for (optim, mode), per_step in counts.items():
            assert per_step == [4, 4, 4], (world, optim, mode, per_step)  # one reduction per param


def test_optimizers_2d_mesh():
    placements = [[Shard(0), Shard(1)], [R, Shard(0)], [Shard(1), R], [R, R]]
    counts = run_dist(_optim_rank, 4, [[2, 0], [1, 3]], placements)[0]
    for (optim, mode), per_step in counts.items():
        # one reduction per param and mesh dim, except [R, R]: one all-reduce over both dims at once
        assert per_step == [7, 7, 7], (optim, mode, per_step)


# -- data-parallel training end to end ------------------------------------------------------------
def _dp_rank(world):
    mesh = ProcessMesh(list(range(world)))
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(10, 4, generator=gen), torch.randint(0, 3, (10,), generator=gen)) for _ in range(3)]
    for optim in ("sgd", "adam", "adamw"):
        for mode in MODES:
            ref, model = _model(), _model()
            for name, p in model.named_parameters():
                pl = [Shard(1)] if name == "2.weight" else [R]
                setattr(*_owner(model, name), nn.Parameter(dist.shard_tensor(p.detach(), mesh, pl)))
            opt_ref, opt = OPTIMS[optim](ref.parameters(), MODES[mode]), OPTIMS[optim](model.parameters(), MODES[mode])
            for x, y in batches:
                for m, o, xb, yb in ((ref, opt_ref, x, y),
                                     (model, opt, dist.shard_tensor(x, mesh, [Shard(0)]),
                                      dist.shard_tensor(y, mesh, [Shard(0)]))):
                    o.zero_grad()
                    F.cross_entropy(m(xb), yb).backward()
                    o.step()
            for p, want in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(dist.unshard_dtensor(p.detach()), want.detach(), rtol=1e-5, atol=1e-6)
    return True


def _owner(model, name):
    path, attr = name.rsplit(".", 1)
    return model.get_submodule(path), attr


def test_data_parallel_training():
    run_dist(_dp_rank, 2, 2)


def _grad_scaler_steps(world):
    """torch's GradScaler over a tensor-parallel MLP (first layer by columns, second by rows)
    and the plain model, same batches; at step 2 one weight's gradient holds an inf in the
    rows only the last rank holds: every rank skips that step and lowers its scale, as the
    plain run does.  Returns the losses, the scales and found_inf per step."""
    mesh = ProcessMesh(list(range(world)))

    def plan(name, layer, mesh):
        if name == "0":
            layer.weight = dist.shard_tensor(layer.weight, mesh, [Shard(0)])
            layer.bias = dist.shard_tensor(layer.bias, mesh, [Shard(0)])
        elif name == "2":
            layer.weight = dist.shard_tensor(layer.weight, mesh, [Shard(1)])

    runs = []
    for distributed in (False, True):
        model = _model()
        if distributed:
            model = dist.shard_layer(model, mesh, plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        g = torch.Generator().manual_seed(9)
        seen = []
        for step in range(4):
            x = torch.randn(8, 4, generator=g)
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2:  # an overflow in the last rows of the first weight's gradient
                overflow = torch.zeros(6, 4)
                overflow[-1, 0] = float("inf")
                with torch.no_grad():
                    model[0].weight.grad.add_(overflow)
            scaler.step(opt)
            seen.append([loss.item(), scaler.get_scale()])
            scaler.update()
            opt.zero_grad()
        runs.append(seen)
    return runs


def test_grad_scaler_skips_the_same_steps_on_every_rank():
    for plain, distributed in run_dist(_grad_scaler_steps, 2, 2):
        assert [s for _, s in distributed] == [s for _, s in plain]
        np.testing.assert_allclose([loss for loss, _ in distributed], [loss for loss, _ in plain], rtol=1e-5)
