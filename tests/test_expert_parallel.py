"""Expert parallel: HF's MoE models with `ExpertParallel()` on their MoE blocks train as one
process on 2 ranks: the experts' grouped weights split over "ep" (or "dp": dp2ep folding),
tokens dispatched to their expert's rank and combined back by all-to-all.  Also Paddle's
local-computation names, local_map / LocalLayer / moe_sub_mesh_tensors / moe_global_mesh_tensor."""
import pytest
import torch

import autopar as dist
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist
from hf_llama import HIDDEN, SEQ, assert_matches, batches, optimizer, train
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


def _model(name, skewed=False, checkpointed=False, **variant):
    model = tiny(name, **variant)
    if checkpointed:  # each decoder layer recomputed in backward (torch's non-reentrant checkpoint)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
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
    data, grads = batches(), []
    losses = train(model, opt, data[:-1], grads=grads)
    # the last step's routing, seen by a hook: the blocks then run op by op, as the first step did
    # (the steps between ran each MoE block whole on its rank's tokens, where the variant allows)
    routed = []
    for m in model.modules():
        if hasattr(m, "num_experts") and hasattr(m, "gate_up_proj"):
            m.register_forward_pre_hook(lambda _m, args: routed.append(args[1]._local.clone()))
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


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
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
        layers = len(routed)  # one experts call per MoE layer (DeepSeek-V3's first layer is dense)
        assert layers == (1 if name == "deepseek_v3" else 2), layers
        assert not [c for c in comm if c[0] in ("all_gather", "reduce_scatter")], comm
        to_all = [b for op, b in comm if op == "all_to_all"]
        mine, theirs = sent[rank], sent[1 - rank]
        counts = 2 * 8  # the other rank's 2 experts' counts, int64
        forward = [b for layer in range(layers) for b in (counts, mine[layer] * row, theirs[layer] * row)]
        backward = [b for layer in reversed(range(layers)) for b in (mine[layer] * row, theirs[layer] * row)]
        assert to_all == forward + backward, (to_all, forward, backward)


def _block_forwards(model):
    """The `_BlockForward` standing in for each MoE block's forward (below autopar's wrappers)."""
    from autopar.api.moe import _BlockForward

    out = []
    for layer in model.model.layers:
        f = layer.mlp.forward
        while not isinstance(f, _BlockForward):
            f = f.__wrapped__
        out.append(f)
    return out


def _twice(**variant):
    """One forward and backward of the same batch twice on Mixtral split over "ep": each
    call's collectives, loss and gradients, and whether the MoE blocks ran whole the second time."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["ep"])
    model = _model("mixtral", **variant)
    model, _ = dist.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": EP_PLAN}})
    ids = dist.shard_tensor(batches(1)[0][0], mesh, [S0])
    calls = []
    for _ in range(2):
        model.zero_grad()
        with dist.comm_log() as log:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = {k: dist.unshard_dtensor(p.grad) for k, p in model.named_parameters()}
        calls.append(([(r.op, list(r.ranks), r.bytes) for r in log], float(loss), grads))
    whole = [any(plan is not None for plan in f.plans.values()) for f in _block_forwards(model)]
    return calls, whole


def test_a_moe_block_runs_whole_on_its_ranks_tokens_after_its_first_call():
    """A MoE block's first call runs op by op; later ones run the whole block on this rank's
    tokens as plain torch (one boundary, as a dispatch by hand): the same collectives with the
    same bytes, the same loss and gradients."""
    for (first, second), whole in run_dist(_twice, 2):
        assert whole == [True, True]
        # (the mean loss's (sum, count): reduced in the first call's cross-entropy, which the
        # blocks' check records, and in the second where the router's loss is added to it:
        # `deferred_mean`)
        pair = ("all_reduce", [0, 1], 8)
        assert first[0].count(pair) == second[0].count(pair), (first[0], second[0])
        assert [c for c in first[0] if c != pair] == [c for c in second[0] if c != pair], (first[0], second[0])
        assert sum(op == "all_to_all" for op, *_ in second[0]) == 2 * (3 + 2), second[0]  # 2 layers, fwd 3, bwd 2
        assert not [op for op, *_ in second[0] if op in ("all_gather", "reduce_scatter")], second[0]
        assert first[1] == second[1]
        for k, g in first[2].items():
            torch.testing.assert_close(second[2][k], g, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_a_block_that_draws_random_numbers_stays_op_by_op():
    """Mixtral's router jitter draws random numbers while training: those must be the
    single process's draws, so the block keeps running on the distributed tensors."""
    for _, whole in run_dist(_twice, 2, router_jitter_noise=0.1):
        assert whole == [False, False]


