"""shard_layer, shard_dataloader, shard_optimizer and ZeRO 1/2/3 against the single process."""
import gc
import json

import numpy as np
import pytest
import torch

import autopar as dist
from autopar.placement import Replicate, Shard
from autopar.tensor import observers
from distpool import run_dist
from plain_process import last_line, run_plain

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)) for _ in range(n)]


def _train(model, opt, mesh=None, clip=None):
    losses = []
    for x, y in _batches():
        if mesh is not None:
            x = dist.shard_tensor(x, mesh, [S0] + [R] * (mesh.ndim - 1))
            y = dist.shard_tensor(y, mesh, [S0] + [R] * (mesh.ndim - 1))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            clip(model, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(opt_cls=torch.optim.AdamW, clip=None):
    model = _mlp()
    opt = opt_cls(model.parameters(), lr=0.01)
    losses = _train(model, opt, clip=clip)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _local_bytes(tensors):
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t._local if dist.is_dist_tensor(t) else t
        total += t.numel() * t.element_size()
    return total


def _zero(stage):
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    model = dist.shard_layer(_mlp(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    shard_fn = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[stage]("dp")
    opt = dist.shard_optimizer(opt, shard_fn)
    losses = []
    grad_bytes = []
    for x, y in _batches():
        x = dist.shard_tensor(x, mesh, [S0])
        y = dist.shard_tensor(y, mesh, [S0])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_bytes.append(
            _local_bytes([p.grad for p in model.parameters()])
            + _local_bytes([p.grad for g in opt.param_groups for p in g["params"] if p not in set(model.parameters())])
        )
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state_bytes = _local_bytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, params, _local_bytes(model.parameters()), max(grad_bytes), state_bytes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_single_process_and_shards_memory(stage):
    ref_losses, ref_params = _reference()
    full = sum(v.numel() * 4 for v in ref_params.values())
    for losses, params, param_bytes, grad_bytes, state_bytes in run_dist(_zero, 4, stage):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5)
        # optimizer states: exp_avg + exp_avg_sq, ~1/4 of 2x the parameters (uneven rows round up)
        assert state_bytes <= 2 * full / 4 * 1.2, (state_bytes, full)
        if stage >= 2:
            assert grad_bytes <= full / 4 * 1.2, (grad_bytes, full)
        else:
            assert grad_bytes >= full  # stage 1: the first step's gradients (op by op) stay whole until the step
        if stage == 3:
            assert param_bytes <= full / 4 * 1.2, (param_bytes, full)
        else:
            assert param_bytes == full


def _dp_plain_params(opt_name):
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    model = _mlp()
    opt_cls = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[opt_name]
    opt = dist.shard_optimizer(opt_cls(model.parameters()))
    losses = _train(model, opt, mesh)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, [type(p.grad) for p in model.parameters()]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_data_parallel_with_plain_parameters(opt_name):
    ref_cls = {"sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), "adam": lambda p, lr: torch.optim.Adam(p, lr=lr)}[opt_name]
    ref_losses, ref_params = _reference(ref_cls)
    for losses, params, _ in run_dist(_dp_plain_params, 4, opt_name):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5)


def _clip(model, opt):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def _tp_clip():
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])

    def shard_fn(name, sub, mesh):
        if name == "0":
            sub.weight = dist.shard_tensor(sub.weight, mesh, [S0])
            sub.bias = dist.shard_tensor(sub.bias, mesh, [S0])
        if name == "2":
            sub.weight = dist.shard_tensor(sub.weight, mesh, [S1])

    model = dist.shard_layer(_mlp(), mesh, shard_fn)
    placements = {k: v.placements for k, v in model.named_parameters()}
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    norms = []
    losses = _train(model, opt, None, clip=lambda m, o: norms.append(float(_clip(m, o))))
    state = opt.state_dict()["state"][0]
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, placements, norms, state["exp_avg"].placements


def test_tensor_parallel_with_global_grad_norm_clipping():
    ref_norms = []
    ref_losses, ref_params = _reference(clip=lambda m, o: ref_norms.append(float(_clip(m, o))))
    for losses, params, placements, norms, exp_avg_pl in run_dist(_tp_clip, 2):
        assert placements == {"0.weight": [S0], "0.bias": [S0], "2.weight": [S1], "2.bias": [R]}
        assert exp_avg_pl == [S0]  # states follow their parameter
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5)


def _col_row_norm_col():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                               torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))


