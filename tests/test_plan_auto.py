"""parallelize(config="auto"): the planner's layout runs and trains a HF Llama to the
numbers of one process."""
import pytest
import torch

import autopar as dist
from distpool import run_dist
from example_scripts import example
import hf_llama


def _auto(mesh_ids, dim_names, with_grads=True):
    """Train under config="auto"; with_grads also gathers each step's gradients (every rank
    must hold a gradient of every parameter for that: not with pipeline stages)."""
    model = hf_llama.tiny_llama()
    opt = hf_llama.optimizer(model.parameters())
    model, opt = dist.parallelize(model, opt, dist.ProcessMesh(mesh_ids, dim_names=dim_names), config="auto")
    grads = [] if with_grads else None
    losses = hf_llama.train(model, opt, hf_llama.batches(), grads=grads)
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    placed = {k: (v.process_mesh.dim_names, v.process_mesh.process_ids, [str(p) for p in v.placements])
              for k, v in model.named_parameters()}
    plan = model._autopar_plan
    return (losses, weights, grads or []), plan.degrees, (plan.config, plan.estimate.layout.shape.sequence_parallel), placed


@pytest.mark.parametrize("mesh_ids, dim_names", [([0, 1], ["x"]), ([[0, 1]], ["pp", "dp"])])
def test_auto_on_two_ranks_matches_one_process(mesh_ids, dim_names):
    grads = []
    ref = hf_llama.reference(hf_llama.batches(), grads=grads)
    results = run_dist(_auto, 2, mesh_ids, dim_names)
    for got, degrees, _, placed in results:
        hf_llama.assert_matches(got, (*ref, grads))
        assert degrees["dp"] * degrees["mp"] * degrees["pp"] == 2
        if dim_names == ["pp", "dp"]:  # a mesh naming its dims keeps their sizes
            assert degrees == {"dp": 2, "mp": 1, "pp": 1}
        w = placed["model.layers.0.mlp.down_proj.weight"]
        assert w[0] == (["pp", "dp", "mp"] if dim_names == ["x"] else dim_names)
        if degrees["mp"] == 2:
            assert "Shard(1)" in w[2]
    assert all(r[1] == results[0][1] for r in results)  # every rank planned the same


@pytest.mark.parametrize("dim_names", [["dp", "mp"], ["pp", "dp"], ["pp", "mp"]])
def test_auto_on_four_ranks_keeps_the_named_mesh(dim_names):
    """The planner's config for tensor parallel (Megatron's plan on HF names) and for pipeline
    stages (split points where the plan cuts, 1F1B) trains as one process does."""
    ref = hf_llama.reference(hf_llama.batches())
    pipeline = "pp" in dim_names
    for got, degrees, (config, sequence_parallel), placed in run_dist(_auto, 4, [[0, 1], [2, 3]], dim_names,
                                                                      not pipeline):
        hf_llama.assert_matches(got, (*ref, []))
        assert degrees == {dim: 2 if dim in dim_names else 1 for dim in ("dp", "mp", "pp")}
        assert ("pp_config" in config) == pipeline and ("mp_config" in config) == ("mp" in dim_names)
        if "mp" in dim_names:  # sequence parallel is in the plan exactly when the layout says so
            plan = config["mp_config"]["parallelize_plan"]
            assert ("model.layers.*.mlp" in plan) == sequence_parallel
        if pipeline:
            assert placed["model.layers.0.mlp.down_proj.weight"][1] == [0, 1]  # one layer per stage
            assert placed["model.layers.1.mlp.down_proj.weight"][1] == [2, 3]


def test_auto_refuses_other_strings_and_no_mesh():
    with pytest.raises(ValueError, match="'fast'"):
        dist.parallelize(torch.nn.Linear(2, 2), None, dist.ProcessMesh([0], dim_names=["x"]), config="fast")
    saved = dist.get_mesh()
    dist.set_mesh(None)
    try:
        with pytest.raises(ValueError, match="needs a mesh"):
            dist.parallelize(torch.nn.Linear(2, 2), None, None, config="auto")
    finally:
        dist.set_mesh(saved)