@pytest.mark.parametrize("level", [0, 1, 3])
def test_experts_fold_onto_dp_when_the_mesh_has_no_ep(level):
    """dp2ep: on a mesh named ["dp"] the experts split over "dp" (the data-parallel ranks each
    hold 2 of them), the batch split there as well; also with ZeRO-1 and ZeRO-3 over "dp"."""
    ref = _reference("mixtral")
    for rank, (got, pieces, _, comm) in enumerate(run_dist(_ep_run, 2, "mixtral", ["dp"], level)):
        assert_matches(got, ref)
        _check_pieces(pieces, ref[1], rank)  # ZeRO leaves the experts, split over "dp" already, as they are
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


def test_activation_checkpointing_recomputes_the_dispatch():
    """With HF's gradient checkpointing each layer's forward runs again in backward, the
    all-to-alls with it, on every rank in the same order: the numbers stay those of one process."""
    ref = _reference("mixtral", checkpointed=True)
    for got, _, _, comm in run_dist(_ep_run, 2, "mixtral", ["ep"], variant={"checkpointed": True}):
        assert_matches(got, ref)
        # per layer: 3 in forward, the same 3 again in backward's recomputation, then backward's 2
        assert sum(op == "all_to_all" for op, _ in comm) == 2 * (3 + 3 + 2), comm


def test_the_load_balancing_loss_matches_one_process():
    """HF's router auxiliary loss (output_router_logits=True) over the router logits of the
    split batch: the loss and every gradient match one process."""
    ref = _reference("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    for got, *_ in run_dist(_ep_run, 2, "mixtral", ["ep"],
                            variant={"output_router_logits": True, "router_aux_loss_coef": 0.5}):
        assert_matches(got, ref)


def _parallelize_error(variant, dim="ep"):
    mesh = dist.ProcessMesh([0, 1], dim_names=[dim])
    model = tiny("mixtral", **variant)
    with pytest.raises(ValueError) as err:
        dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": EP_PLAN}})
    return str(err.value)


@pytest.mark.parametrize("variant, dim, match", [
    ({"num_local_experts": 3}, "ep", "ExpertParallel on 'model.layers.0.mlp': 3 experts do not divide over mesh dim "
                                     "'ep' of size 2 (mesh ProcessMesh([0, 1], dim_names=['ep']), placement Shard(0))"),
    ({"num_experts_per_tok": 5}, "ep", "ExpertParallel on 'model.layers.0.mlp': top-k 5 is larger than the expert "
                                       "count 4"),
    ({}, "x", "ExpertParallel needs a mesh dim named 'ep' (or 'dp'), but mesh ProcessMesh([0, 1], dim_names=['x'])"),
])
def test_bad_expert_counts_are_refused_by_name(variant, dim, match):
    for msg in run_dist(_parallelize_error, 2, variant, dim):
        assert msg.startswith(match), msg


def test_an_expert_count_a_data_parallel_dim_does_not_divide_is_told_how_to_split_the_dim():
    """ExpertParallel folded on "dp": where dp does not divide the experts, the error names the
    split of the dim into dp x ep that does (torchtitan's dp2ep over part of dp)."""
    from autopar.runtime.experts import check_experts

    with pytest.raises(ValueError, match=r"6 experts do not divide over mesh dim 'dp' of size 4 .*split the dim "
                                         r"in two, 2 x 2, and name the second 'ep': the experts go over its 2 "
                                         r"ranks \(3 a rank\) and data parallel stays over all 4"):
        check_experts(6, 2, dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]), 0, "ExpertParallel on 'moe'")
    with pytest.raises(ValueError, match="no ep size above 1 divides both 3 and 4"):
        check_experts(3, 2, dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]), 0, "ExpertParallel on 'moe'")


