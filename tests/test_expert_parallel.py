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
from test_hf_models import tiny

S0, R = Shard(0), Replicate()
EP_PLAN = {"model.layers.*.mlp": dist.ExpertParallel()}


def _expert_params(model):
    return {k: p for k, p in model.named_parameters() if ".experts." in k}


def _first_experts_only(model):
    """Route every token to experts 0 and 1 only (the router's choice k taken modulo 2): the
    rank holding experts 2 and 3 receives no token, its experts get no gradient but zeros."""
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: (out[0], out[1], out[2] % 2))
    return model


def _model(name, skewed=False, **variant):
    model = tiny(name, **variant)
    return _first_experts_only(model) if skewed else model


def _reference(name, **variant):
    """The single-process run (see test_hf_models.reference), `_model`'s variants."""
    model, grads = _model(name, **variant), []
    losses = train(model, optimizer(model.parameters()), batches(), grads=grads)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def _ep_run(name, dims, level=0, variant=None):
    """`name` trained 3 steps through parallelize with ExpertParallel on a 2-rank mesh named
    `dims`; also each expert weight's local piece, the routing of the last step's tokens (the
    local top-k index each experts call saw) and the last step's collectives."""
    variant = variant or {}
    mesh = dist.ProcessMesh([0, 1], dim_names=dims)
    model = _model(name, **variant)
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
    ref = _reference(name)
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


@pytest.mark.parametrize("level", [0, 1, 3])
def test_experts_fold_onto_dp_when_the_mesh_has_no_ep(level):
    """dp2ep: on a mesh named ["dp"] the experts split over "dp" (the data-parallel ranks each
    hold 2 of them), the batch split there as well; also with ZeRO-1 and ZeRO-3 over "dp"."""
    ref = _reference("mixtral")
    for rank, (got, pieces, _, comm) in enumerate(run_dist(_ep_run, 2, "mixtral", ["dp"], level)):
        assert_matches(got, ref)
        if level == 0:
            _check_pieces(pieces, ref[1], rank)
        assert sum(op == "all_to_all" for op, _ in comm) == 2 * 3 + 2 * 2, comm


def test_a_rank_that_receives_no_token_and_experts_that_get_none():
    """Every token routed to experts 0 and 1 (rank 0's): rank 1 sends all its pairs away and
    receives nothing, its experts see no token and get zero gradients, as in one process."""
    ref = _reference("mixtral", skewed=True)
    for rank, (got, pieces, routed, comm) in enumerate(run_dist(_ep_run, 2, "mixtral", ["ep"],
                                                                variant={"skewed": True})):
        assert_matches(got, ref)
        _check_pieces(pieces, ref[1], rank)
        assert all(int((ix >= 2).sum()) == 0 for ix in routed)
        if rank == 1:
            for step in got[2]:
                for k, g in step.items():
                    if ".experts." in k:
                        assert torch.count_nonzero(g[2:]) == 0, k


def test_the_load_balancing_loss_matches_one_process():
    """HF's router auxiliary loss (output_router_logits=True) over the router logits of the
    split batch: the loss and every gradient match one process."""
    ref = _reference("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    for got, *_ in run_dist(_ep_run, 2, "mixtral", ["ep"],
                            variant={"output_router_logits": True, "router_aux_loss_coef": 0.5}):
        assert_matches(got, ref)
