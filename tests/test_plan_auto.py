"""parallelize(config="auto"): the planner's layout runs and trains a HF Llama to the
numbers of one process."""
import pytest
import torch

import autopar as dist
from distpool import run_dist
import hf_llama


def _auto(mesh_ids, dim_names):
    model = hf_llama.tiny_llama()
    opt = hf_llama.optimizer(model.parameters())
    model, opt = dist.parallelize(model, opt, dist.ProcessMesh(mesh_ids, dim_names=dim_names), config="auto")
    grads = []
    losses = hf_llama.train(model, opt, hf_llama.batches(), grads=grads)
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    placed = {k: (v.process_mesh.dim_names, v.process_mesh.shape, [str(p) for p in v.placements])
              for k, v in model.named_parameters()}
    return (losses, weights, grads), model._autopar_plan.degrees, model._autopar_plan.config, placed


@pytest.mark.parametrize("mesh_ids, dim_names", [([0, 1], ["x"]), ([[0, 1]], ["pp", "dp"])])
def test_auto_on_two_ranks_matches_one_process(mesh_ids, dim_names):
    grads = []
    ref = hf_llama.reference(hf_llama.batches(), grads=grads)
    results = run_dist(_auto, 2, mesh_ids, dim_names)
    for got, degrees, config, placed in results:
        hf_llama.assert_matches(got, (*ref, grads))
        assert degrees["dp"] * degrees["mp"] * degrees["pp"] == 2
        if dim_names == ["pp", "dp"]:  # a mesh naming its dims keeps their sizes
            assert degrees == {"dp": 2, "mp": 1, "pp": 1}
        w = placed["model.layers.0.mlp.down_proj.weight"]
        assert w[0] == (["pp", "dp", "mp"] if dim_names == ["x"] else dim_names)
        if degrees["mp"] == 2:
            assert "Shard(1)" in w[2]
        assert config["dp_config"]["sharding_level"] in (0, 1, 2, 3)
    assert all(r[1] == results[0][1] for r in results)  # every rank planned the same


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
