"""parallelize and its plans: name matching, plan -> placements, pipeline stages and errors
(pure), then tensor, sequence, data and pipeline parallel against the single process."""
import argparse
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.api.parallelize import match_names, match_plans, module_meshes
from autopar.placement import Replicate, Shard
from distpool import run_dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import parallelize_llama as llama  # noqa: E402  (the example's model, plan and training loop)

R, S0, S1 = Replicate(), Shard(0), Shard(1)
LLAMA = argparse.Namespace(vocab=32, hidden=32, ffn=64, heads=4, layers=2, seq=8, batch=4, steps=3, lr=3e-3, seed=0)


# -- pure: names, plans, stages, errors ----------------------------------------------------------
def test_match_names_exact_wildcard_and_regex_full_match():
    names = ["", "emb", "layers", "layers.0", "layers.0.mlp", "layers.0.mlp.up", "layers.1", "layers.1.mlp",
             "layers.10.mlp"]
    assert match_names("layers.0", names) == ["layers.0"]
    assert match_names("layers.*.mlp", names) == ["layers.0.mlp", "layers.1.mlp", "layers.10.mlp"]
    assert match_names(r"layers\.[01]\.mlp", names) == ["layers.0.mlp", "layers.1.mlp"]
    assert match_names("mlp", names) == []  # the whole name must match
    with pytest.raises(ValueError, match=r"'layers\.\[' is neither"):
        match_names("layers.[", names)


class _Raw(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 6))  # used as x @ weight


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
        self.proj = _Raw()
        self.conv = torch.nn.Conv1d(4, 4, 1)


class _Net(torch.nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(layers))
        self.head = torch.nn.Linear(4, 10)


def test_match_plans_layers_and_parameters():
    col, row, seq = dist.ColWiseParallel(), dist.RowWiseParallel(), dist.SequenceParallelEnable()
    got = match_plans(_Net(), {"layers.*.up": [col, seq], "layers.1.down.weight": row, "layers.0.proj.weight": col})
    assert got == [
        ("layers.0.up", None, col), ("layers.0.up", None, seq), ("layers.1.up", None, col), ("layers.1.up", None, seq),
        ("layers.1.down", "weight", row), ("layers.0.proj", "weight", col),
    ]


@pytest.mark.parametrize("plan, error, match", [
    ({"layers.*.nothing": dist.ColWiseParallel()}, ValueError, "matches no layer and no parameter"),
    ({"layers.0.up.weight": dist.SequenceParallelBegin()}, TypeError, "SequenceParallelBegin acts on a layer"),
    ({"emb": "col"}, TypeError, "is not a plan"),
    ([("emb", dist.ColWiseParallel())], TypeError, "must be a dict"),
])
def test_match_plans_errors(plan, error, match):
    with pytest.raises(error, match=match):
        match_plans(_Net(), plan)


def test_plans_map_to_split_dims():
    net, col, row = _Net(), dist.ColWiseParallel(), dist.RowWiseParallel()
    linear, emb, block = net.layers[0].up, net.emb, net.layers[0]
    raw = block.proj
    assert col.param_dims(linear, "up") == {"weight": 0, "bias": 0}  # torch's [out, in]: output rows
    assert row.param_dims(linear, "down") == {"weight": 1, "bias": None}  # bias added after the reduction
    assert col.param_dims(emb, "emb") == {"weight": 1} and row.param_dims(emb, "emb") == {"weight": 0}
    assert col.param_dims(torch.nn.Linear(2, 2, bias=False), "x") == {"weight": 0}
    # a raw weight used as x @ w ([in, out]); a Linear's weight named directly keeps the Linear's layout
    assert (col.param_dim(raw, "weight"), row.param_dim(raw, "weight"), row.param_dim(raw, "bias")) == (-1, 0, None)
    assert (col.param_dim(linear, "weight"), row.param_dim(linear, "weight")) == (0, 1)
    assert row.param_dim(linear, "bias") is None
    with pytest.raises(TypeError, match="ColWiseParallel on layer 'layers.0.conv': needs an nn.Linear or nn.Embedding, "
                                        "got Conv1d"):
        col.param_dims(block.conv, "layers.0.conv")


def _names(model):
    return [n for n, _ in model.named_modules()]


