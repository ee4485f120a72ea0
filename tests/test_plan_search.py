"""The planner finds the optimum that brute force finds, and says what it chose."""
import dataclasses
import itertools
import json

import pytest

import autopar as dist
from autopar.planner import H100, TransformerSpec, evaluate
from autopar.planner.model import Layout
from autopar.planner.search import search, shapes

SPEC = TransformerSpec(layers=4, hidden=512, heads=8, kv_heads=4, ffn=2048, vocab=8000, seq=4096)
DEVICE = dataclasses.replace(H100, reserved_bytes=0.0, ranks_per_node=4)  # tp groups fit 4 ranks
WORLD, BATCH = 8, 16


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _splits(shape):
    """Every split of the layers into the shape's stages (interleaving: each into vpp chunks)."""
    return [c for c in _compositions(SPEC.layers, shape.pp) if not any(n % shape.vpp for n in c)]


def _brute_force(limit):
    """The fastest fitting layout over every shape (interleaved pipelines included), stage
    split and per-stage recompute count."""
    best = None
    for shape in shapes(SPEC, WORLD, BATCH, DEVICE):
        for split in _splits(shape):
            for recompute in itertools.product(*(range(n + 1) for n in split)):
                est = evaluate(SPEC, DEVICE, Layout(shape, split, recompute), limit)
                if est.fits and (best is None or est.step_time < best.step_time):
                    best = est
    return best


@pytest.fixture(scope="module")
def unlimited():
    return _brute_force(1e15)


@pytest.mark.parametrize("squeeze", [1.0, 0.5, 0.25, 0.12])
def test_planner_finds_the_brute_force_optimum(unlimited, squeeze):
    limit = unlimited.peak_memory * squeeze
    want = _brute_force(limit)
    got = search(SPEC, WORLD, BATCH, DEVICE, memory_per_rank=limit).best
    assert got.fits and got.peak_memory <= limit
    assert got.step_time == pytest.approx(want.step_time, rel=1e-6), (got.layout, want.layout)  # HiGHS's gap


def test_the_lower_bound_never_passes_a_layout_of_its_shape():
    from autopar.planner.model import all_terms
    from autopar.planner.search import lower_bound

    for shape in shapes(SPEC, WORLD, BATCH, DEVICE):
        bound = lower_bound(all_terms(SPEC, DEVICE, shape), shape, SPEC.layers)
        for split in _splits(shape):
            for recompute in itertools.product(*(range(n + 1) for n in split)):
                step = evaluate(SPEC, DEVICE, Layout(shape, split, recompute)).step_time
                assert bound <= step * (1 + 1e-12), (shape, split, recompute)


def test_pinned_degrees_skip_shapes_that_cannot_beat_their_best():
    result = search(SPEC, WORLD, BATCH, DEVICE, fixed={"mp": 2, "pp": 2, "cp": 1})  # dp follows
    assert result.runner_up is None and result.bounded > 0 and result.solved + result.bounded == result.searched
    brute = min(
        evaluate(SPEC, DEVICE, Layout(shape, split, (0, 0))).step_time
        for shape in shapes(SPEC, WORLD, BATCH, DEVICE, fixed={"mp": 2, "pp": 2})
        for split in _splits(shape)
    )
    assert result.best.step_time == pytest.approx(brute, rel=1e-6)


def test_unknown_fixed_setting_is_named():
    with pytest.raises(ValueError, match=r"cannot fix \['tensor'\]"):
        search(SPEC, WORLD, BATCH, DEVICE, fixed={"tensor": 2})


def test_tight_memory_brings_recompute_uneven_stages_zero_or_more_model_parallel(unlimited):
    limit = unlimited.peak_memory * 0.12
    got = search(SPEC, WORLD, BATCH, DEVICE, memory_per_rank=limit).best
    layout, roomy = got.layout, unlimited.layout.shape
    split_more = layout.shape.tp * layout.shape.pp > roomy.tp * roomy.pp
    assert (sum(layout.recompute) > 0 or len(set(layout.stage_layers)) > 1 or layout.shape.zero > 0
            or split_more), (layout, roomy)


def test_nothing_fits_is_said_with_the_limit():
    with pytest.raises(ValueError, match=r"nothing fits: .* 8 ranks of h100 stays within 0.0 GB"):
        search(SPEC, WORLD, BATCH, DEVICE, memory_per_rank=1e6)


def test_no_layout_names_the_constraints():
    with pytest.raises(ValueError, match="no dp x cp x tp x pp layout of 5 ranks.*heads=8 and kv_heads=4.*global_batch=3"):
        search(SPEC, 5, 3, DEVICE)  # 5 splits no head count, exceeds the 4 layers and divides no batch of 3


