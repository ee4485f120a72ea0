"""Local regions: modules that never communicate run as plain PyTorch on the local pieces,
with the numbers of the single process; modules that cannot are refused at verification."""
import contextlib

import numpy as np
import pytest
import torch

import autopar as dist
from autopar.tensor.observers import watching
from autopar.runtime import local_region
from autopar.placement import Partial, Replicate, Shard
import hf_llama
from distpool import run_dist

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def test_gradient_placements_are_dual():
    # mesh dims: 4 (batch split), 2 (everything replicated), 1 (a label only)
    shape, all_rep = [4, 2, 1], [False, True, False]
    assert local_region._dual((S0, R, P), shape, all_rep) == (S0, R, P)
    assert local_region._dual((R, R, S1), shape, all_rep) == (P, R, S1)
    assert local_region._dual((P, R, R), shape, all_rep) == (R, R, R)


class Mlp(torch.nn.Module):
    """Norm, two linears and a GELU: more than MIN_OPS ops, none of them communicating under DP."""

    def __init__(self, d=8, h=16, bias2=True, dropout=0.0, view_rows=None, made_rows=None):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d, bias=bias2)
        self.dropout, self.view_rows, self.made_rows = dropout, view_rows, made_rows
        if made_rows == "replicated":
            self.row = torch.nn.Parameter(torch.randn(1, 1, d))
        if made_rows == "buffer":  # as long as the global batch (8), and no batch of anything
            self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))
        if self.view_rows is not None:  # a global size written into the code
            y = y.reshape(self.view_rows, -1).reshape(y.shape)
        if self.made_rows == "alike":  # a plain tensor made from the batch size, its rows alike (a mask)
            y = y + torch.full((x.shape[0], 1, 1), 0.5)
        elif self.made_rows == "replicated":  # a parameter's row repeated for each sample (a replicated tensor)
            y = y + self.row.repeat(x.shape[0], 1, 1)
        elif self.made_rows == "buffer":
            y = y * self.scale
        elif self.made_rows == "indexed":  # ... each row its own (made from the local batch, it would differ)
            y = y + torch.arange(x.shape[0], dtype=y.dtype).view(-1, 1, 1)
        return torch.nn.functional.dropout(y, self.dropout, self.training)


class Net(torch.nn.Module):
    def __init__(self, **mlp):
        super().__init__()
        self.mlp = Mlp(**mlp)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(x + self.mlp(x))


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, 8, generator=g), torch.randn(8, 5, 4, generator=g)) for _ in range(n)]


def _train(model, mesh=None, placements=None):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    losses = []
    for x, y in _batches():
        if mesh is not None:
            x, y = (dist.shard_tensor(t, mesh, placements) for t in (x, y))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, params


def _reference(**mlp):
    torch.manual_seed(0)
    return _train(Net(**mlp))


def _regions(module) -> list:
    """Whether each verified call of `module` became a region."""
    return [r is not None for r in module.forward.regions.values()]


def _data_parallel(regions: bool, **mlp):
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(**mlp), mesh)
    with local_region.local_regions(regions):
        losses, params = _train(model, mesh, [S0])
    return losses, params, _regions(model), _regions(model.mlp)


def test_data_parallel_model_is_one_region_and_matches_single_process():
    ref_losses, ref_params = _reference()
    for regions in (True, False):
        for losses, params, root, mlp in run_dist(_data_parallel, 4, regions):
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
            for k, v in params.items():
                torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
            assert root == ([True] if regions else [])


def _op_counter(into: list):
    """An op watcher that appends each op dispatched one by one to `into`."""
    return type("Count", (), {"see": lambda self, func, *_: into.append(func)})()


