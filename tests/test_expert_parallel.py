"""Expert parallel: HF's MoE models with `ExpertParallel()` on their MoE blocks train as one
process on 2 ranks: the experts' grouped weights split over "ep" (or "dp": dp2ep folding),
tokens dispatched to their expert's rank and combined back by all-to-all.  Also Paddle's
local-computation names, local_map / LocalLayer / moe_sub_mesh_tensors / moe_global_mesh_tensor."""
import pytest
import torch

import autopar as dist
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist
from hf_llama import HIDDEN, assert_matches, batches, optimizer, train
from test_hf_models import reference, tiny

S0, R = Shard(0), Replicate()
EP_PLAN = {"model.layers.*.mlp": dist.ExpertParallel()}


def _expert_params(model):
    return {k: p for k, p in model.named_parameters() if ".experts." in k}


def _ep_run(name, dims, level=0, variant=None):
    """`name` trained 3 steps through parallelize with ExpertParallel on a 2-rank mesh named
    `dims`; also each expert weight's local piece, the routing of the last step's tokens (the
    local top-k index each experts call saw) and the last step's collectives."""
    variant = variant or {}
    mesh = dist.ProcessMesh([0, 1], dim_names=dims)
    model = tiny(name, **variant)
    config = {"dp_config": {"sharding_level": level}, "mp_config": {"parallelize_plan": EP_PLAN}}
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    routed = []
    for m in model.modules():
        if hasattr(m, "num_experts") and hasattr(m, "gate_up_proj"):
            m.register_forward_pre_hook(lambda _m, args: routed.append(args[1]._local.clone()))
    data, grads = batches(), []
    losses = train(model, opt, data[:-1], grads=grads)
    routed.clear()
    with dist.comm_log() as log:
        losses += train(model, opt, data[-1:])
    pieces = {k: (p.placements, p._local.detach().clone()) for k, p in _expert_params(model).items()}
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return (losses, weights, grads), pieces, routed, [(r.op, r.bytes) for r in log]


def _check_pieces(pieces, ref_weights, rank):
    """Each expert weight is Shard(0) over the expert dim, this rank holding its half of the experts."""
    for k, (placements, local) in pieces.items():
        assert placements[-1] == S0 or placements == [S0], (k, placements)
        full = ref_weights[k]
        half = full.shape[0] // 2
        torch.testing.assert_close(local, full[rank * half:(rank + 1) * half], rtol=1e-5, atol=1e-6)


def _to_other_rank(index, rank, num_experts=4):
    """How many of this rank's (token, k) pairs go to an expert on the other rank."""
    return int(((index // (num_experts // 2)) != rank).sum())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_expert_parallel_on_an_ep_mesh_matches_one_process(name):
    """ep=2: each rank holds 2 of the 4 experts and routes its half of the batch.  Per MoE layer
    the hidden rows cross the wire twice in forward (dispatch, combine) and twice in backward,
    each time exactly the (token, k) pairs whose expert lives on the other rank, after one small
    exchange of the per-expert counts; nothing is gathered."""
    ref = reference(name)
    results = run_dist(_ep_run, 2, name, ["ep"])
    sent = [[_to_other_rank(ix, rank) for ix in r[2]] for rank, r in enumerate(results)]
    row = HIDDEN * 4
    for rank, (got, pieces, routed, comm) in enumerate(results):
        assert_matches(got, ref)
        _check_pieces(pieces, ref[1], rank)
        assert len(routed) == 2  # one experts call per layer
        assert not [c for c in comm if c[0] in ("all_gather", "reduce_scatter")], comm
        to_all = [b for op, b in comm if op == "all_to_all"]
        mine, theirs = sent[rank], sent[1 - rank]
        counts = 2 * 8  # the other rank's 2 experts' counts, int64
        forward = [b for layer in range(2) for b in (counts, mine[layer] * row, theirs[layer] * row)]
        backward = [b for layer in (1, 0) for b in (mine[layer] * row, theirs[layer] * row)]
        assert to_all == forward + backward, (to_all, forward, backward)