def _ranks(meshes):
    return {n: (m.process_ids if m is not None else None) for n, m in meshes.items()}


PP_MP = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"])


def test_stages_from_a_prefix_split_evenly_earlier_stages_take_the_extra():
    names = _names(_Net(layers=3))
    got = _ranks(module_meshes(names, PP_MP, {"split_spec": "layers"}))
    s0, s1 = [0, 1], [2, 3]
    assert got["emb"] == got["layers.0"] == got["layers.0.up"] == got["layers.1"] == s0
    assert got["layers.2"] == got["layers.2.down"] == got["head"] == s1
    assert got[""] is None and got["layers"] is None  # span both stages: no mesh, no hook
    assert module_meshes(names, PP_MP, None) == {n: PP_MP for n in names}


def test_stages_from_split_points():
    names = _names(_Net(layers=4))
    end = _ranks(module_meshes(names, PP_MP, {"split_spec": {"layers.1": dist.SplitPoint.END}}))
    begin = _ranks(module_meshes(names, PP_MP, {"split_spec": {"layers.2": dist.SplitPoint.BEGINNING}}))
    assert end == begin
    assert [end[f"layers.{i}"] for i in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # stage slices follow the mesh: "pp" as the last dim takes columns
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["mp", "pp"])
    got = module_meshes(names, mesh, {"split_spec": "layers"})
    assert got["emb"] == dist.ProcessMesh([0, 2], dim_names=["mp"]) and got["head"].process_ids == [1, 3]


def test_global_spec_layer_lives_on_every_stage():
    names = _names(_Net(layers=2))
    got = module_meshes(names, PP_MP, {"split_spec": "layers", "global_spec": "emb"})
    assert got["emb"] == PP_MP and got["layers.0"].process_ids == [0, 1] and got["head"].process_ids == [2, 3]


