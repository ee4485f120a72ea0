"""The local step on flat buffers (runtime/zero/flat_step.py): after a data-parallel group's first
step its pieces and states live in flat buffers and the optimizer steps chunks of them.  Against
one process (rtol 1e-5) under gradient accumulation, clip_grad_norm_, zero_grad with and without
set_to_none, a skipped parameter and a reloaded state dict; the gradient collectives from
`comm_log`, the same before and after the group is flattened."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from distpool import run_dist

BATCH, IN, HID, OUT = 4, 16, 32, 8
# per step: (micro-batches, clip_grad_norm_, zero_grad's set_to_none)
STEPS = [(1, False, True), (2, False, True), (1, True, False), (2, True, False), (1, False, True)]
NUMEL = IN * HID + HID + HID * HID + HID + HID * OUT + OUT


class Net(torch.nn.Module):
    """Three linears; `skip` leaves the middle one out (its parameters get no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(IN, HID), torch.nn.Linear(HID, HID), torch.nn.Linear(HID, OUT)
        self.skip = False

    def forward(self, x):
        h = F.gelu(self.a(x))
        if not self.skip:
            h = F.gelu(self.b(h))
        return self.c(h)


def _batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _train(model, opt, steps, wrap=lambda t: t, first=0, skip_at=None):
    """The steps of `steps`; per step the loss values and (where `wrap` places the batch) the
    collectives of each micro-batch's forward/backward and of the optimizer step."""
    losses, logs = [], []
    for i, (k, clip, set_to_none) in enumerate(steps, start=first):
        model.skip = i == skip_at
        with dist.comm_log() as log:
            for j in range(k):
                x, y = _batch(i, j)
                loss = F.mse_loss(model(wrap(x)), wrap(y)) / k
                loss.backward()
                losses.append(loss.item())
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        logs.append([(r.op, r.bytes) for r in log])
    return losses, logs


def _reference(steps, skip_at=None, reload_at=None):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, _ = _train(model, opt, steps[:reload_at], skip_at=skip_at)
    if reload_at is not None:
        more, _ = _train(model, opt, steps[reload_at:], first=reload_at, skip_at=skip_at)
        losses += more
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dp_steps(chunk=None, skip_at=None, reload_at=None, flat=True):
    """`chunk`: CPU_CHUNK for this run; `flat=False`: no group is flattened (the per-parameter step)."""
    from autopar.runtime.zero import flat_step

    saved = flat_step.CPU_CHUNK, flat_step.FlatGroup.build
    flat_step.CPU_CHUNK = chunk or saved[0]
    if not flat:
        flat_step.FlatGroup.build = staticmethod(lambda *args: None)
    try:
        return _dp_run(skip_at, reload_at)
    finally:
        flat_step.CPU_CHUNK, flat_step.FlatGroup.build = saved[0], staticmethod(saved[1])


def _dp_run(skip_at, reload_at):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(Net(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    stepped = []  # how many tensors each step hands the optimizer
    opt.register_step_pre_hook(lambda o, a, k: stepped.append(len(o.param_groups[0]["params"])))
    wrap = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)])  # noqa: E731
    losses, logs = _train(model, opt, STEPS[:reload_at], wrap, skip_at=skip_at)
    if reload_at is not None:
        opt.load_state_dict(opt.state_dict())
        more, more_logs = _train(model, opt, STEPS[reload_at:], wrap, first=reload_at, skip_at=skip_at)
        losses, logs = losses + more, logs + more_logs
    storages = len({p._local.untyped_storage().data_ptr() for p in model.parameters()})
    states = {n: {k: dist.unshard_dtensor(v) if isinstance(v, dist.DistTensor) else v.clone()
                  for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, params, states, logs, stepped, storages


def _check(results, ref_losses, ref_params):
    for losses, params, *_ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)


GRAD_BYTES = 4 * NUMEL


def test_flat_step_matches_one_process_with_the_same_gradient_collectives():
    ref_losses, ref_params = _reference(STEPS)
    results = run_dist(_dp_steps, 2)
    _check(results, ref_losses, ref_params)
    for losses, params, states, logs, stepped, storages in results:
        assert stepped == [6, 1, 1, 1, 1], stepped  # per parameter first, then the one flat chunk
        assert storages == 1  # every parameter's piece a view of the flat buffer
        assert all(st["step"].item() == len(STEPS) for st in states.values())
        assert logs[0] == [op for op in logs[0] if op[1] != GRAD_BYTES] + [("all_reduce", GRAD_BYTES)], logs[0]
    # the collectives and their bytes, step by step, the per-parameter step's
    per_parameter = run_dist(_dp_steps, 2, None, None, None, False)
    for flat, per_param in zip(results, per_parameter):
        assert flat[3] == per_param[3]  # the collectives, step by step
        assert per_param[4:] == ([6] * len(STEPS), 6)  # (no flat chunk, no shared buffer)


def test_flat_step_in_chunks_matches_one_process():
    ref_losses, ref_params = _reference(STEPS)
    results = run_dist(_dp_steps, 2, 500)
    _check(results, ref_losses, ref_params)
    chunks = -(-NUMEL // 500)
    assert all(stepped == [6] + [chunks] * (len(STEPS) - 1) for *_, stepped, _ in results)


def test_a_parameter_without_gradient_steps_per_parameter_from_then_on():
    ref_losses, ref_params = _reference(STEPS, skip_at=2)
    results = run_dist(_dp_steps, 2, None, 2)
    _check(results, ref_losses, ref_params)
    for *_, states, _, stepped, _ in results:
        assert stepped == [6, 1, 6, 6, 6], stepped
        assert states["b.weight"]["step"].item() == len(STEPS) - 1  # the skipped step did not count


def test_a_reloaded_state_dict_flattens_again():
    ref_losses, ref_params = _reference(STEPS, reload_at=2)
    results = run_dist(_dp_steps, 2, None, None, 2)
    _check(results, ref_losses, ref_params)
    for *_, stepped, storages in results:
        assert stepped == [6, 1, 6, 1, 1], stepped
        assert storages == 1


def _replaced_run(what: str):
    """Two steps (the group flat from the second), then one piece of `what` ("piece": a
    parameter's local piece, "state": a tensor state) replaced by a copy behind the group's
    back, then the rest: per step the tensors handed to the optimizer, and the numbers."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model, _ = dist.parallelize(Net(), None, mesh, {"dp_config": {}})
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    stepped = []
    opt.register_step_pre_hook(lambda o, a, k: stepped.append(len(o.param_groups[0]["params"])))
    wrap = lambda t: dist.shard_tensor(t, mesh, [dist.Shard(0)])  # noqa: E731
    losses, _ = _train(model, opt, STEPS[:2], wrap)
    w = model.b.weight
    if what == "piece":
        w._local = w._local.clone()
    else:
        opt.state[w]["exp_avg"]._local = opt.state[w]["exp_avg"]._local.clone()
    more, _ = _train(model, opt, STEPS[2:], wrap, first=2)
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses + more, params, stepped


@pytest.mark.parametrize("what", ["piece", "state"])
def test_a_piece_replaced_behind_the_flat_group_steps_per_parameter(what):
    """The flat step checks every member each step: a parameter's piece or a state's piece
    that is no longer the view of the flat buffer it was makes the group step per parameter,
    with the same numbers."""
    ref_losses, ref_params = _reference(STEPS)
    for losses, params, stepped in run_dist(_replaced_run, 2, what):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert stepped[:2] == [6, 1] and stepped[2] == 6, stepped


def test_chunks_take_their_gradients_from_the_buffers_they_lie_in():
    """Gradients lying in two buckets' buffers (each in the layout's order) and one elsewhere:
    a chunk within one buffer is a view of it, a chunk across two is copied; the values are
    the layout's either way."""
    from autopar.runtime.zero.flat_step import _runs, _within

    first, second = torch.arange(10.0), torch.arange(10.0, 16.0)
    grads = [first[:4].view(2, 2), first[4:10], second[:6].view(3, 2), torch.arange(16.0, 20.0).view(2, 2).t()]
    offsets = [0, 4, 10, 16]
    runs = _runs(grads, offsets)
    assert [(a, b) for a, b, _ in runs] == [(0, 10), (10, 16), (16, 20)]
    whole = torch.cat([g.reshape(-1) for g in grads])
    for a, b in [(0, 4), (2, 9), (8, 12), (10, 16), (12, 20), (0, 20)]:
        got = _within(runs, a, b)
        assert torch.equal(got, whole[a:b]), (a, b)
        holders = {r[2].untyped_storage()._cdata for r in runs if r[0] <= a and b <= r[1]}
        assert (got.untyped_storage()._cdata in holders) == bool(holders), (a, b)  # a view, or a copy