def _data_parallel_counts():
    """Dispatched ops and collectives of one step once the model is a region."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(), mesh)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    counted = []
    watch = _op_counter(counted)
    for i, (x, y) in enumerate(_batches()):
        x, y = (dist.shard_tensor(t, mesh, [S0]) for t in (x, y))
        with dist.comm_log() as log, watching(watch) if i == 2 else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return len(counted), [e.op for e in log]


def test_a_region_step_dispatches_only_the_loss_and_reduces_gradients_once():
    for ops, collectives in run_dist(_data_parallel_counts, 4):
        # the model's ~40 forward and ~60 backward ops run as plain torch; the loss and its
        # backward remain (fewer than the 8 parameters: no AccumulateGrad detach each)
        assert ops < 8, ops
        assert collectives == ["all_reduce"], collectives  # one gradient bucket (the loss is read after)


def _tensor_parallel():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

    def megatron(name, sub, mesh):
        if name == "mlp.fc1":
            sub.weight = dist.shard_tensor(sub.weight, mesh, [R, S0])
            sub.bias = dist.shard_tensor(sub.bias, mesh, [R, S0])
        if name == "mlp.fc2":
            sub.weight = dist.shard_tensor(sub.weight, mesh, [R, S1])

    torch.manual_seed(0)
    model = dist.shard_layer(Net(bias2=False), mesh, megatron)
    losses, params = _train(model, mesh, [S0, R])
    return losses, params, _regions(model), _regions(model.mlp)


def test_tensor_parallel_sublayer_is_a_region_with_a_partial_output():
    ref_losses, ref_params = _reference(bias2=False)
    for losses, params, root, mlp in run_dist(_tensor_parallel, 4):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert mlp == [True]  # column -> GELU -> row: no op communicates; its output is Partial
        assert root == [False]  # the residual add reduces that Partial


@pytest.mark.parametrize("made", ["alike", "replicated"])
def test_a_tensor_made_in_the_forward_with_rows_alike_is_cut_in_a_region(made):
    ref_losses, ref_params = _reference(made_rows=made)
    for losses, params, root, sub in run_dist(_data_parallel, 4, True, made_rows=made):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert root == [True]


def test_a_buffer_as_long_as_the_batch_is_not_cut():
    """A buffer whose leading dim happens to equal the global batch (HF's rotary frequencies
    beside a batch of 8) is whole on every rank: verification's trial must not cut it."""
    ref_losses, ref_params = _reference(made_rows="buffer")
    for losses, params, root, sub in run_dist(_data_parallel, 4, True, made_rows="buffer"):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert root == [True]


@pytest.mark.parametrize("case", ["dropout", "global_view", "indexed_rows"])
def test_modules_that_are_not_local_are_refused_and_still_right(case):
    mlp = {"dropout": {"dropout": 0.0}, "global_view": {"view_rows": 4}, "indexed_rows": {"made_rows": "indexed"}}[case]
    ref_losses, ref_params = _reference(**mlp)
    if case == "dropout":
        mlp = {"dropout": 1e-9}  # draws random numbers (never drops: the numbers stay comparable)
    for losses, params, root, sub in run_dist(_data_parallel, 4, True, **mlp):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert root == [False] and sub == [False]


def _disagreeing_ranks():
    """Rank 0's piece holds a NaN: its trial cannot agree bit for bit, so no rank uses a region."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Mlp(), mesh)
    x = torch.randn(8, 8)
    x[0, 0] = float("nan")
    model(dist.shard_tensor(x, mesh, [S0]))
    return _regions(model)


def test_every_rank_reaches_the_same_verdict():
    assert run_dist(_disagreeing_ranks, 4) == [[False]] * 4


def _replaced_parameter():
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Mlp(), mesh)
    x = dist.shard_tensor(torch.randn(8, 8), mesh, [S0])
    model(x)
    model.fc1.weight = dist.shard_tensor(torch.nn.Parameter(torch.zeros(16, 8)), mesh, [R])
    out = model(x)  # the verified region no longer holds: op by op, with the new weight
    torch.manual_seed(0)
    expect = Mlp()
    with torch.no_grad():
        expect.fc1.weight.zero_()
    return torch.equal(dist.unshard_dtensor(out.detach()), expect(x.full_value()).detach())


def test_a_replaced_parameter_is_used():
    assert run_dist(_replaced_parameter, 4) == [True] * 4


def _normalized(_module, _args, out):
    """A user's hook that changes a sublayer's output by a value over all of it (its norm)."""
    return out / out.norm()


def _scaling_its_gradient(_module, _args, out):
    """A user's hook that has the sublayer's output gradient scaled by a sum over all of it."""
    out.register_hook(lambda g: g * g.sum())


def _hooked_after_verification():
    """Net trained under dp 4, a user's forward hook added to its sublayer once the model is a
    verified region (and a gradient hook inside it, registered by a forward hook)."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(), mesh)
    x, y = (dist.shard_tensor(t, mesh, [S0]) for t in _batches(1)[0])
    torch.nn.functional.mse_loss(model(x), y).backward()  # (verified: a region from here on)
    was_region = _regions(model) == [True]
    model.zero_grad()
    model.mlp.register_forward_hook(_normalized)
    model.mlp.fc1.register_forward_hook(_scaling_its_gradient)
    out = model(x)
    torch.nn.functional.mse_loss(out, y).backward()
    return was_region, dist.unshard_dtensor(out.detach()), {k: dist.unshard_dtensor(p.grad) for k, p in
                                                            model.named_parameters()}