def _dp_tp_one_reduction_per_bucket():
    """dp x mp: column, row, layer norm, column.  Backward and the step reduce all parameter
    gradients in one collective per group of mesh dims: over dp for the weights, over dp and mp at once for
    the layer norm's, which the last column layer's backward leaves Partial on mp too."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

    def shard_fn(name, sub, mesh):
        if name in ("0", "4"):
            sub.weight = dist.shard_tensor(sub.weight, mesh, [R, S0])
            sub.bias = dist.shard_tensor(sub.bias, mesh, [R, S0])
        if name == "2":
            sub.weight = dist.shard_tensor(sub.weight, mesh, [R, S1])

    model = dist.shard_layer(_col_row_norm_col(), mesh, shard_fn)
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    steps, losses = [], []
    for x, y in _batches():
        x, y = dist.shard_tensor(x, mesh, [S0, R]), dist.shard_tensor(y, mesh, [S0, R])
        loss = torch.nn.functional.mse_loss(model(x), y)
        with dist.comm_log() as log:  # (a bucket whose gradients have landed is reduced in backward)
            loss.backward()
            opt.step()
        steps.append(sorted((r.op, r.ranks) for r in log))
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, steps


def test_data_and_tensor_parallel_step_reduces_in_one_collective_per_bucket():
    model = _col_row_norm_col()
    ref_losses = _train(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    ref_params = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, (losses, params, steps) in enumerate(run_dist(_dp_tp_one_reduction_per_bucket, 4)):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5)
        dp_group, mp_group = (rank % 2, rank % 2 + 2), (rank // 2 * 2, rank // 2 * 2 + 1)
        for ops in steps:  # (and the row layer's input gradient, summed over mp)
            assert ops == sorted([("all_reduce", dp_group), ("all_reduce", (0, 1, 2, 3)), ("all_reduce", mp_group)]), ops


def _optimizer_step_dispatches(opt_name):
    """Counts the distributed ops an elementwise optimizer's step sends through the dispatch."""
    import autopar.tensor.dispatch as D

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = dist.shard_layer(_mlp(), mesh, lambda name, sub, mesh: setattr(
        sub, "weight", dist.shard_tensor(sub.weight, mesh, [R, S0])) if name == "0" else None)
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01), "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)}
    opt = dist.shard_optimizer(make[opt_name](model.parameters()))
    foreach = []  # the group's foreach during the local step, then after it
    opt.register_step_pre_hook(lambda o, a, k: foreach.append(o.param_groups[0]["foreach"]))
    opt.register_step_post_hook(lambda o, a, k: foreach.append(o.param_groups[0]["foreach"]))
    calls, orig = [0], D.dispatch

    def counting(func, args, kwargs):
        calls[0] += 1
        return orig(func, args, kwargs)

    per_step = []
    for x, y in _batches():
        x, y = dist.shard_tensor(x, mesh, [S0, R]), dist.shard_tensor(y, mesh, [S0, R])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt._autopar_sharding.prepare_grads()  # the gradient reductions (collectives) aside
        D.dispatch, calls[0] = counting, 0
        try:
            opt.step()
        finally:
            D.dispatch = orig
        per_step.append(calls[0])
        opt.zero_grad()
    states = [type(v).__name__ for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    return per_step, states, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, foreach


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_elementwise_optimizers_step_local_pieces_without_dispatch(opt_name):
    model = _mlp()
    cls = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01), "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)}
    opt = cls[opt_name](model.parameters())
    _train(model, opt)
    for per_step, states, params, foreach in run_dist(_optimizer_step_dispatches, 4, opt_name):
        assert per_step == [0] * len(per_step), per_step  # plain tensors all the way
        # the local step keeps the user's foreach (None: torch's choice for the local tensors,
        # as on one device); foreach is forced only for steps through the dispatch
        assert foreach == [None, True] * len(per_step), foreach
        assert states and set(states) == {"DistTensor"}  # states stay distributed, placed like params
        for k, v in model.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5)


def _local_step_on_a_mesh_dim_of_size_one():
    """A gradient placed Replicate where its parameter says Shard, on a mesh dim of size 1:
    the same local pieces, so the step still runs on them."""
    import autopar.tensor.dispatch as D

    mesh = dist.ProcessMesh([[0, 1]], dim_names=["dp", "mp"])
    torch.manual_seed(0)
    w = dist.shard_tensor(torch.nn.Parameter(torch.randn(4, 6)), mesh, [S0, S1])
    w.grad = dist.shard_tensor(torch.arange(24.0).reshape(4, 6), mesh, [R, S1])
    opt = dist.shard_optimizer(torch.optim.AdamW([w], lr=0.1))
    calls, orig = [0], D.dispatch

    def counting(func, args, kwargs):
        calls[0] += 1
        return orig(func, args, kwargs)

    D.dispatch = counting
    try:
        opt.step()
    finally:
        D.dispatch = orig
    return calls[0], dist.unshard_dtensor(w.detach())