def _gpt(mesh_names=None):
    """The examples' GPT trained 3 steps; with mesh dim names, under config="auto" on 2 ranks."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = example("train_gpt").GPT(vocab=64, d=32, heads=4, layers=2, seq=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mesh_names:
        model, opt = dist.parallelize(model, opt, dist.ProcessMesh([0, 1], dim_names=mesh_names), config="auto")
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 9), generator=g)
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 64), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = dist.unshard_dtensor if mesh_names else (lambda t: t)
    degrees = model._autopar_plan.degrees if mesh_names else None
    return losses, {k: full(v.detach()) for k, v in model.named_parameters()}, degrees


@pytest.mark.parametrize("mesh_names", [["x"], ["mp"]])
def test_auto_on_the_examples_gpt(mesh_names):
    ref_losses, ref_weights, _ = _gpt()
    for losses, weights, degrees in run_dist(_gpt, 2, mesh_names):
        if mesh_names == ["mp"]:
            assert degrees == {"dp": 1, "mp": 2, "pp": 1}
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_describe_reads_the_examples_models_and_hf_llama():
    from autopar.planner import describe

    gpt, names = describe(example("train_gpt").GPT(vocab=64, d=32, heads=4, layers=3, seq=8))
    assert (gpt.layers, gpt.hidden, gpt.heads, gpt.kv_heads, gpt.ffn, gpt.vocab, gpt.seq) == (3, 32, 4, 4, 128, 64, 8)
    assert not gpt.gated and gpt.bias and gpt.positions == 8 and not gpt.tied
    assert gpt.params() == sum(p.numel() for p in example("train_gpt").GPT(64, 32, 4, 3, 8).parameters())
    assert (names.layers, names.column, names.row, names.embedding, names.head) == (
        "blocks", ("q", "k", "v", "fc1"), ("proj", "fc2"), "tok", "head")
    llama, names = describe(example("parallelize_llama").LlamaForCausalLM(128, 64, 96, 4, 2, 16))
    assert (llama.ffn, llama.kv_heads, llama.gated, llama.positions) == (96, 4, True, 16)
    assert names.column == ("self_attn.qkv_proj", "mlp.gate_up_proj") and names.head == "lm_head"
    hf = hf_llama.tiny_llama(layers=3, tie=True)
    spec, names = describe(hf)
    assert (spec.layers, spec.kv_heads, spec.tied) == (3, 2, True)
    assert spec.params() == sum(p.numel() for p in hf.parameters())
    assert names.final_norm == "model.norm"
    with pytest.raises(ValueError, match=r"Sequential: found no ModuleList of identical blocks"):
        describe(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_plan_takes_the_sequence_from_the_sample_batch_when_the_model_has_no_table():
    class Rotary(torch.nn.Module):  # a GPT without a position table
        def __init__(self):
            super().__init__()
            gpt = example("train_gpt").GPT(vocab=64, d=32, heads=4, layers=2, seq=8)
            self.tok, self.blocks, self.head = gpt.tok, gpt.blocks, gpt.head

    from autopar.planner import describe

    with pytest.raises(ValueError, match="Rotary: give the sequence length"):
        describe(Rotary())
    plan = dist.plan(Rotary(), torch.zeros(2, 12, dtype=torch.long), world_size=2, device="cpu", precision="fp32")
    assert plan.spec.seq == 12 and plan.spec.positions == 0


def _recomputed(layout):
    """A HF Llama planned on 2 ranks with too little memory to keep every layer's activations,
    parallelized by the plan (its config, its recomputed layers checkpointed), trained 3
    steps, counting how often every decoder layer's attention ran."""
    from autopar.planner import evaluate
    from autopar.planner.model import Layout

    model = hf_llama.tiny_llama()
    batch = hf_llama.batches()[0][0]
    # one micro-batch, ZeRO-0, no sequence parallel: recompute is the only way to fit
    fixed = {"pp": 1, "zero": 0, "sequence_parallel": False, "micro_batch": 4 // (2 if layout == "dp" else 1),
             **({"dp": 2, "mp": 1} if layout == "dp" else {"dp": 1, "mp": 2})}
    roomy = dist.plan(model, batch, 2, device="cpu", precision="fp32", fixed=fixed)
    layout = roomy.estimate.layout
    every_layer = Layout(layout.shape, layout.stage_layers, layout.stage_layers)  # all recomputed
    tight = (roomy.memory_per_rank_bytes["total"] + evaluate(roomy.spec, roomy.profile, every_layer).peak_memory) / 2
    plan = dist.plan(model, batch, 2, device="cpu", precision="fp32", fixed=fixed, memory_per_rank=tight)
    opt = hf_llama.optimizer(model.parameters())
    model, opt = dist.parallelize(model, opt, dist.ProcessMesh([0, 1], dim_names=["x"]), plan)
    names = plan.apply_recompute(model)  # already done by parallelize: the same names, nothing wrapped twice
    runs = {}
    for i, layer in enumerate(model.model.layers):  # (a local region's verifying trial runs without grad: not counted)
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, i=i: runs.__setitem__(i, runs.get(i, 0) + torch.is_grad_enabled()))
    losses = hf_llama.train(model, opt, hf_llama.batches())
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return (losses, weights, []), names, runs, list(roomy.estimate.layout.recompute), "Recomputes" in plan.why