def test_a_users_hook_on_a_sublayer_sees_and_changes_what_one_process_does():
    """Inside a region a sublayer's hook would run on the local pieces (a norm over a rank's
    rows; a gradient hook in backward, where nothing verifies): a module with a user's hook on
    a sublayer runs op by op, and the output and gradients are one process's."""
    torch.manual_seed(0)
    model = Net()
    x, y = _batches(1)[0]
    model.mlp.register_forward_hook(_normalized)
    model.mlp.fc1.register_forward_hook(_scaling_its_gradient)
    out = model(x)
    torch.nn.functional.mse_loss(out, y).backward()
    for was_region, got, grads in run_dist(_hooked_after_verification, 4):
        assert was_region
        torch.testing.assert_close(got, out.detach(), rtol=1e-5, atol=1e-6)
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-6)


def _forward_replaced_after_verification():
    """Net under dp 4, its sublayer's forward replaced by a non-local one once the model is a
    verified region."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(), mesh)
    x = dist.shard_tensor(_batches(1)[0][0], mesh, [S0])
    model(x)
    model(x)
    was_region = _regions(model) == [True]
    _normalize_forward(model.mlp)
    return was_region, dist.unshard_dtensor(model(x).detach())


def _normalize_forward(layer):
    own = layer.forward
    layer.forward = lambda x: (lambda out: out / out.norm())(own(x))


def test_a_sublayers_forward_replaced_after_verification_is_verified_again():
    torch.manual_seed(0)
    model = Net()
    _normalize_forward(model.mlp)
    expect = model(_batches(1)[0][0]).detach()
    for was_region, got in run_dist(_forward_replaced_after_verification, 4):
        assert was_region
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


def _sublayer_replaced_after_verification():
    """Net trained 3 steps under dp 4; after the first, its head replaced by a fresh plain
    Linear (as a user swapping a layer)."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(), mesh)
    return _swap_head_and_train(model, mesh)


def _swap_head_and_train(model, mesh=None):
    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches()):
        if i == 1:
            torch.manual_seed(1)
            model.head = torch.nn.Linear(8, 4)
            opt.add_param_group({"params": list(model.head.parameters())})
        if mesh is not None:
            x, y = (dist.shard_tensor(t, mesh, [S0]) for t in (x, y))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) if type(v) is not torch.Tensor else v.detach()
                    for k, v in model.state_dict().items()}


def test_a_sublayer_replaced_after_verification_is_verified_again():
    """The new layer's plain parameters are global values, their gradients reduced over the
    ranks (inside the old region they got one rank's part)."""
    torch.manual_seed(0)
    ref_losses, ref_params = _swap_head_and_train(Net())
    for losses, params in run_dist(_sublayer_replaced_after_verification, 4):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


def _inference():
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Net(), mesh).eval()
    x = torch.randn(8, 5, 8)
    with torch.no_grad():
        outs = [dist.unshard_dtensor(model(dist.shard_tensor(x, mesh, [S0]))) for _ in range(2)]
    import copy

    twin = copy.deepcopy(model)
    return outs, _regions(model), dist.unshard_dtensor(twin(dist.shard_tensor(x, mesh, [S0])).detach()), x


def test_inference_runs_as_a_region_and_a_copied_model_verifies_its_own():
    torch.manual_seed(0)
    ref = Net().eval()
    for outs, root, twin_out, x in run_dist(_inference, 4):
        expect = ref(x).detach()
        assert root == [True]
        for out in outs + [twin_out]:
            torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)


class Gathering(Mlp):
    """Gathers and re-splits its activation with explicit reshards (transfers, not dispatched ops)."""

    def forward(self, x):
        y = super().forward(x)
        mesh = y.process_mesh
        return dist.reshard(dist.reshard(y, mesh, [R]), mesh, [S0])


def _explicit_reshard():
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Gathering(), mesh)
    x = torch.randn(8, 8)
    outs = [dist.unshard_dtensor(model(dist.shard_tensor(x, mesh, [S0])).detach()) for _ in range(2)]
    return outs, _regions(model), x


def test_a_forward_that_transfers_is_not_a_region():
    torch.manual_seed(0)
    ref = Mlp()
    for outs, regions, x in run_dist(_explicit_reshard, 4):
        assert regions == [False]
        for out in outs:
            torch.testing.assert_close(out, ref(x).detach(), rtol=1e-5, atol=1e-6)