def test_dist_plan_returns_a_parallelize_config_and_why():
    plan = dist.plan(SPEC, world_size=WORLD, global_batch=BATCH, device=DEVICE, compare={"mp": 2, "pp": 2})
    d = plan.degrees
    assert d["dp"] * d.get("sep", 1) * d["mp"] * d["pp"] == WORLD
    assert plan.config.get("dp_config", {"sharding_level": 0}) == {"sharding_level": plan.estimate.layout.shape.zero}
    for key, dims in (("dp_config", ["dp"]), ("mp_config", ["mp", "sep", "ep"]), ("pp_config", ["pp"])):
        assert (key in plan.config) == any(d.get(dim, 1) > 1 for dim in dims), (key, d)
    assert plan.compared.layout.shape.tp == 2 and plan.compared.layout.shape.pp == 2
    assert plan.step_time_s <= plan.compared.step_time
    assert "searched" in plan.why and "HiGHS" in plan.why and "Runner-up" in plan.why
    mesh = plan.mesh()
    assert mesh.shape == [d[name] for name in mesh.dim_names]
    out = json.loads(json.dumps(plan.to_json()))
    assert out["step_time_s"] == plan.step_time_s and out["memory_per_rank_bytes"]["total"] == plan.estimate.peak_memory


def test_fixed_degrees_give_the_config_of_that_layout():
    plan = dist.plan(SPEC, world_size=WORLD, global_batch=BATCH, device=DEVICE,
                     fixed={"mp": 2, "pp": 2, "zero": 1, "sequence_parallel": False})
    assert plan.degrees == {"dp": 2, "mp": 2, "pp": 2}
    mp = plan.config["mp_config"]["parallelize_plan"]
    assert type(mp["model.layers.*.self_attn.q_proj"]).__name__ == "ColWiseParallel"
    assert type(mp["model.layers.*.mlp.down_proj"]).__name__ == "RowWiseParallel"
    pp = plan.config["pp_config"]
    first = plan.estimate.layout.stage_layers[0]
    assert pp["split_spec"] == {f"model.layers.{first}": dist.SplitPoint.BEGINNING}
    assert pp["accumulate_steps"] == plan.estimate.layout.shape.micro_batches


def test_plan_reads_dims_from_a_module_and_a_sample_batch():
    import torch
    from hf_llama import tiny_llama

    plan = dist.plan(tiny_llama(), torch.zeros(8, 16, dtype=torch.long), world_size=2, device=DEVICE)
    assert plan.spec.layers == 2 and plan.spec.kv_heads == 2 and plan.spec.seq == 16
    assert plan.estimate.layout.shape.global_batch == 8


def test_an_integer_program_stopped_by_its_time_limit_gives_its_best_split_unproven(monkeypatch):
    from autopar.planner import search as search_module
    from autopar.planner.model import Shape, all_terms

    big = TransformerSpec(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192)
    shape = Shape(dp=32, tp=8, pp=64, micro_batch=1, micro_batches=64, zero=0, sequence_parallel=True)
    terms = all_terms(big, H100, shape)
    monkeypatch.setattr(search_module, "SOLVE_SECONDS", 0.01)  # well short of the ~0.5 s it needs
    split, proven = search_module.solve_split(terms, shape, big.layers, 80e9)
    assert not proven
    if split is not None:  # an incumbent was found in time: a real split that fits
        assert sum(split[0]) == big.layers and len(split[0]) == 64
        assert evaluate(big, H100, Layout(shape, *split), 80e9 * (1 + 1e-6)).fits
    monkeypatch.setattr(search_module, "SOLVE_SECONDS", 60.0)
    split, proven = search_module.solve_split(terms, shape, big.layers, 80e9)
    assert proven and sum(split[0]) == big.layers


def test_the_solver_prunes_what_cannot_beat_the_runner_up_and_chooses_the_same(monkeypatch):
    """Each integer program gets the step time it must beat (the runner-up's, or its degrees'
    best): pruned by it, programs that cannot beat it stop early, and the search returns the
    layouts a search solving every program to its optimum returns."""
    import autopar.planner.search as planner_search

    llama3_70b = TransformerSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=4096)
    fixed = {"mp": 8, "zero": 1, "cp": 1}  # (a few shapes: the search without pruning takes seconds)
    pruned = search(llama3_70b, 1024, 1024, "h100", fixed=fixed)
    solve = planner_search.solve_split
    monkeypatch.setattr(planner_search, "solve_split", lambda terms, shape, layers, limit, cutoff: solve(
        terms, shape, layers, limit))
    whole = search(llama3_70b, 1024, 1024, "h100", fixed=fixed)
    # (a program that finds nothing counts as cut off where it had a step time to beat: both
    # searches count the ones that cannot fit so, the pruned one also those stopped early)
    assert pruned.cut_off > whole.cut_off and pruned.solved == whole.solved
    assert pruned.best.layout == whole.best.layout and pruned.runner_up.layout == whole.runner_up.layout