@pytest.mark.parametrize("pp_config, match", [
    ({"split_spec": "blocks"}, "'blocks' names no layer"),
    ({"split_spec": "emb"}, "has 0 layers, too few for 2"),
    ({"split_spec": {"layers.0": dist.SplitPoint.END, "layers.1": dist.SplitPoint.END}}, "into 3 stages"),
    ({"split_spec": {"head": dist.SplitPoint.END}}, "the model's last layer"),
    ({"split_spec": {"": dist.SplitPoint.BEGINNING}}, "leaves stage 0 empty"),
    ({"split_spec": {"layers.9": dist.SplitPoint.END}}, "matches no layer"),
    ({"split_spec": {"layers.0": "end"}}, "must be SplitPoint.END or SplitPoint.BEGINNING"),
    ({"split_spec": "layers", "global_spec": "pos"}, "global_spec 'pos' matches no layer"),
    ({"global_spec": "emb"}, "with a 'split_spec'"),
])
def test_stage_errors(pp_config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        module_meshes(_names(_Net(layers=2)), PP_MP, pp_config)


def test_without_mesh_or_config_nothing_changes():
    model, opt = _Net(), None
    assert dist.parallelize(model, opt, mesh=None, config={"mp_config": {"parallelize_plan": {}}}) == (model, opt)
    assert dist.parallelize(model, opt, mesh=PP_MP, config={}) == (model, opt)
    assert isinstance(model.head.weight, torch.nn.Parameter) and not dist.is_dist_tensor(model.head.weight)


DP = dist.ProcessMesh([0, 1], dim_names=["dp"])
NO_DP = (r"dp_config needs a mesh dim named 'dp', "
         r"but mesh ProcessMesh\(\[\[0, 1\], \[2, 3\]\], dim_names=\['pp', 'mp'\]\)")


@pytest.mark.parametrize("mesh, config, match", [
    (PP_MP, {"dp_config": {}}, NO_DP),
    (DP, {"dp_config": {"sharding_level": 4}}, "dp_config must be a dict like"),
    (DP, {"dp_config": {"input_source": "rank1"}},
     r"dp_config input_source must be one of \['rank0', 'replicated', 'local'\], got 'rank1'"),
    (PP_MP, {"sp_config": {}}, r"unknown keys \['sp_config'\]"),
    (DP, {"dp_config": {"sharding_levle": 3}},
     r"dp_config: unknown keys \['sharding_levle'\] \(known: \['sharding_level', 'input_source', 'mp_policy'\]\); "
     r"did you mean 'sharding_level' for 'sharding_levle'\?"),
    (PP_MP, {"mp_config": {"parallelize_plan": {}, "sequence_parallel": True}},
     r"mp_config: unknown keys \['sequence_parallel'\] \(known: \['parallelize_plan'\]\)$"),
    (PP_MP, {"mp_config": {"plan": {}}}, "with a 'parallelize_plan'"),
    (PP_MP, {"mp_config": {"parallelize_plan": {}}, "pp_config": {"split_spec": "layers"}}, "state for"),
])
def test_config_errors_before_anything_changes(mesh, config, match):
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.head.weight.grad = torch.ones_like(model.head.weight)
    opt.step()  # now the optimizer has state
    with pytest.raises(ValueError, match=match):
        dist.parallelize(model, opt, mesh, config)
    assert not any(dist.is_dist_tensor(p) for p in model.parameters())


def _tied():
    net = _Net()
    net.head.weight = net.emb.weight  # [10, 4] both: tied across the two stages
    return net


def _root_param():
    net = _Net()
    net.scale = torch.nn.Parameter(torch.ones(4))  # the root spans both stages
    return net


def _mp(plan):
    return {"mp_config": {"parallelize_plan": plan}}


PP = {"pp_config": {"split_spec": "layers"}}


@pytest.mark.parametrize("model, config, match", [
    (_Net, _mp({"layers.0.conv": dist.ColWiseParallel()}),
     "ColWiseParallel on layer 'layers.0.conv': needs an nn.Linear or nn.Embedding, got Conv1d"),
    (_Net, _mp({"layers.0.up": dist.ColWiseParallel(), "layers.0.up.weight": dist.RowWiseParallel()}),
     "parameter 'layers.0.up.weight' of shape \\[8, 4\\]: RowWiseParallel on 'layers.0.up' places it "
     "Shard\\(1\\) over mp, ColWiseParallel on 'layers.0.up' Shard\\(0\\)"),
    (_tied, PP, r"parameter shared by \['emb.weight', 'head.weight'\] would live on several pipeline stages "
                r"\[\[0, 1\], \[2, 3\]\]"),
    (_root_param, PP, "parameter 'scale' belongs to a layer that spans several pipeline stages"),
    (_Net, {**PP, **_mp({"layers": dist.SequenceParallelEnable()})},
     "SequenceParallelEnable on 'layers': the layer spans several pipeline stages"),
])
def test_placement_errors_name_the_layer_and_parameter(model, config, match):
    model = model()
    with pytest.raises((TypeError, ValueError), match=match):
        dist.parallelize(model, None, PP_MP, config)  # raised before any parameter changes (no processes needed)
    assert not any(dist.is_dist_tensor(p) for p in model.parameters())


# -- multi-process: numbers against the single process ---------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 8))


def _batches(x_shape, y_shape, seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(x_shape, generator=g), torch.randn(y_shape, generator=g)) for _ in range(n)]


def _train(model, opt, batches, loss_of=lambda model, x, y: F.mse_loss(model(x), y)):
    """The single-process loop, run unchanged on the parallelized model: mse loss, AdamW."""
    losses = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mlp_reference():
    model = _mlp()
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=0.01), _batches((8, 16), (8, 8)))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _local_bytes(tensors):
    return sum(t._local.numel() * t._local.element_size() if dist.is_dist_tensor(t) else t.numel() * t.element_size()
               for t in tensors)


def _parallel_mlp(mesh_ids, dim_names, config):
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dim_names)
    model = _mlp()
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=0.01), mesh, config)
    losses = _train(model, opt, _batches((8, 16), (8, 8)))
    local = {k: (v._local.detach().clone(), v.process_mesh.process_ids, v.placements)
             for k, v in model.named_parameters()}
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.named_parameters()}
    return losses, params, local, _local_bytes(model.parameters())


def _check_against(reference, results):
    """Every rank's losses and unsharded parameters match the single process (rtol 1e-5)."""
    ref_losses, ref_params = reference()
    for losses, params, *_ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    return ref_params


def _check_mlp(results):
    return _check_against(_mlp_reference, results)