def _changed_setting(mesh_size):
    """Step 0 verifies the model as a region (no dropout); then dropout is switched on: the
    region must be verified again (and refused: dropout draws random numbers)."""
    mesh = dist.ProcessMesh(list(range(mesh_size)), dim_names=["dp"]) if mesh_size else None
    torch.manual_seed(0)
    model = Net()
    if mesh is not None:
        model = dist.shard_layer(model, mesh)
    regions, losses = [], []
    for step, (x, y) in enumerate(_batches()):
        if step == 1:
            model.mlp.dropout = 0.5
        if mesh is not None:
            x, y = (dist.shard_tensor(t, mesh, [S0]) for t in (x, y))
        losses.append(torch.nn.functional.mse_loss(model(x), y).item())
        if mesh is not None:
            regions.append(_regions(model))
    return losses, regions


def test_a_changed_setting_is_verified_again():
    ref_losses, _ = _changed_setting(0)
    for losses, regions in run_dist(_changed_setting, 4, 4):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert regions == [[True], [False], [False]]


class Counting(Mlp):
    """A forward with side effects: a buffer and a Python attribute counted up in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x):
        self.seen += 1
        self.calls += 1
        return super().forward(x)


class Shrinking(Mlp):
    def forward(self, x):
        self.fc1.weight.data.mul_(0.5)  # writes a parameter in place, through an alias
        return super().forward(x)


def _side_effects():
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Counting(), mesh)
    x = torch.randn(8, 8)
    counts = []
    for _ in range(2):
        model(dist.shard_tensor(x, mesh, [S0]))
        counts.append((model.seen.full_value().item(), model.calls))
    torch.manual_seed(0)
    shrinking = dist.shard_layer(Shrinking(), mesh)
    outs = [dist.unshard_dtensor(shrinking(dist.shard_tensor(x, mesh, [S0])).detach()) for _ in range(2)]
    return counts, _regions(model), outs, _regions(shrinking), x


def test_a_forward_with_side_effects_has_them_once():
    results = run_dist(_side_effects, 4)
    torch.manual_seed(0)
    ref = Shrinking()
    x = results[0][-1]
    expect = [ref(x).detach() for _ in range(2)]  # the weight halves once per call
    for counts, regions, outs, shrinking_regions, _ in results:
        assert counts == [(1.0, 1), (2.0, 2)]
        assert regions == [False] and shrinking_regions == [False]  # they write their own tensors
        for out, want in zip(outs, expect):
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def _accumulate(mesh_size):
    """Two micro-batches per step (gradients accumulate before one reduction), fc1 frozen."""
    torch.manual_seed(0)
    model = Net()
    model.mlp.fc1.requires_grad_(False)
    mesh = dist.ProcessMesh(list(range(mesh_size)), dim_names=["dp"]) if mesh_size else None
    if mesh is not None:
        model = dist.shard_layer(model, mesh)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    losses = []
    for x, y in _batches(4):
        for half in (slice(0, 4), slice(4, 8)):
            xs, ys = x[half], y[half]
            if mesh is not None:
                xs, ys = (dist.shard_tensor(t, mesh, [S0]) for t in (xs, ys))
            loss = torch.nn.functional.mse_loss(model(xs), ys) / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, params, _regions(model) if mesh is not None else None


def test_accumulated_gradients_and_frozen_parameters():
    ref_losses, ref_params, _ = _accumulate(0)
    for losses, params, regions in run_dist(_accumulate, 4, 4):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-6)
        assert regions and all(regions), regions  # (the training calls, and the last with no labels)


class Stepping(Mlp):
    """A forward that counts its calls in a plain attribute (a setting it changes itself)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _stepping():
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = dist.shard_layer(Stepping(), mesh)
    x = dist.shard_tensor(torch.randn(8, 8), mesh, [S0])
    calls = []
    for _ in range(3):
        model(x)
        calls.append(model.calls)
    return calls, _regions(model)


def test_a_forward_that_changes_its_settings_counts_once_and_is_not_verified_every_call():
    for calls, regions in run_dist(_stepping, 4):
        assert calls == [1, 2, 3]
        assert regions == [False]  # refused once, not verified again at every call