# -- local_map, LocalLayer, moe_sub_mesh_tensors / moe_global_mesh_tensor ------------------------
VALUES = [3., -1., 4., -1., 5., 9., -2., 6., 5.]  # 9 rows: uneven halves (5, 4)


def _masked_mean(x):
    keep = x > 0
    return (x * keep).sum(), keep.sum()


def _local_map_run():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(torch.tensor(VALUES), mesh, [S0]).requires_grad_()
    total, count = dist.local_map(_masked_mean, [[Partial()], [Partial()]], [[S0]])(x)
    mean = total / count
    mean.backward()
    rows = dist.local_map(lambda t: t * t.abs(), [[S0]])(x)  # uneven pieces: the global shape from every rank's
    with pytest.raises(ValueError, match=r"input 0 is placed \[Shard\(dim=0\)\]|input 0 is placed \[Shard\(0\)\]"):
        dist.local_map(_masked_mean, [[Partial()], [Partial()]], [[R]])(x)
    moved = dist.local_map(lambda t: t.sum(), [[R]], [[R]], reshard_inputs=True)(x)
    return (mean.item(), total.placements, dist.unshard_dtensor(x.grad), rows.placements, tuple(rows.shape),
            rows.tolist(), moved.item())


def test_local_map_runs_on_local_pieces_with_declared_placements():
    want = torch.tensor(VALUES).requires_grad_()
    total, count = _masked_mean(want)
    (total / count).backward()
    for mean, placements, grad, rows_placements, shape, rows, moved in run_dist(_local_map_run, 2):
        assert mean == pytest.approx((total / count).item(), rel=1e-6)
        assert placements == [Partial()]
        torch.testing.assert_close(grad, want.grad)
        assert rows_placements == [S0] and shape == (9,)
        assert rows == [v * abs(v) for v in VALUES]
        assert moved == sum(VALUES)


class _RowNorms(dist.LocalLayer):
    def __init__(self, mesh):
        super().__init__([(mesh, [S0]), None])
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.scale * x.norm(dim=-1), x.shape[0]


def _local_layer_run():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    layer = _RowNorms(mesh)
    x = dist.shard_tensor(torch.arange(12.).reshape(4, 3), mesh, [S0]).requires_grad_()
    y, rows = layer(x)
    y.sum().backward()
    return y.placements, y.tolist(), rows, dist.unshard_dtensor(x.grad), layer.scale.grad.item()


def test_local_layer_forward_sees_local_pieces():
    want = torch.arange(12.).reshape(4, 3).requires_grad_()
    norms = 2.0 * want.norm(dim=-1)
    norms.sum().backward()
    local_scale_grads = []
    for rank, (placements, values, rows, grad, scale_grad) in enumerate(run_dist(_local_layer_run, 2)):
        assert placements == [S0] and rows == 2  # the forward saw its 2 rows
        assert values == pytest.approx(norms.tolist(), rel=1e-6)
        torch.testing.assert_close(grad, want.grad)
        local_scale_grads.append(scale_grad)
    # the plain parameter's gradient: each rank's own rows' share (a local layer declares no reduction)
    assert sum(local_scale_grads) == pytest.approx(want.norm(dim=-1).sum().item(), rel=1e-6)


def _sub_mesh_run(mesh_ids, dims, placements, dim):
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dims)
    t = dist.shard_tensor(torch.arange(24.).reshape(4, 6), mesh, placements).requires_grad_()
    parts = dist.moe_sub_mesh_tensors(t, mesh, dim, placements)
    described = [(p.process_mesh.process_ids, p.placements, tuple(p.shape)) for p in parts]
    mine = [p for p in parts if dist.get_rank() in p.process_mesh][0]
    own = mine._local.clone()
    doubled = [p * (i + 2) for i, p in enumerate(parts)]  # each slice's own op, on its own ranks
    back = dist.moe_global_mesh_tensor(doubled, mesh, placements, dim)
    back.sum().backward()
    return described, own, back.placements, tuple(back.shape), dist.unshard_dtensor(back.detach()), \
        dist.unshard_dtensor(t.grad)