@pytest.mark.parametrize("layout", ["dp", "mp"])
def test_a_plan_that_recomputes_checkpoints_its_layers_and_matches_one_process(layout):
    ref = hf_llama.reference(hf_llama.batches())
    for got, names, runs, roomy_recompute, said in run_dist(_recomputed, 2, layout):
        hf_llama.assert_matches(got, (*ref, []))
        assert roomy_recompute == [0] and names and said  # with room nothing is recomputed
        recomputed = {int(n.rpartition(".")[2]) for n in names}
        for i, count in runs.items():  # 3 steps: a checkpointed layer runs its forward again in backward
            assert count == (6 if i in recomputed else 3), (i, count, names)


def _seed_llama_steps(planned_vpp):
    """The Llama of examples/parallelize_llama.py (4 layers) trained 3 steps by one process or, with a plan pinned to
    pp2 x vpp2, by its interleaved schedule on 2 ranks."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = example("parallelize_llama").LlamaForCausalLM(64, 32, 64, 4, 4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (4, 9), generator=g) for _ in range(3)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))

    dist_model, config = None, None
    if planned_vpp:  # interleaved chunks run as a captured program (to_static reads pp_config's schedule)
        plan = dist.plan(model, data[0][:, :-1], 2, device="cpu", precision="fp32",
                         fixed={"pp": 2, "vpp": 2, "micro_batch": 1})
        model, opt = dist.parallelize(model, opt, dist.ProcessMesh([0, 1], dim_names=["x"]), plan)
        dist_model, config = dist.to_static(model, None, loss_fn, opt), plan.config["pp_config"]
    losses = []
    for ids in data:
        x, y = ids[:, :-1], ids[:, 1:]
        if dist_model is not None:
            losses.append(float(dist_model(x, y)))
            continue
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    order = dist_model.dist_main_program() if dist_model is not None else None
    weights = {k: dist.unshard_dtensor(v.detach()) if dist.is_dist_tensor(v) else v.detach()
               for k, v in model.named_parameters()}
    return losses, weights, config, order


def test_an_interleaved_plan_runs_its_chunks_on_alternating_stages_and_matches_one_process():
    """pp2 x vpp2 over 4 layers: one layer per chunk, chunks 0 and 2 on the first stage,
    1 and 3 on the second, 4 micro-batches in interleaved 1F1B (captured: the dynamic
    schedules of an annotated model are 1F1B and FThenB)."""
    ref_losses, ref_weights, _, _ = _seed_llama_steps(False)
    for rank, (losses, weights, config, order) in enumerate(run_dist(_seed_llama_steps, 2, True)):
        assert config["schedule_mode"] == "VPP" and config["vpp_degree"] == 2 and config["accumulate_steps"] == 4
        assert sorted(config["split_spec"]) == ["llama.layers.1", "llama.layers.2", "llama.layers.3"]
        assert order.startswith("pipeline VPP, 4 micro-batches"), order
        assert f"F0s{rank}" in order and f"F0s{rank + 2}" in order, order
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_planned_hf_gpt2_splits_its_fused_qkv_by_heads_and_its_tied_head_by_vocabulary():
    """GPT-2 (Conv1D projections, q/k/v side by side in c_attn, head tied to the embedding)
    planned on mp2: the plan keeps each rank's heads of q, k and v together and splits the
    shared weight by vocabulary; trained through it, as one process, gathering only what
    sequence parallel gathers (a block's input sequence halves, before attention and the MLP)."""
    import test_hf_models as hfm

    model = hfm.tiny("gpt2")
    plan = dist.plan(model, hfm.batches()[0][0], 2, device="cpu", precision="fp32",
                     fixed={"mp": 2, "sequence_parallel": True})
    mp_plan = plan.config["mp_config"]["parallelize_plan"]
    assert mp_plan["transformer.h.*.attn.c_attn"].fused == 3 and mp_plan["transformer.h.*.mlp.c_fc"].fused == 1
    embedding = mp_plan["transformer.wte"]
    assert isinstance(embedding[0] if isinstance(embedding, list) else embedding, dist.RowWiseParallel)
    ref = hfm.reference("gpt2")
    for got, comm, *_ in run_dist(hfm._parallel, 2, "gpt2", plan, ["x"]):
        hf_llama.assert_matches(got, ref)
        half_sequence = 4 * hfm.SEQ * hfm.HIDDEN * 4 // 2  # [batch, seq / 2, hidden] fp32
        assert {b for op, b in comm if op == "all_gather"} == {half_sequence}, comm
        assert not [c for c in comm if c[0] == "all_to_all"], comm


def _prediction_beside_the_steps(scale):
    """config="auto" on 2 ranks, 6 steps; the plan's prediction (and its transfers) times
    `scale`; what rank 0 printed and the warnings raised."""
    import contextlib
    import io
    import warnings

    from autopar.api.prediction_check import PredictionGapWarning

    model = hf_llama.tiny_llama()
    opt = hf_llama.optimizer(model.parameters())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = dist.parallelize(model, opt, dist.ProcessMesh([0, 1], dim_names=["dp"]), config="auto")
        check = model._autopar_prediction
        check.predicted *= scale
        check.transfers *= scale
        hf_llama.train(model, opt, hf_llama.batches(7))
    gaps = [str(w.message) for w in caught if issubclass(w.category, PredictionGapWarning)]
    return printed.getvalue().splitlines(), gaps, check.line, len(check.steps)


def test_auto_prints_its_prediction_and_the_measured_steps_beside_it():
    import re

    lines, _, line, steps = run_dist(_prediction_beside_the_steps, 2, 1.0)[0]
    assert steps == 5  # 2 steps to warm up, 3 measured; then the hook is gone
    assert re.fullmatch(r"autopar: planned dp2 \S.*: predicted [\d.]+ ms a step \([\d.]+ ms of it in transfers\)",
                        lines[0]), lines
    assert lines[1] == line and re.fullmatch(
        r"autopar: planned dp2 \S.*: predicted [\d.]+ ms a step, measured [\d.]+ ms \(the median of steps 4-6\): "
        r"[\d.]+x", line), line
    # a prediction 100x too fast: a warning naming the part that differs most
    for rank, (lines, gaps, line, _) in enumerate(run_dist(_prediction_beside_the_steps, 2, 0.01)):
        assert len(gaps) == 1 and gaps[0].startswith(line), gaps
        assert re.search(r"the largest difference is in (transfers|compute, host work, the optimizer and the "
                         r"bubble): predicted [\d.]+ ms, measured [\d.]+ ms", gaps[0]), gaps[0]
        assert (lines == []) == (rank == 1)  # rank 0 prints