def test_column_row_mlp_on_dp_x_mp_each_rank_holds_its_slice():
    plan = {"0": dist.ColWiseParallel(), "2": dist.RowWiseParallel(),
            "4.weight": dist.ColWiseParallel(gather_output=True)}  # also hooks layer 4: its output gathered
    config = {"dp_config": {"sharding_level": 0}, **_mp(plan)}
    results = run_dist(_parallel_mlp, 4, [[0, 1], [2, 3]], ["dp", "mp"], config)
    ref = _check_mlp(results)
    everyone = [0, 1, 2, 3]
    for rank, (_, _, local, _) in enumerate(results):
        mp = rank % 2  # this rank's column of the mesh
        expected = {  # [out, in] weights: column-parallel holds output rows, row-parallel input columns
            "0.weight": (ref["0.weight"][16 * mp:16 * (mp + 1)], [R, S0]),
            "0.bias": (ref["0.bias"][16 * mp:16 * (mp + 1)], [R, S0]),
            "2.weight": (ref["2.weight"][:, 16 * mp:16 * (mp + 1)], [R, S1]),
            "2.bias": (ref["2.bias"], [R, R]),  # added once, after the reduction
            "4.weight": (ref["4.weight"][4 * mp:4 * (mp + 1)], [R, S0]),
            "4.bias": (ref["4.bias"], [R, R]),  # not named by the plan
        }
        for k, (value, placements) in expected.items():
            piece, ranks, got_placements = local[k]
            assert (ranks, got_placements) == (everyone, placements), k
            torch.testing.assert_close(piece, value, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {k}: {m}")


def test_zero3_over_dp_shards_parameters_too():
    config = {"dp_config": {"sharding_level": 3}, "mp_config": {"parallelize_plan": {"0": dist.ColWiseParallel()}}}
    results = run_dist(_parallel_mlp, 4, [[0, 1], [2, 3]], ["dp", "mp"], config)
    _check_mlp(results)
    for _, _, local, param_bytes in results:
        assert local["0.weight"][2] == [S1, S0]  # ZeRO-3 splits the free dim over dp
        assert local["0.bias"][2] == [R, S0]  # its only dim is split over mp already
        # of 3520 bytes: 0.weight split over mp and dp, 0.bias over mp, the other 336 floats over dp
        assert param_bytes == 4 * (512 // 4 + 32 // 2 + 336 // 2) == 1248, param_bytes


def test_pipeline_dict_split_on_dp_x_pp_each_rank_holds_its_stage():
    config = {"dp_config": {"sharding_level": 1}, "pp_config": {"split_spec": {"2": dist.SplitPoint.BEGINNING}}}
    results = run_dist(_parallel_mlp, 4, [[0, 1], [2, 3]], ["dp", "pp"], config)
    _check_mlp(results)
    for rank, (_, _, local, _) in enumerate(results):
        stage0, stage1 = [0, 2], [1, 3]
        assert local["0.weight"][1:] == (stage0, [R]) and local["2.weight"][1:] == (stage1, [R])
        assert local["4.weight"][1] == stage1
        mine = stage0 if rank in stage0 else stage1
        for k, (piece, ranks, _) in local.items():
            assert (piece.numel() > 0) == (ranks == mine), (rank, k, piece.shape)  # nothing of the other stage


def _llama_reference(args=LLAMA):
    model, losses = llama.train(args)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _parallel_llama(mesh_ids, dim_names, drop=(), sharding_level=1, mlp_transpose=True, args=LLAMA):
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dim_names)
    config = {k: v for k, v in llama.parallel_config(sharding_level).items() if k not in drop}
    plan = config["mp_config"]["parallelize_plan"]
    plan["llama.layers.*.mlp"] = dist.SequenceParallelDisable(need_transpose=mlp_transpose)
    model, losses = llama.train(args, mesh, config)
    x = next(llama.batches(args))[0]
    with dist.comm_log() as log:
        model(x)
    forward_ops = [r.op for r in log]
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.named_parameters()}
    local = {k: (tuple(v._local.shape), v.process_mesh.process_ids) for k, v in model.named_parameters()}
    return losses, params, forward_ops, local


def _check_llama(results):
    _check_against(_llama_reference, results)