@pytest.mark.parametrize("mesh_ids, dims, placements, dim", [
    ([0, 1], ["ep"], [S0], 0),
    ([[0], [1]], ["ep", "mp"], [Shard(1), R], 0),
])
def test_sub_mesh_tensors_cut_a_tensor_per_slice_and_join_back(mesh_ids, dims, placements, dim):
    """Slice i of the mesh along `dim` holds the part of the tensor its ranks hold (rows or
    columns 3i..), placed Replicate on the cut dim; joined back, each part's own result lands
    in its place, and the gradient comes back to each rank's piece."""
    full = torch.arange(24.).reshape(4, 6)
    cut = placements[dim].dim
    for rank, (described, own, back_placements, shape, back, grad) in enumerate(
            run_dist(_sub_mesh_run, 2, mesh_ids, dims, placements, dim)):
        half = list(full.shape)
        half[cut] //= 2
        subs = [[0], [1]]
        assert [(ids, p, s) for ids, p, s in described] == [
            (subs[i], [R] * len(dims), tuple(half)) for i in range(2)], described
        torch.testing.assert_close(own, full.chunk(2, dim=cut)[rank])
        assert back_placements == placements and shape == (4, 6)
        torch.testing.assert_close(back, torch.cat([c * (i + 2) for i, c in enumerate(full.chunk(2, dim=cut))], cut))
        torch.testing.assert_close(grad, torch.cat([torch.full_like(c, i + 2.) for i, c in
                                                    enumerate(full.chunk(2, dim=cut))], cut))


def _mesh_run(name, mesh_ids, dims, plan, split_batch=True, level=0):
    """`name` trained 3 steps through parallelize on the mesh `mesh_ids` named `dims` with
    `plan`, the batch split (dp_config, ZeRO `level`) or not; also the experts' placements and
    whether each MoE block ran whole on its rank's tokens after its first call."""
    mesh = dist.ProcessMesh(mesh_ids, dim_names=dims)
    model = tiny(name)
    config = {"mp_config": {"parallelize_plan": plan}}
    if split_batch:
        config["dp_config"] = {"sharding_level": level}
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    data, grads = batches(), []
    losses = train(model, opt, data, grads=grads)
    pieces = {k: p.placements for k, p in _expert_params(model).items()}
    whole = [any(plan is not None for plan in f.plans.values()) for f in _block_forwards(model)]
    return (losses, {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}, grads), pieces, whole


def test_tokens_whole_over_ep_are_cut_routed_and_gathered_back():
    """ExpertParallel alone on an "ep" mesh: the batch is not split, each rank routes its cut
    of the tokens and the output is gathered back."""
    ref = _reference("mixtral")
    for got, _, whole in run_dist(_mesh_run, 2, "mixtral", [0, 1], ["ep"], EP_PLAN, split_batch=False):
        assert_matches(got, ref)
        assert whole == [False, False]  # tokens whole over "ep": the block stays op by op


@pytest.mark.parametrize("level", [0, 3])
def test_ep_times_dp_on_four_ranks(level):
    """A [dp 2, ep 2] mesh: the batch split over both, each expert on one rank of its ep pair
    and replicated over dp, its gradient summed over dp; under ZeRO-3 also cut over dp between
    uses."""
    ref = _reference("mixtral")
    for got, pieces, whole in run_dist(_mesh_run, 4, "mixtral", [[0, 1], [2, 3]], ["dp", "ep"], EP_PLAN,
                                       level=level):
        assert_matches(got, ref)
        assert whole == [True, True], whole  # under ZeRO-3 too: its parameters are whole over "dp" in use
        assert all(p[1] == S0 and (level == 3 or p[0] == R) for p in pieces.values()), pieces


ATTENTION = "model.layers.*.self_attn."
TP_EP_PLAN = {ATTENTION + "q_proj": dist.ColWiseParallel(), ATTENTION + "k_proj": dist.ColWiseParallel(),
              ATTENTION + "v_proj": dist.ColWiseParallel(), ATTENTION + "o_proj": dist.RowWiseParallel(),
              "lm_head": dist.ColWiseParallel(), **EP_PLAN}


def test_ep_times_tp_on_four_ranks():
    """An [ep 2, mp 2] mesh: attention split by heads over "mp", the experts over "ep"; the
    tokens reach the MoE block whole over "mp" and every mp rank routes them alike."""
    ref = _reference("mixtral")
    for got, pieces, whole in run_dist(_mesh_run, 4, "mixtral", [[0, 1], [2, 3]], ["ep", "mp"], TP_EP_PLAN):
        assert_matches(got, ref)
        assert whole == [True, True]  # the tokens whole over "mp", as everything there: each mp rank alike
        assert set(map(tuple, pieces.values())) == {(S0, R)}, pieces