def test_the_local_step_ignores_placements_on_mesh_dims_of_size_one():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 6))
    w.grad = torch.arange(24.0).reshape(4, 6)
    torch.optim.AdamW([w], lr=0.1).step()
    for calls, got in run_dist(_local_step_on_a_mesh_dim_of_size_one, 2):
        assert calls == 0
        torch.testing.assert_close(got, w.detach(), rtol=1e-5, atol=1e-6)


def _steps_with_a_replaced_state(mesh_size):
    """Three AdamW steps; between the second and the third the user replaces a state (the
    local step keeps its stand-ins from step to step only while the states stay the same)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 6))
    mesh = dist.ProcessMesh(list(range(mesh_size)), dim_names=["x"]) if mesh_size else None
    if mesh is not None:
        w = dist.shard_tensor(w, mesh, [S0])
    opt = torch.optim.AdamW([w], lr=0.1)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    for step in range(3):
        if step == 2:
            replaced = torch.full((4, 6), 0.5)
            opt.state[w]["exp_avg"] = dist.shard_tensor(replaced, mesh, [S0]) if mesh is not None else replaced
        g = torch.arange(24.0).reshape(4, 6) * (step + 1)
        w.grad = dist.shard_tensor(g, mesh, [S0]) if mesh is not None else g
        opt.step()
    return dist.unshard_dtensor(w.detach()) if mesh is not None else w.detach()


def test_the_local_step_sees_a_state_replaced_between_steps():
    ref = _steps_with_a_replaced_state(0)
    for got in run_dist(_steps_with_a_replaced_state, 2, 2):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _first_step(model, opt):
    torch.nn.functional.mse_loss(model(torch.randn(4, 16, generator=torch.Generator().manual_seed(7))),
                                 torch.zeros(4, 8)).backward()
    opt.step()
    opt.zero_grad()


def _optimizer_built_before_shard_layer(stepped):
    """The usual torch order (model, optimizer, then the parallel wrapper): shard_layer
    converts the Parameters in place, so the optimizer steps them; states it made before
    (a step on one device) are cut to the parameters' placements."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if stepped:
        _first_step(model, opt)
    model = dist.shard_layer(model, mesh)
    opt = dist.shard_optimizer(opt)
    for x, y in _batches():
        x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stepped", [False, True])
def test_an_optimizer_built_before_shard_layer_steps_the_converted_parameters(stepped):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if stepped:
        _first_step(model, opt)
    _train(model, opt)
    for params in run_dist(_optimizer_built_before_shard_layer, 2, stepped):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5)


_TORCH_GLOBALS = """
import json, torch
from torch.optim.optimizer import _global_optimizer_pre_hooks as pre_hooks
from torch.utils._foreach_utils import _foreach_supported_types as foreach_types
def seen():
    return [[h.__name__ for h in pre_hooks.values()], any(t.__module__.startswith("autopar") for t in foreach_types)]
import autopar as dist
imported = seen()
mesh = dist.ProcessMesh([0], dim_names=["dp"])
model = dist.shard_layer(torch.nn.Linear(4, 2), mesh)
opt = torch.optim.AdamW(model.parameters())
dist.shard_layer(torch.nn.Linear(2, 2), mesh)
print(json.dumps([imported, seen()]))
"""


def test_importing_autopar_leaves_torch_globals_alone():
    """`import autopar` changes nothing of torch's; the step pre-hook that places a plain torch
    optimizer's states and DistTensor's place among torch's foreach types come, once, with
    the first distributed tensor."""
    imported, in_use = json.loads(last_line(run_plain(_TORCH_GLOBALS)))
    assert imported == [[], False]
    assert in_use == [["_place_states_of_plain_optimizers"], True]


def _reducers_after_the_optimizer_goes():
    mesh = dist.ProcessMesh([0], dim_names=["dp"])
    gc.collect()  # earlier tasks' garbage in this rank goes first, not in the count below
    before = len(observers._REDUCERS)
    opt = dist.shard_optimizer(torch.optim.AdamW(dist.shard_layer(_mlp(), mesh).parameters()))
    registered = len(observers._REDUCERS) - before
    del opt
    gc.collect()
    return registered, len(observers._REDUCERS) - before


def test_a_collected_sharded_optimizer_leaves_no_pending_gradient_reducer():
    assert run_dist(_reducers_after_the_optimizer_goes, 1) == [(1, 0)]


def _shard_layer_hooks():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    seen = []
    model = dist.shard_layer(
        torch.nn.Linear(4, 4),
        mesh,
        input_fn=lambda inputs, mesh: (dist.shard_tensor(inputs[0], mesh, [S0]),),
        output_fn=lambda out, mesh: seen.append(out.placements) or dist.reshard(out, mesh, [R]),
    )
    out = model(torch.ones(6, 4))
    return [p.placements for p in model.parameters()], seen, out.placements


