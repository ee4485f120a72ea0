"""ZeRO 0-3 against the single process: HF Llama and an MLP through `parallelize` and
`shard_optimizer`; gradients the user can read, clip and scale; `opt.state[p]`,
`state_dict()` and checkpoints; the collectives and bytes of a step; ZeRO-3's gathered
parameters; parameters converted in place."""
import copy

import numpy as np
import pytest
import torch

import autopar as dist
import hf_llama
from autopar.placement import Replicate, Shard
from distpool import run_dist

R, S0 = Replicate(), Shard(0)
LEVELS = (0, 1, 2, 3)
LR = 1e-3  # AdamW moves a weight whose gradient is about 0 by about lr whatever its sign: keep that below atol


def _touch_grads(model):
    """What users do between backward and step: clip by norm and by value, scale by hand."""
    params = list(model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    torch.nn.utils.clip_grad_value_(params, 4e-3)
    for p in params[::3]:
        p.grad.mul_(0.5)
    return norm


def _llama_reference(steps=4, tie=False):
    model = hf_llama.tiny_llama(tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    data = hf_llama.batches(steps, batch=8)
    losses = hf_llama.train(model, opt, data[:-1], clip=lambda m: norms.append(_touch_grads(m)))
    losses += hf_llama.train(model, opt, data[-1:])
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _llama(level, mesh_ids, dims, plan=None, steps=4, tie=False):
    """One HF Llama run through parallelize (gradients touched in every step but the last);
    per step its loss, the clipped norm, the collectives of forward + backward + step and
    the logits' placements."""
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dims)
    model = hf_llama.tiny_llama(tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {"dp_config": {"sharding_level": level}}
    if plan is not None:
        config["mp_config"] = {"parallelize_plan": plan}
    model, opt = dist.parallelize(model, opt, mesh, config)
    losses, norms, comm, logits = [], [], [], []
    for ids, labels in hf_llama.batches(steps, batch=8):
        last = len(losses) == steps - 1
        with dist.comm_log() as log:
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            if last:
                opt.step()
        if not last:
            norms.append(_touch_grads(model))
            opt.step()
        opt.zero_grad()
        comm.append([(r.op, r.bytes) for r in log])
        logits.append(out.logits.placements)
        losses.append(out.loss.item())
    state = opt.state[next(model.parameters())]
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, norms, weights, comm, logits, state["exp_avg"].placements


def _check(got, ref):
    losses, norms, weights = got[:3]
    np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
    np.testing.assert_allclose(norms, ref[1], rtol=1e-5)
    for k, v in ref[2].items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _count(comm, op=None):
    return len([o for o, _ in comm if op is None or o == op])


def _bytes(comm):
    return sum(b for _, b in comm)


def test_llama_every_zero_level_matches_single_process_with_bounded_collectives():
    """Data parallel over 4 ranks at ZeRO levels 0-3: the single-process losses, clipped norms
    and weights; per step (the last: local regions verify level by level of the module tree in
    the first three) ZeRO-1/2 run at most 2x the collectives
    of level 0 with its bytes, ZeRO-3 at most 1.6x its bytes with the batch sharded to the
    logits; optimizer states sharded over dp from level 1 on."""
    ref = _llama_reference()
    runs = {level: run_dist(_llama, 4, level, [0, 1, 2, 3], ["dp"]) for level in LEVELS}
    for level, results in runs.items():
        for got in results:
            _check(got, ref)
    for rank in range(4):
        base = runs[0][rank][3][-1]
        for level in LEVELS:
            comm, logits, state = runs[level][rank][3][-1], runs[level][rank][4], runs[level][rank][5]
            assert logits == [[S0]] * 4, (level, logits)
            assert state == ([R] if level == 0 else [S0]), (level, state)
            if level in (1, 2):
                assert _count(comm) <= 2 * _count(base), (level, comm, base)
                assert _bytes(comm) <= _bytes(base) * 1.001, (level, comm, base)
                # level 0's one gradient bucket, which carries the mean loss's (sum, count)
                # (`deferred_mean`), became one reduce-scatter (ZeRO-1: the pre-step's bucket;
                # ZeRO-2: the same, where the backward ends) and the loss's all-reduce of its own
                assert _count(base, "all_reduce") == 1 and _count(comm, "all_reduce") == 1, (comm, base)
                assert _count(comm, "reduce_scatter") == 1, comm
            if level == 3:
                assert _bytes(comm) <= 1.6 * _bytes(base), (comm, base)
                assert _count(comm, "all_gather") <= 2 * 5 + _count(base, "all_gather")  # 5 layers/units


def test_llama_zero3_on_dp_x_mp_and_tied_embeddings():
    """ZeRO-3 with tensor parallel (Megatron plan over mp) and with tied embeddings (the
    shared weight belongs to the model's own unit)."""
    ref = _llama_reference()
    for got in run_dist(_llama, 4, 3, [[0, 1], [2, 3]], ["dp", "mp"], hf_llama.mp_plan()):
        _check(got, ref)
        assert got[4] == [[S0, Shard(2)]] * 4  # logits: batch over dp, vocabulary over mp
    ref = _llama_reference(tie=True)
    for got in run_dist(_llama, 2, 3, [0, 1], ["dp"], None, 4, True):
        _check(got, ref)


# -- an MLP through shard_layer + shard_optimizer ------------------------------------------------
class _Stack(torch.nn.Module):
    """Four linears in a ModuleList (ZeRO-3: four units) and a head outside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return self.head(x)


def _data(n, micro=1):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(micro)] for _ in range(n)]


def _backward(model, x, y, scale):
    loss = torch.nn.functional.mse_loss(model(x), y) / scale
    loss.backward()
    return loss.item()


def _steps(model, opt, data, mesh=None, touch=None):
    """Per step, a backward per micro-batch (the batch split over "dp" of `mesh`), `touch`
    (which may read and change the gradients; its results are kept), then the step."""
    place = (lambda t: t) if mesh is None else (lambda t: dist.shard_tensor(t, mesh, [S0]))
    losses = []
    for batch in data:
        losses += [_backward(model, place(x), place(y), len(batch)) for x, y in batch]
        if touch is not None:
            losses.append(touch(model))
        opt.step()
        opt.zero_grad()
    return losses


def _mlp_reference(data, touch=None):
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return _steps(model, opt, data, touch=touch), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero_mlp(level, world):
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    model = dist.shard_layer(_Stack(), mesh)
    stage = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}.get(level)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), stage("dp") if stage else None)
    return model, opt, mesh


def _weights(model):
    return {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


def _states_and_round_trip(level, path):
    """Two steps; the states under the user's Parameters; the optimizer's state_dict into a
    fresh optimizer (in memory) and through a checkpoint, both continued for two steps."""
    data = _data(4)
    model, opt, mesh = _zero_mlp(level, 4)
    losses = _steps(model, opt, data[:2], mesh)
    states = {name: (opt.state[p]["exp_avg"].placements, tuple(opt.state[p]["exp_avg"].local_value().shape))
              for name, p in model.named_parameters()}
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # (torch's state_dict holds the live states)
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    straight = losses + _steps(model, opt, data[2:], mesh)
    resumed = {}
    for how in ("memory", "checkpoint"):
        model, opt, mesh = _zero_mlp(level, 4)
        if how == "memory":
            model.load_state_dict(saved_model)
            opt.load_state_dict(saved_opt)
        else:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            dist.load_state_dict(state, path)
            opt.load_state_dict(state["opt"])
        resumed[how] = losses + _steps(model, opt, data[2:], mesh), _weights(model)
    return straight, _weights(model), states, resumed


@pytest.mark.parametrize("level", LEVELS)
def test_states_are_keyed_by_the_parameters_and_round_trip(level, tmp_path):
    ref_losses, ref_weights = _mlp_reference(_data(4))
    for straight, weights, states, resumed in run_dist(_states_and_round_trip, 4, level, str(tmp_path / "ckpt")):
        np.testing.assert_allclose(straight, ref_losses, rtol=1e-5)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)
        for name, (placements, local_shape) in states.items():
            full = tuple(ref_weights[name].shape)
            assert placements == ([R] if level == 0 else [S0]), (name, placements)
            assert local_shape == (full if level == 0 else (full[0] // 4,) + full[1:]), (name, local_shape)
        for how, (losses, got) in resumed.items():
            assert losses == straight, how  # the same program from the same state: bit for bit
            for k, v in weights.items():
                assert torch.equal(got[k], v), (how, k)


def _accumulate_and_clip(level):
    data = _data(3, micro=2)
    model, opt, mesh = _zero_mlp(level, 4)
    return _steps(model, opt, data, mesh, _touch_grads), _weights(model)


@pytest.mark.parametrize("level", LEVELS)
def test_gradient_accumulation_and_clipping(level):
    """Two micro-batches per step (ZeRO-1 keeps the sum whole until the step, ZeRO-2 and 3
    reduce-scatter every backward and add the shards), then the gradients clipped by norm
    and by value and scaled by hand: the norms, losses and weights of one process."""
    ref_losses, ref_weights = _mlp_reference(_data(3, micro=2), _touch_grads)
    for losses, weights in run_dist(_accumulate_and_clip, 4, level):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)


def _gathered_bytes(model):
    """Bytes of the model's ZeRO-3 gathered parameters held now on this rank."""
    from autopar.runtime.zero import zero3

    gathered = [zero3.gathered_piece(p) for p in model.parameters()]
    # (a unit's pieces share one storage)
    return sum({g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in gathered if g is not None}.values())


def _zero3_memory():
    """Sample the gathered parameter bytes wherever a layer starts its forward or backward."""
    model, opt, mesh = _zero_mlp(3, 4)
    seen = []
    for layer in model.modules():
        layer.register_forward_pre_hook(lambda *_: seen.append(_gathered_bytes(model)))
        layer.register_full_backward_pre_hook(lambda *_: seen.append(_gathered_bytes(model)))
    losses = _steps(model, opt, _data(3), mesh)
    sharded = sum(p.local_value().numel() * 4 for p in model.parameters())
    return losses, _weights(model), max(seen), _gathered_bytes(model), sharded


def test_zero3_holds_about_one_layer_gathered():
    """Each rank holds its quarter of the parameters, plus at most the layer running and the
    next one being gathered (prefetch); nothing gathered stays after the step."""
    ref_losses, ref_weights = _mlp_reference(_data(3))
    layer = (16 * 16 + 16) * 4
    for losses, weights, peak, after, sharded in run_dist(_zero3_memory, 4):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)
        assert sharded <= sum(v.numel() for v in ref_weights.values()) * 4 / 4 + 16 * 4
        assert 0 < peak <= 2 * layer, (peak, layer)
        assert after == 0


def _registries_after_the_parameters_go():
    """ZeRO-2 (its parameters reduced in every backward) and ZeRO-3 (its parameters gathered
    by units) on converted models; both dropped; then new parameters, some at the addresses
    (ids) the dropped ones had."""
    import gc
    import weakref

    from autopar.runtime import grad_reduce
    from autopar.runtime.zero import zero3

    gc.collect()
    sizes = lambda: (len(grad_reduce._IN_BACKWARD), len(zero3._ZERO_PARAMS))  # noqa: E731
    before = sizes()
    (model2, opt2, mesh), (model3, opt3, _) = _zero_mlp(2, 2), _zero_mlp(3, 2)
    params = [*model2.parameters(), *model3.parameters()]
    registered = [sum(grad_reduce.registered(p) is not None for p in params), sum(map(zero3.gathers, params))]
    held = [s - b for s, b in zip(sizes(), before)]
    dead = {id(p) for p in params}
    refs = [weakref.ref(p) for p in params]
    del model2, opt2, model3, opt3, params
    gc.collect()
    # (the registries' sizes also move with other tests' leftovers in this worker: count ours)
    left = sum(r() is not None for r in refs)
    fresh = [dist.shard_tensor(torch.nn.Parameter(torch.zeros(16, 16)), mesh, [R]) for _ in range(200)]
    reused = [t for t in fresh if id(t) in dead]
    stale = [t for t in reused if grad_reduce.registered(t) is not None or zero3.gathers(t)
             or zero3.gathered_piece(t) is not None]
    return registered, held, left, len(reused), len(stale)


def test_a_dead_parameters_zero_state_goes_with_it():
    """Per-parameter entries are keyed by the tensor, weakly: they go when the parameter goes
    (nothing of ZeRO's keeps a dropped model's parameters alive), and a new tensor at a dead
    parameter's address finds none of its state."""
    for registered, held, left, reused, stale in run_dist(_registries_after_the_parameters_go, 2):
        assert registered == held == [10, 10], (registered, held)  # 5 weights + 5 biases each
        assert left == 0, left  # no parameter kept alive, so no entry left (the keys are weak)
        assert reused > 0  # (CPython reuses the freed objects' memory)
        assert stale == 0


def _plain_optimizer_before_shard_layer(stage3_on_plain):
    """An optimizer built on the plain model and never given to shard_optimizer (shard_layer
    converts the Parameters it holds in place); or a plain model whose parameters only
    ShardingStage3("dp", mesh) converts (sharded in place)."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = _Stack()
    before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if stage3_on_plain:
        opt = dist.shard_optimizer(opt, dist.ShardingStage3("dp", mesh))
    else:
        dist.shard_layer(model, mesh)
    same = all(a is b for a, b in zip(before, model.parameters()))
    local = sum(p.local_value().numel() for p in model.parameters())
    losses = _steps(model, opt, _data(3), mesh)
    return losses, _weights(model), same, local, [p.placements for p in model.parameters()]


@pytest.mark.parametrize("stage3_on_plain", [False, True], ids=["plain_optimizer", "stage3_mesh"])
def test_parameters_are_converted_in_place(stage3_on_plain):
    ref_losses, ref_weights = _mlp_reference(_data(3))
    full = sum(v.numel() for v in ref_weights.values())
    for losses, weights, same, local, placements in run_dist(_plain_optimizer_before_shard_layer, 2, stage3_on_plain):
        assert same
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)
        assert placements == [[S0] if stage3_on_plain else [R]] * 10
        assert local == (full // 2 if stage3_on_plain else full)


def _mp_then_dp(path):
    """Saved from a tensor-parallel run (mp over 2 ranks), loaded into a fresh data-parallel
    model and optimizer (the load_state_dict docstring's recipe): the states land placed
    like their parameters and training goes on as uninterrupted."""
    data = _data(4)
    mp = dist.ProcessMesh([0, 1], dim_names=["mp"])

    def megatron(name, sub, mesh):
        if name in ("layers.0", "layers.2"):
            sub.weight = dist.shard_tensor(sub.weight, mesh, [S0])
        if name in ("layers.1", "layers.3"):
            sub.weight = dist.shard_tensor(sub.weight, mesh, [Shard(1)])

    model = dist.shard_layer(_Stack(), mp, megatron)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    first = _steps(model, opt, data[:2])
    dist.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    model, opt, mesh = _zero_mlp(1, 2)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dist.load_state_dict(state, path)
    opt.load_state_dict(state["opt"])
    placed = all(v.process_mesh == mesh and v.placements == [S0]
                 for s in opt.state.values() for k, v in s.items() if k != "step")
    return first + _steps(model, opt, data[2:], mesh), _weights(model), placed


def test_optimizer_states_loaded_into_another_parallelization_land_like_their_parameters(tmp_path):
    ref_losses, ref_weights = _mlp_reference(_data(4))
    for losses, weights, placed in run_dist(_mp_then_dp, 2, str(tmp_path / "ckpt")):
        assert placed
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)


def _hooks_survive_conversion():
    """A gradient hook the user registered on a plain Parameter still fires (and only it)
    after shard_layer converted the Parameter in place."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = _Stack()
    seen = []
    model.head.weight.register_hook(lambda g: seen.append(("tensor", type(g).__name__)))
    model.head.bias.register_post_accumulate_grad_hook(lambda p: seen.append(("accumulated", type(p.grad).__name__)))
    dist.shard_layer(model, mesh)
    x = dist.shard_tensor(torch.randn(4, 16), mesh, [S0])
    model(x).sum().backward()
    return seen


def test_gradient_hooks_survive_conversion_in_place():
    for seen in run_dist(_hooks_survive_conversion, 2):
        assert sorted(seen) == [("accumulated", "DistTensor"), ("tensor", "DistTensor")], seen


def _raising_backward(mesh=None):
    """A step whose backward raises where it reaches layers[1]'s output (the head's and the
    last two layers' gradients are in, the first two layers' are not)."""
    def run(model, opt, x, y):
        def hook(_module, _args, out):
            out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("the backward raised")))
        handle = model.layers[1].register_forward_hook(hook)
        place = (lambda t: t) if mesh is None else (lambda t: dist.shard_tensor(t, mesh, [S0]))
        loss = torch.nn.functional.mse_loss(model(place(x)), place(y))
        handle.remove()
        with pytest.raises(RuntimeError, match="the backward raised"):
            loss.backward()
    return run