def test_dispatch_and_combine_on_one_rank_is_the_weighted_sum_of_the_chosen_experts():
    """The algorithm without processes (a group of one: the all-to-alls hand their rows back):
    sum_k w[t, k] * expert_{index[t, k]}(x[t]), gradients included; an expert no token chose
    gets no row."""
    from autopar.runtime.experts import Routing, dispatch_combine

    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    w_experts = torch.randn(5, 6, 6, generator=g, requires_grad=True)
    index = torch.randint(0, 4, (10, 3), generator=g)  # expert 4 never chosen
    weights = torch.rand(10, 3, generator=g, requires_grad=True)
    seen = []

    def run(rows, experts):
        seen.append(experts.clone())
        return torch.bmm(rows.unsqueeze(1), w_experts[experts]).squeeze(1)

    got = dispatch_combine(x, index, weights, 5, (0,), run)
    want = sum(weights[:, k:k + 1] * torch.bmm(x.unsqueeze(1), w_experts[index[:, k]]).squeeze(1) for k in range(3))
    torch.testing.assert_close(got, want)
    assert torch.equal(seen[0], index.reshape(-1).sort(stable=True).values)
    assert 4 not in seen[0].tolist()
    grads = torch.autograd.grad(got.square().sum(), (x, w_experts, weights))
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (x, w_experts, weights))):
        torch.testing.assert_close(a, b)
    route = Routing(index, 5, (0,))
    assert route.send == route.recv == [30]


class _Experts(torch.nn.Module):
    """HF's experts interface, in a few lines: grouped [experts, in, out] weights."""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            out = out + weights[:, k:k + 1] * torch.bmm(x.unsqueeze(1), self.w[index[:, k]]).squeeze(1)
        return out


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.gate, self.experts = 2, torch.nn.Linear(8, 4), _Experts()

    def forward(self, x):
        weights, index = self.gate(x).softmax(-1).topk(self.top_k)
        return self.experts(x, index, weights)


def _static_run():
    mesh = dist.ProcessMesh([0, 1], dim_names=["ep"])
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"moe": _Block()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = dist.parallelize(model, opt, mesh, {"mp_config": {"parallelize_plan": {"moe": dist.ExpertParallel()}}})
    step = dist.to_static(model["moe"], None, lambda out, y: (out - y).square().mean(), opt)
    x, y = (dist.shard_tensor(torch.randn(6, 8), mesh, [S0]) for _ in range(2))
    with pytest.raises(dist.CaptureError, match="expert routing's split sizes"):
        step(x, y)
    return True


def test_a_captured_program_refuses_the_data_dependent_routing():
    """The all-to-alls' split sizes depend on the router's choice: to_static, which replays
    the transfers it captured, refuses instead of replaying the first step's splits."""
    assert all(run_dist(_static_run, 2))


def _pipelined(pipeline):
    """Mixtral trained 3 steps with the loss on its logits: in one process, or in 2 pipeline
    stages (1F1B over 2 micro-batches) whose layers split their experts over "ep"."""
    from autopar.pipelining import build_schedule
    from test_pipeline_models import _hf_lm_loss

    model = tiny("mixtral")
    opt = optimizer(model.parameters())
    step = None
    if pipeline:
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "ep"])
        config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": EP_PLAN},
                  "pp_config": {"split_spec": "model.layers", "schedule_mode": "1F1B", "accumulate_steps": 2}}
        model, opt = dist.parallelize(model, opt, mesh, config)
        step = build_schedule(model, _hf_lm_loss).step
    losses = []
    for ids, labels in batches():
        if step is not None:
            loss = step(ids, target=labels)
        else:
            loss = _hf_lm_loss(model(input_ids=ids), labels)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    pieces = {k: p.placements for k, p in _expert_params(model).items() if dist.is_dist_tensor(p) and
              dist.get_rank() in p.process_mesh}
    weights = {k: dist.unshard_dtensor(v.detach()) if dist.is_dist_tensor(v) else v.detach()
               for k, v in model.state_dict().items()}
    return losses, weights, pieces