class SharedGradient(torch.nn.Module):
    """`x + b1 + b2` with b1, b2 of x's shape: autograd hands x, b1 and b2 one gradient tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.b1 = torch.nn.Parameter(torch.zeros(2, 4))
        self.b2 = torch.nn.Parameter(torch.zeros(2, 4))

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(self.lin(x))
        return x + self.b1 + self.b2


def _shared_gradient(mesh_size):
    """Backward three times, gradients zeroed after the first (the verifying call): the two
    region backwards accumulate into gradients the first of them created."""
    torch.manual_seed(0)
    model = SharedGradient()
    mesh = dist.ProcessMesh(list(range(mesh_size)), dim_names=["dp"]) if mesh_size else None
    if mesh is not None:
        model = dist.shard_layer(model, mesh)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 4, generator=g)
        if mesh is not None:
            x = dist.shard_tensor(x, mesh, [R])
        (model(x) ** 2).sum().backward()
        if step == 0:
            model.zero_grad()
    grads = {k: dist.unshard_dtensor(p.grad) if mesh is not None else p.grad for k, p in model.named_parameters()}
    return grads, _regions(model) if mesh is not None else None


def test_parameters_handed_one_gradient_tensor_accumulate_separately():
    ref, _ = _shared_gradient(0)
    for grads, regions in run_dist(_shared_gradient, 2, 2):
        assert regions and all(regions), regions  # (the training calls, and the last with no labels)
        for k, v in grads.items():
            torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6)


def _gradient_routes(mesh_size):
    """A region's parameter gradients through every route backward offers: first gradients
    set directly (no `detach` through the dispatch), tensor and post-accumulate hooks,
    `autograd.grad`, `backward(inputs=...)`."""
    torch.manual_seed(0)
    model = Net()
    mesh = dist.ProcessMesh(list(range(mesh_size)), dim_names=["dp"]) if mesh_size else None
    x, y = _batches(1)[0]
    if mesh is not None:
        model = dist.shard_layer(model, mesh)
        x, y = (dist.shard_tensor(t, mesh, [S0]) for t in (x, y))
    full = (lambda t: dist.unshard_dtensor(t)) if mesh is not None else (lambda t: t)
    loss_of = lambda: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731
    loss_of().backward()  # (the first call verifies the region)
    model.zero_grad()
    seen = []
    model.head.weight.register_hook(lambda g: g * 2)
    model.head.bias.register_post_accumulate_grad_hook(lambda p: seen.append(full(p.grad).sum().item()))
    detaches = []
    watch = type("Count", (), {"see": lambda self, func, *a: detaches.append(func) if "detach" in str(func) else None})()
    with watching(watch):
        loss_of().backward()
    grads = {k: full(p.grad) for k, p in model.named_parameters()}
    model.zero_grad()
    names = [k for k, _ in model.named_parameters()]
    captured = dict(zip(names, (full(g) for g in torch.autograd.grad(loss_of(), list(model.parameters())))))
    untouched = all(p.grad is None for p in model.parameters())
    loss_of().backward(inputs=[model.mlp.fc1.weight])
    only = [k for k, p in model.named_parameters() if p.grad is not None]
    return grads, seen, len(detaches), captured, untouched, only


def test_gradients_reach_hooks_autograd_grad_and_backward_inputs():
    ref = _gradient_routes(0)
    for grads, seen, detaches, captured, untouched, only in run_dist(_gradient_routes, 4, 4):
        for k, v in ref[0].items():
            torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(captured[k], ref[3][k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(seen, ref[1], rtol=1e-5)
        assert detaches == 2, detaches  # only the two hooked parameters went through AccumulateGrad
        assert untouched and only == ["mlp.fc1.weight"]


def _hf_base_model():
    """HF Llama under dp 2 (eager attention: a causal mask made in the forward): its base model,
    whose output is HF's ModelOutput, is one region; the ops dispatched one by one in a step
    after; what the base model returns."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama(use_cache=False)
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    data = hf_llama.batches(4)
    losses = hf_llama.train(model, opt, data[:3])
    counted = []
    with watching(_op_counter(counted)):
        losses += hf_llama.train(model, opt, data[3:])
    out = model.model(input_ids=dist.shard_tensor(data[0][0], mesh, [S0]))
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, weights, _regions(model.model), len(counted), type(out).__name__, type(out.last_hidden_state)


def test_an_hf_base_model_runs_as_one_region():
    ref = hf_llama.reference(hf_llama.batches(4), use_cache=False)
    for losses, weights, regions, ops, out, hidden in run_dist(_hf_base_model, 2):
        hf_llama.assert_matches((losses, weights, []), ref + ([],))
        assert regions and all(regions), regions  # (the training calls, and the last with no labels)
        assert out == "BaseModelOutputWithPast" and hidden is dist.DistTensor
        # the LM head and the loss, forward and backward (62 with each decoder layer a region of its own)
        assert ops <= 30, ops