def _after_a_raised_backward(model, opt, data, then, mesh=None):
    """The first step's backward raises; then either the gradients are zeroed (the step
    skipped), or the step is taken on what that backward reached, or on that and a second
    graph's backward (its forward made before the first backward); then two ordinary steps.
    Also the gradients' placements right after the next backward (before its step)."""
    place = (lambda t: t) if mesh is None else (lambda t: dist.shard_tensor(t, mesh, [S0]))
    second = None
    if then == "backward_again":
        x, y = data[0][0]
        second = torch.nn.functional.mse_loss(model(place(x * 2)), place(y))
    _raising_backward(mesh)(model, opt, *data[0][0])
    if second is not None:
        second.backward()
    if then in ("step", "backward_again"):
        opt.step()
    opt.zero_grad()
    placements = {}
    if mesh is not None:
        x, y = data[1][0]
        loss = torch.nn.functional.mse_loss(model(dist.shard_tensor(x, mesh, [S0])), dist.shard_tensor(y, mesh, [S0]))
        loss.backward()
        placements = {name: tuple(p.grad.placements) for name, p in model.named_parameters()}
        opt.zero_grad()
    return _steps(model, opt, data[1:], mesh), placements


def _raised_backward_dist(level, then):
    import warnings
    model, opt, mesh = _zero_mlp(level, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, placements = _after_a_raised_backward(model, opt, _data(4), then, mesh)
    return losses, _weights(model), placements, [str(w.message) for w in caught if "raised" in str(w.message)]


@pytest.mark.parametrize("then", ["zero_grad", "step", "backward_again"])
def test_a_backward_that_raised_leaves_the_next_steps_exact(then):
    """A backward that raises never reaches its end: the next backward still reduces its
    gradients where it ends (ZeRO-2 and 3 shard them there), and the steps match a single
    process that did the same, whether the failed step's gradients are zeroed, stepped on, or
    added to by another graph's backward before the step."""
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_losses, _ = _after_a_raised_backward(model, opt, _data(4), then)
    ref_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for level in LEVELS:
        for losses, weights, placements, warned in run_dist(_raised_backward_dist, 4, level, then):
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
            for k, v in ref_weights.items():
                torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5, msg=f"level {level}: {k}")
            if level in (2, 3):
                assert set(placements.values()) == {(S0,)}, (level, placements)
            assert (len(warned) == 1) == (level == 3), (level, warned)