def test_pipeline_stages_with_experts_split_over_ep():
    """A [pp 2, ep 2] mesh: each stage's MoE layer splits its experts over the stage's "ep"
    ranks, micro-batches split over "ep" as well."""
    ref_losses, ref_weights, _ = _pipelined(False)
    for losses, weights, pieces in run_dist(_pipelined, 4, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        assert len(pieces) == 2 and set(map(tuple, pieces.values())) == {(S0,)}, pieces


def _one_step_collectives():
    """One forward and backward of Mixtral with its experts split over a 4-rank "ep" mesh:
    this rank's collectives [(op, ranks, bytes)] and how many experts it holds per layer."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["ep"])
    model = tiny("mixtral")
    config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": EP_PLAN}}
    model, _ = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    ids = batches(1, batch=8)[0][0]
    with dist.comm_log() as log:
        model(input_ids=ids, labels=ids).loss.backward()
    held = {p._local.shape[0] for p in _expert_params(model).values()}
    return [(r.op, list(r.ranks), r.bytes) for r in log], sorted(held)


def _simulated_rank_1():
    with dist.simulate(4, 1):
        return _one_step_collectives()


def test_a_simulated_rank_sends_the_real_ranks_collectives():
    """`dist.simulate` runs rank 1 of a 4-rank expert-parallel job in one process: the same
    collectives on the same groups as the real rank 1, the counts' exchange of the same size
    (the rows' sizes follow the routing, which the fake exchange cannot know), 1 expert of 4 held."""
    from plain_process import evaluated

    simulated, held = evaluated("t._simulated_rank_1()", "test_expert_parallel")
    real, real_held = run_dist(_one_step_collectives, 4)[1]
    assert held == real_held == [1]
    assert [(op, ranks) for op, ranks, _ in simulated] == [(op, ranks) for op, ranks, _ in real]
    counts = [b for op, _, b in real if op == "all_to_all" and b == 3 * 8]
    assert len(counts) == 2 and [b for op, _, b in simulated if op == "all_to_all" and b == 3 * 8] == counts


def _saved_and_loaded(path):
    """A step of Mixtral with its experts split over "ep", saved; loaded into the same model
    under plain data parallel (every expert whole on each rank) and into a fresh
    expert-parallel one."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["ep"])
    config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": EP_PLAN}}
    model = tiny("mixtral")
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    train(model, opt, batches(1))
    dist.save_state_dict(model.state_dict(), path)
    saved = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    dp = dist.ProcessMesh([0, 1], dim_names=["dp"])
    whole, _ = dist.parallelize(tiny("mixtral", seed=7), None, dp, {"dp_config": {"sharding_level": 0}})
    again, _ = dist.parallelize(tiny("mixtral", seed=7), None, mesh, config)
    out = []
    for target in (whole, again):
        dist.load_state_dict(target.state_dict(), path)
        out.append({k: dist.unshard_dtensor(v.detach()) for k, v in target.state_dict().items()})
    experts = [[p.placements for k, p in m.named_parameters() if k.endswith("layers.0.mlp.experts.down_proj")][0]
               for m in (whole, again)]
    return saved, out, experts


def test_a_checkpoint_of_split_experts_loads_into_other_layouts(tmp_path):
    for saved, loaded, experts in run_dist(_saved_and_loaded, 2, str(tmp_path / "ckpt")):
        assert experts == [[R], [S0]]
        for got in loaded:
            assert got.keys() == saved.keys()
            for k, v in saved.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def _balanced(model, experts=4):
    """Each MoE layer's router forced to a balanced routing: this rank's token t sends its i-th
    choice to expert (t * k + i) mod experts, so every expert gets tokens * k / experts of each
    rank's pairs (the routing `simulate` on meta assumes, where the hook changes nothing)."""
    def route(_m, _a, out):
        index = out[2]
        if index.is_meta:
            return out
        local = index._local
        balanced = torch.arange(local.numel(), device=local.device).view(local.shape) % experts
        return out[0], out[1], dist.dtensor_from_local(balanced, index.process_mesh, index.placements,
                                                       shape=index.shape)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(route)
    return model


def _ep_step(device, rank):
    """One step (forward, backward, SGD) of Mixtral with its experts split over a 2-rank "ep"
    mesh on `device` as rank `rank` ("meta": the routing has no values; "cpu": a real run routed
    balanced): its collectives [op, ranks, bytes, shape], its memory (`simulate.memory`) and the
    tensors autograd saved, in order [storage (numbered by first save), bytes]."""
    import dataclasses

    from autopar.tools.simulate import SavedActivations, memory

    mesh = dist.ProcessMesh([0, 1], dim_names=["ep"])
    with torch.device(device):
        model = tiny("mixtral")
    _balanced(model)  # (on meta too: a user's hook keeps its layers op by op, on both sides alike)
    config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": EP_PLAN}}
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    ids = batches(1)[0][0]
    half = ids.shape[0] // 2
    mine = ids[rank * half:(rank + 1) * half].clone()  # (its own storage, as on meta)
    ids = dist.dtensor_from_local(mine.to(device), mesh, [S0], shape=ids.shape)
    saved = SavedActivations()
    with dist.comm_log() as log, saved:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    storages: dict = {}
    saves = [[storages.setdefault(key, len(storages)), n] for key, n, step, _ in saved.events if step > 0]
    held = dataclasses.asdict(memory(model, opt, saved))
    return [[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log], held, saves


def _real_balanced_step():
    return _ep_step("cpu", dist.get_rank())


def _simulated_on_meta(rank):
    with dist.simulate(2, rank):
        return _ep_step("meta", rank)


def test_simulate_on_meta_assumes_balanced_routing_and_matches_a_real_run_routed_so():
    """On the meta device the routing has no values: `simulate` takes it balanced (each
    expert tokens * k / experts of each rank's pairs).  A real run whose router is forced to
    such a routing sends the same collectives with the same bytes and holds the same memory
    (parameters, gradients, optimizer states, the peak of saved activations)."""
    from plain_process import evaluated

    real = run_dist(_real_balanced_step, 2)
    for rank in range(2):
        log, held, saves = evaluated(f"t._simulated_on_meta({rank})", "test_expert_parallel")
        real_log, real_held, real_saves = real[rank]
        assert log == real_log, (log, real_log)
        assert saves == real_saves  # the same tensors saved for backward, sharing the same storages
        assert held == real_held, (held, real_held)  # the activation peak included
        peak = held["activations_peak"]
        rows = [b for op, _, b, shape in log if op == "all_to_all" and len(shape) == 2]
        # 2 rows of SEQ tokens per rank, 2 choices each: half of the pairs go to the other rank's 2
        # experts, in each of the 2 layers' dispatch and combine, forward and backward
        assert rows == [2 * SEQ * 2 // 2 * HIDDEN * 4] * (2 * 2 * 2)
        assert peak > 0


def _saved_routed_rows():
    """The distinct storages of [pairs, HIDDEN] rows autograd keeps in one forward of the tiny
    Mixtral under ExpertParallel on 2 ranks, routed balanced (this rank's pairs, its tokens x k,
    are as many rows as reach its experts and come back), and its MoE layers."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["ep"])
    model = _balanced(tiny("mixtral"))
    k = model.config.num_experts_per_tok
    config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": EP_PLAN}}
    model, _ = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    ids = dist.shard_tensor(batches(1)[0][0], mesh, [S0])
    pairs = ids.shape[0] // 2 * ids.shape[1] * k
    weights = {p.local_value().untyped_storage().data_ptr() for p in model.parameters()}  # (some are [64, 64] too)
    kept = set()

    def pack(t):
        local = t.local_value() if dist.is_dist_tensor(t) else t
        if tuple(local.shape) == (pairs, HIDDEN) and local.untyped_storage().data_ptr() not in weights:
            kept.add(local.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return len(kept), len(model.model.layers)


def test_each_routed_row_is_kept_twice_for_backward():
    """Per MoE layer autograd keeps two copies of the rows routed to the experts: the experts'
    own (sorted) input and the returned rows the routing weights multiply.  The combine sums
    each token's k rows by reshaping, as HF's experts do; an index_add into the tokens kept a
    third copy (torch saves an index_add's source for its backward)."""
    for kept, layers in run_dist(_saved_routed_rows, 2):
        assert kept == 2 * layers