def test_shard_layer_replicates_by_default_and_hooks_io():
    for params, seen, out in run_dist(_shard_layer_hooks, 2):
        assert params == [[R], [R]] and seen == [[S0]] and out == [R]


class _CountingDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.reads = []

    def __len__(self):
        return 10

    def __getitem__(self, i):
        self.reads.append(i)
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i)}


def _dataloader():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    ds = _CountingDataset()
    loader = torch.utils.data.DataLoader(ds, batch_size=5)
    sharded = dist.shard_dataloader(loader, mesh, input_keys=["x", "y"], shard_dims="dp")
    out = []
    for batch in sharded():
        out.append((batch["x"].placements, tuple(batch["x"].shape), dist.unshard_dtensor(batch["y"]).tolist(),
                    batch["x"].local_value()[:, 0].tolist()))
    return out, sorted(ds.reads), len(sharded)


def test_shard_dataloader_reads_only_its_samples_and_splits_unevenly():
    res = run_dist(_dataloader, 4)
    for rank, (batches, reads, n) in enumerate(res):
        assert n == 2
        assert [b[0] for b in batches] == [[S0, R], [S0, R]]
        assert [b[1] for b in batches] == [(5, 3), (5, 3)]
        assert [b[2] for b in batches] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        dp = rank // 2  # 5 rows on 2 dp ranks: 3 + 2
        mine = [[0, 1, 2], [5, 6, 7]] if dp == 0 else [[3, 4], [8, 9]]
        assert [b[3] for b in batches] == [[float(v) for v in m] for m in mine]
        assert reads == sorted(mine[0] + mine[1])  # this rank fetched only its own samples


class _PerRankStream(torch.utils.data.IterableDataset):
    """An iterable dataset yielding other samples on each rank (a stream read per process)."""

    def __iter__(self):
        return iter([torch.tensor(float(i + 100 * dist.get_rank())) for i in range(8)])


def _iterable_loader():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    loader = torch.utils.data.DataLoader(_PerRankStream(), batch_size=4)
    return [(b.placements, dist.unshard_dtensor(b).tolist(), b.local_value().tolist())
            for b in dist.shard_dataloader(loader, mesh, shard_dims="dp")]


def test_shard_dataloader_reads_an_iterable_dataset_whole_and_cuts_rank0s_batch():
    """An iterable dataset has no samples to fetch by index (its __getitem__ is Dataset's,
    which raises): the loader is read whole on every rank and rank 0's batch is the one cut."""
    for rank, got in enumerate(run_dist(_iterable_loader, 2)):
        whole = [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
        assert got == [([S0], w, w[2 * rank:2 * rank + 2]) for w in whole], got


def _dataloader_pipeline():
    mesh0, mesh1 = dist.ProcessMesh([0, 1], dim_names=["x"]), dist.ProcessMesh([2, 3], dim_names=["x"])
    data = [(torch.full((2,), float(i)), torch.tensor(float(i))) for i in range(4)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    (x, y), = list(dist.shard_dataloader(loader, [mesh0, mesh1], shard_dims="x"))
    return x.process_mesh.process_ids, y.process_mesh.process_ids, x.placements


def test_shard_dataloader_pipeline_inputs_first_mesh_labels_last():
    for xm, ym, pl in run_dist(_dataloader_pipeline, 4):
        assert xm == [0, 1] and ym == [2, 3] and pl == [S0]


def _parameters_left_after_a_trained_model_goes(stage):
    """A model trained for one step (forward, backward, optimizer step) under data parallel
    (stage 0) or ZeRO-1/2, then dropped with its optimizer: how many of its parameters live on."""
    import weakref

    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = dist.shard_layer(_mlp(), mesh)
    stages = {0: None, 1: dist.ShardingStage1("dp"), 2: dist.ShardingStage2("dp")}
    opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters()), stages[stage])
    x = dist.shard_tensor(torch.randn(4, 16), mesh, [Shard(0)])
    model(x).sum().backward()
    opt.step()
    refs = [weakref.ref(p) for p in model.parameters()]
    del model, opt, x
    gc.collect()
    return len(refs), sum(r() is not None for r in refs)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_trained_model_dropped_frees_its_parameters(stage):
    """Nothing of autopar's keeps a dropped model's parameters (nor their gradients and
    states) alive after it ran backward: the gradient hook on a distributed Parameter holds its
    attributes, not the Parameter (a cycle through autograd's C++ hooks is not collectable)."""
    for total, alive in run_dist(_parameters_left_after_a_trained_model_goes, 2, stage):
        assert total > 0 and alive == 0, (total, alive)