def test_tensor_and_sequence_parallel_llama_on_dp_x_mp():
    results = run_dist(_parallel_llama, 4, [[0, 1], [2, 3]], ["dp", "mp"], ("pp_config",), 1)
    _check_llama(results)
    for _, _, ops, local in results:
        # each sequence-parallel-disabled layer (attention, MLP) gathers its input and
        # reduce-scatters its Partial output: 2 of each per decoder layer, no all-reduce of it
        assert ops.count("reduce_scatter") == 2 * LLAMA.layers, ops
        assert ops.count("all_gather") >= 2 * LLAMA.layers + 1, ops
        assert local["llama.layers.0.self_attn.qkv_proj.weight"][0] == (3 * LLAMA.hidden // 2, LLAMA.hidden)
        assert local["llama.layers.0.mlp.down_proj.weight"][0] == (LLAMA.hidden, LLAMA.ffn // 2)
        assert local["lm_head.weight"][0] == (LLAMA.hidden, LLAMA.vocab // 2)


def test_pipeline_tensor_and_sequence_parallel_llama_on_pp_x_mp():
    # the MLP plan of Paddle's parallelize docs: need_transpose=False, the MLP runs on [s, b, h]
    results = run_dist(_parallel_llama, 4, [[0, 1], [2, 3]], ["pp", "mp"], ("dp_config",), 1, False)
    _check_llama(results)
    for rank, (_, _, ops, local) in enumerate(results):
        assert ops.count("send") + ops.count("recv") >= 1  # the activation crosses from stage 0 to stage 1
        # one decoder layer per stage, sequence parallel without a dp dim to read the layout from
        assert ops.count("reduce_scatter") == 2, ops
        assert local["llama.layers.0.mlp.gate_up_proj.weight"][1] == [0, 1]
        assert local["llama.layers.1.mlp.gate_up_proj.weight"][1] == [2, 3]
        assert local["lm_head.weight"][1] == [2, 3]


class _AddPos(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, pos):
        return x + torch.tanh(self.fc(x + pos))


class _GlobalPos(torch.nn.Module):
    """Residual layers that all read one position embedding, computed once for every stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = torch.nn.Embedding(6, 8)
        self.layers = torch.nn.ModuleList(_AddPos() for _ in range(3))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        pos = self.pos(torch.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x, pos=pos)
        return self.head(x)


def _parallel_global():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "pp"])
    model = _GlobalPos()
    config = {"dp_config": {"sharding_level": 2}, "pp_config": {"split_spec": "layers", "global_spec": "pos"}}
    model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=0.01), mesh, config)
    losses = _train(model, opt, _batches((4, 6, 8), (4, 6, 4), seed=2))
    meshes = {k: v.process_mesh.process_ids for k, v in model.named_parameters()}
    return losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.named_parameters()}, meshes


def test_pipeline_global_layer_feeds_every_stage():
    model = _GlobalPos()
    ref_losses = _train(model, torch.optim.AdamW(model.parameters(), lr=0.01), _batches((4, 6, 8), (4, 6, 4), seed=2))
    for losses, params, meshes in run_dist(_parallel_global, 4):
        assert meshes["pos.weight"] == [0, 1, 2, 3]  # on every stage
        assert meshes["layers.0.fc.weight"] == meshes["layers.1.fc.weight"] == [0, 2]
        assert meshes["layers.2.fc.weight"] == meshes["head.weight"] == [1, 3]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


class _LossInside(torch.nn.Module):
    """A model that takes the labels and returns the loss (as many LLM codebases do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def _loss_inside(parallel, static=False):
    model = _LossInside()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if parallel:
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
        config = {"pp_config": {"split_spec": "layers"}, "dp_config": {"sharding_level": 0}}
        model, opt = dist.parallelize(model, opt, mesh, config)
    if static:  # the model returns the loss: the DistModel's loss is the identity
        step = dist.to_static(model, None, lambda loss: loss, opt)
        return [float(step(x, y)) for x, y in _batches((8, 16), (8, 16))]
    return _train(model, opt, _batches((8, 16), (8, 16)), lambda model, x, y: model(x, y))


@pytest.mark.parametrize("static", [False, True])
def test_pipeline_labels_given_to_the_model_follow_it_to_the_last_stage(static):
    """The labels enter on the first stage with the inputs; the loss on the last stage takes
    them there (they need no gradient, so the op's mesh receives them)."""
    ref = _loss_inside(False)
    for losses in run_dist(_loss_inside, 4, True, static):
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
