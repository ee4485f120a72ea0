"""The planner's layouts confirmed by `dist.simulate` on the meta device: one rank per pipeline
role (the first stage with the embedding, a middle one, the last with the norm and the head)
runs the real HF model under the plan's own `parallelize` config, one micro-batch forward and
backward and an optimizer step, and what it sends (comm_log) and holds (`Simulation.memory`)
is set beside the planner's accounting of that rank (`role_terms`).

Shrunk where the per-rank figures do not change: each stage holds one decoder layer (the
planner's figures are affine in the layer count, its per-layer terms read at n = 1), the
pipeline is left out of the config (each role's model holds only its stage's parts, and a
middle or last stage takes the activation the stage before sends, placed as sent), and the
run is fp32 (the plan's layout priced again in fp32; the bf16 plan's bytes are half the
activations' and the weights')."""
import dataclasses
import functools

import pytest
import torch

import autopar as dist
from autopar.planner.cost import H100
from autopar.planner.describe import apply_recompute
from autopar.planner.model import PRESETS, Affine, LatentAttention, Layout, Shape, TransformerSpec, role_terms, stage_terms
from plain_process import evaluated

LLAMA_405B_128K = dataclasses.replace(PRESETS["llama3-405b"], seq=131072)
# the layout `dist.plan(LLAMA_405B_128K, world_size=16384, global_batch=128, device="h100")`
# chooses (docs/plan.md; its search takes about 4 s, the degrees pinned here take none)
PLANNED_405B = {"dp": 1, "cp": 64, "cp_mode": "ring", "mp": 8, "pp": 32, "vpp": 2, "zero": 0}
ROLES = {"first": 0, "middle": 1, "last": PLANNED_405B["pp"] - 1}  # pipeline stage of each role
WORLD = 16384


def _unmasked_sdpa(config) -> None:
    """HF's own sdpa attention under another name: its mask builder, which HF runs only for the
    registered names, reads the all-ones 2D mask's values to see that no mask is needed (a
    meta tensor has none); unregistered, it builds none, and the attention runs causal without
    a mask, as it does once the builder has seen the ones."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa_unmasked", sdpa_attention_forward)
    config._attn_implementation = "sdpa_unmasked"


@functools.lru_cache(maxsize=None)
def _plan():
    return dist.plan(LLAMA_405B_128K, world_size=WORLD, global_batch=128, device="h100", fixed=PLANNED_405B)


def llama_role(role: str, recompute: bool = False) -> dict:
    """One rank of `role` of the planned 405B job at 128K tokens, simulated on meta with one
    decoder layer (`recompute`: checkpointed as the plan recomputes layers): its memory after backward and after the step, and its collectives as
    [op, group size, bytes, shape]."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    spec, plan = LLAMA_405B_128K, _plan()
    stage = ROLES[role]
    mesh = plan.mesh()
    ids = np.array(mesh.process_ids).reshape(mesh.shape)[stage]
    sub = dist.ProcessMesh(ids.tolist(), dim_names=mesh.dim_names[1:])  # the stage's dp x sep x mp
    rank = int(ids.flat[0])
    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=1,
                      num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                      max_position_embeddings=spec.seq)
    _unmasked_sdpa(cfg)
    entries = dict(plan.config["mp_config"]["parallelize_plan"])
    config = {**{k: v for k, v in plan.config.items() if k != "pp_config"}, "mp_config": {"parallelize_plan": entries}}
    dp = plan.degrees["dp"]
    with dist.simulate(WORLD, rank) as sim:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        if role != "last":  # the final norm and the head live on the last stage
            model.lm_head, model.model.norm = None, torch.nn.Identity()
            del entries["lm_head"], entries["model.norm"]
        if role != "first":  # the embedding on the first
            model.model.embed_tokens = None
            del entries["model.embed_tokens"]
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), sub, config)
        if recompute:  # the planner's own checkpointing of a layer it recomputes
            one = plan.estimate.layout.shape
            apply_recompute(model, plan.names, Layout(dataclasses.replace(one, pp=1, vpp=1), (1,), (1,)))
        batch = [dist.Shard(0), dist.Replicate(), dist.Replicate()]  # a micro-batch of one sequence per dp rank
        tokens = dist.dtensor_from_local(torch.zeros(1, spec.seq, dtype=torch.long, device="meta"), sub, batch,
                                         shape=(dp, spec.seq))
        # what a later stage receives: the activation split as the stage before sends it
        sent = [dist.Shard(0), dist.Shard(1), dist.Shard(1)]
        cut = (1, spec.seq // plan.degrees["sep"] // plan.degrees["mp"], spec.hidden)
        received = dist.dtensor_from_local(torch.zeros(cut, device="meta"), sub, sent,
                                           shape=(dp, spec.seq, spec.hidden)).requires_grad_()
        with dist.comm_log() as log:
            if role == "last":
                model(inputs_embeds=received, labels=tokens).loss.backward()
            else:
                inputs = {"input_ids": tokens} if role == "first" else {"inputs_embeds": received}
                out = model.model(**inputs).last_hidden_state
                # the gradient the next stage sends back, split as the output
                out.backward(dist.dtensor_from_local(torch.zeros_like(out._local), sub, out.placements,
                                                     shape=out.shape))
            after_backward = dataclasses.astuple(sim.memory(model, opt))
            opt.step()
        after_step = dataclasses.astuple(sim.memory(model, opt))
    return {"rank": rank, "after_backward": after_backward, "after_step": after_step,
            "log": [[r.op, len(r.ranks), r.bytes, list(r.shape)] for r in log]}


def _priced(plan, role: str):
    """The planner's terms for a rank of `role` under the plan's layout in fp32, without the
    pipeline's sends (the simulated stage sends none: its neighbours are left out)."""
    shape = dataclasses.replace(plan.estimate.layout.shape, precision="fp32", pp=1)
    return role_terms(plan.spec, H100, shape, role == "first", role == "last")


def _sent(log: list, op: str, group: int) -> int:
    """Bytes this rank sent by `op` in groups of `group` ranks."""
    return sum(b for o, k, b, _ in log if o == op and k == group)


@pytest.fixture(scope="module")
def llama_roles() -> dict:
    """{role: llama_role(role)}, simulated in one plain process (transformers imported once)."""
    return evaluated("{**{r: t.llama_role(r) for r in t.ROLES}, 'recomputed': t.llama_role('middle', True)}",
                     "test_plan_confirmed")


@pytest.mark.parametrize("role", list(ROLES))
def test_a_rank_of_each_role_of_the_planned_405b_job_at_128k_holds_and_sends_what_the_planner_priced(
        role, llama_roles):
    """Llama 3 405B at 128K tokens on 16384 H100s, as planned (sep64 ring x mp8 x pp32, vpp2,
    sequence parallel, ZeRO-0): one rank of `role` on meta against the planner's figures."""
    got = llama_roles[role]
    plan = _plan()
    assert plan.estimate.layout.shape.zero == 0 and plan.degrees["dp"] == 1  # the checks below are this layout's
    terms, at = _priced(plan, role), (1, 0)  # one layer, none recomputed
    cp, tp = plan.degrees["sep"], plan.degrees["mp"]
    assert got["rank"] == ROLES[role] * cp * tp  # the stage's first rank
    params, grads, states, peak = got["after_backward"]
    # the states: exact (AdamW adds a 4-byte step per tensor)
    assert params == pytest.approx(terms.memory["params"].at(*at), rel=1e-6)
    assert grads == params  # fp32 gradients of the pieces
    assert got["after_step"][2] == pytest.approx(terms.memory["optimizer"].at(*at), rel=1e-6)
    log = got["log"]
    # tensor parallel (sequence parallel): per layer the attention's and the MLP's inputs gathered
    # and their outputs reduce-scattered, forward and backward; the final norm and the head one
    # more; the embedding's hidden split turned into a sequence split, an all-to-all each way
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        priced = terms.micro_bytes.get(op, Affine()).at(*at) * (tp - 1) / tp  # a rank sends (n - 1) / n of it
        assert _sent(log, op, tp) == pytest.approx(priced), (role, op)
    # the ring: this rank's K and V sent cp - 1 hops forward, again in backward, and their
    # gradients a full turn home
    kv = LLAMA_405B_128K.seq // cp * 4 * 2 * LLAMA_405B_128K.kv_dim // tp
    assert _sent(log, "send", 2) == terms.micro_bytes["send"].at(*at) == (3 * cp - 2) * kv
    # the gradients all-reduced over the sep ranks (the norms' over sep x mp: sequence parallel
    # leaves them partial over mp too), 2 (n - 1) / n of them sent
    reduced = _sent(log, "all_reduce", cp) + _sent(log, "all_reduce", cp * tp)
    assert reduced == pytest.approx(terms.end_bytes["all_reduce"].at(*at) * 2 * (cp - 1) / cp, rel=1e-5)
    # nothing else but a few bytes: the loss and the vocabulary-parallel cross entropy's row
    # maxima and sums
    counted = {("all_gather", tp), ("reduce_scatter", tp), ("all_to_all", tp), ("send", 2), ("recv", 2),
               ("all_reduce", cp), ("all_reduce", cp * tp)}
    rest = [(o, k, b) for o, k, b, _ in log if (o, k) not in counted]
    assert sum(b for _, _, b in rest) < 64e3, rest
    # activations: what autograd saved at most, against the planner's one layer (and on the
    # last stage the head's): within 1% (the rest is the token ids, the rotary tables, the
    # attention's log-sum-exp); on the last stage the planner adds 8 bytes a logit for the
    # backward's transients (the softmax's gradient, half-precision logits), which no saved
    # tensor shows: a rank saves the fp32 log-probabilities alone
    priced = terms.memory["activations"].at(*at)
    if role == "last":
        priced -= LLAMA_405B_128K.seq // cp * LLAMA_405B_128K.vocab // tp * 8
    assert peak == pytest.approx(priced, rel=0.01), (role, peak, priced)


def test_a_layer_the_405b_plan_recomputes_holds_its_input_and_runs_its_forward_again_as_priced(llama_roles):
    """The plan recomputes one layer on stages 1-8: a middle rank with its layer checkpointed
    holds the layer's input for backward, as the planner prices a recomputed layer of a
    micro-batch in flight; its forward's gathers, reduce-scatters and ring sends run twice.
    (The recomputation's own saved tensors, in backward, are kept by checkpointing's hooks,
    which `simulate`'s tracking does not see: the planner's working layer stands for them.)"""
    plan = _plan()
    assert any(plan.estimate.layout.recompute)
    tp = plan.degrees["mp"]
    got, plain = llama_roles["recomputed"], llama_roles["middle"]
    terms = _priced(plan, "middle")
    one_held = dataclasses.replace(plan.estimate.layout.shape, precision="fp32", pp=3, vpp=1, micro_batches=1)
    stage = stage_terms(plan.spec, H100, one_held, 1)  # a middle stage holding one micro-batch
    held = stage.memory["activations"].at(1, 1) - terms.memory["activations"].at(1, 1)  # less the working layer
    assert got["after_backward"][3] == pytest.approx(held, rel=0.01)
    for op, group in (("all_gather", tp), ("reduce_scatter", tp), ("send", 2)):
        share = (tp - 1) / tp if group == tp else 1
        assert _sent(got["log"], op, group) == pytest.approx(terms.micro_bytes[op].at(1, 1) * share), op
        assert _sent(got["log"], op, group) > _sent(plain["log"], op, group)
    assert got["after_backward"][:3] == plain["after_backward"][:3]


def test_the_planned_attention_layers_keep_sequence_parallel_beside_context_parallel():
    """Under sequence parallel the attention layer's entry gathers its input's sequence over
    "mp" for the column projections; context parallel's entry goes beside it, not in its place
    (in its place the projections' inputs were gathered over "sep" instead: 16.9 GB a layer)."""
    entry = _plan().config["mp_config"]["parallelize_plan"]["model.layers.*.self_attn"]
    assert [type(e).__name__ for e in entry] == ["SequenceParallelDisable", "ContextParallel"]
    assert entry[1].backend == "p2p"


def test_the_pinned_405b_layout_is_the_one_the_search_chooses():
    found = dist.plan(LLAMA_405B_128K, world_size=WORLD, global_batch=128, device="h100")
    assert found.name == _plan().name and found.estimate.layout == _plan().estimate.layout


# DeepSeek-V3's layout with expert parallel: pipeline pinned to 16 stages without tensor or
# context parallel (the plain search prefers dp16 x mp4 x pp32 with every expert on every
# rank); the search splits the 256 experts over all 64 dp ranks of a stage, 4 a rank
DEEPSEEK_EP = {"mp": 1, "pp": 16, "zero": 1, "cp": 1, "vpp": 1}
# DeepSeek-V3's routing (256 experts, top-8 in 4 of 8 groups, one shared expert) with small
# matrices: what a token sends is its hidden state, k times, and that scales with the hidden size
SMALL_DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                      n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=0,
                      q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def _deepseek_plan():
    return dist.plan(PRESETS["deepseek-v3"], world_size=1024, global_batch=4096, device="h100", fixed=DEEPSEEK_EP)


def deepseek_rank() -> dict:
    """The first rank of the DeepSeek-V3 plan's second stage, simulated on meta (the routing
    taken as balanced, the planner's assumption: meta tensors have no values to route by) on
    a DeepSeek-V3 of small matrices and one MoE layer: its experts' pieces, and its
    collectives as [op, group size, bytes, shape] over one micro-batch (a 4K sequence) forward
    and backward and the step."""
    import numpy as np
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    plan = _deepseek_plan()
    mesh = plan.mesh()
    ids = np.array(mesh.process_ids).reshape(mesh.shape)[1]
    sub = dist.ProcessMesh(ids.reshape(-1).tolist(), dim_names=["dp"])  # the stage's dp ranks (mp 1)
    seq, dp = PRESETS["deepseek-v3"].seq, plan.degrees["dp"]
    config = {k: v for k, v in plan.config.items() if k != "pp_config"}
    cfg = DeepseekV3Config(max_position_embeddings=seq, **SMALL_DEEPSEEK)
    _unmasked_sdpa(cfg)
    with dist.simulate(1024, int(ids.flat[0])):
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), sub, config)
        tokens = dist.dtensor_from_local(torch.zeros(1, seq, dtype=torch.long, device="meta"), sub, [dist.Shard(0)],
                                         shape=(dp, seq))
        with dist.comm_log() as log:
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
    return {"degrees": plan.degrees,
            "experts": {n: list(p._local.shape) for n, p in model.named_parameters() if ".experts." in n},
            "params": sum(p._local.numel() for p in model.parameters()),
            "log": [[r.op, len(r.ranks), r.bytes, list(r.shape)] for r in log]}


def test_a_rank_of_the_planned_deepseek_v3_expert_parallel_job_sends_each_token_twice_each_way():
    got = evaluated("t.deepseek_rank()", "test_plan_confirmed")
    dp, ep = got["degrees"]["dp"], got["degrees"]["ep"]
    assert ep == dp == 64
    cfg = SMALL_DEEPSEEK
    h, experts, k = cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    spec = TransformerSpec(layers=1, hidden=h, heads=4, kv_heads=4, ffn=cfg["intermediate_size"], vocab=128,
                           seq=PRESETS["deepseek-v3"].seq, experts=experts, top_k=k,
                           expert_ffn=cfg["moe_intermediate_size"], shared_experts=1)
    shape = dataclasses.replace(_deepseek_plan().estimate.layout.shape, precision="fp32", pp=1)
    terms = role_terms(spec, H100, shape, False, False)
    # the experts' pieces: experts / ep of each grouped weight, the planner's share
    pieces = got["experts"]
    assert all(s[0] == experts // ep for s in pieces.values()), pieces
    assert sum(torch.Size(s).numel() for s in pieces.values()) == spec.layer_expert_params() / ep
    # each token's hidden state to its top-k experts' ranks and back, forward and backward:
    # four all-to-alls of the rank's tokens x k rows, of which the rows for its own experts
    # (1 / ep of them, routed balanced) stay
    log = got["log"]
    moved = [(b, s) for o, n, b, s in log if o == "all_to_all" and len(s) == 2 and s[1] == h]
    assert len(moved) == 4 and all(s[0] == spec.seq * k for _, s in moved), moved
    assert sum(s[0] * h * 4 for _, s in moved) == terms.micro_bytes["all_to_all"].at(1, 0)
    assert all(b == s[0] * h * 4 * (ep - 1) // ep for b, s in moved), moved
    # besides them only the per-expert counts, and ZeRO-1 over dp of the other parameters: an
    # expert's gradient lives on its one rank (dp / ep = 1), nothing gathers or reduces it
    assert [s for o, n, b, s in log if o == "all_to_all" and (b, s) not in moved] == [[experts]]
    expert_elements = sum(torch.Size(s).numel() for s in pieces.values())
    reduced = sum(torch.Size(s).numel() for o, n, b, s in log if o in ("reduce_scatter", "all_reduce") and n == dp
                  and torch.Size(s).numel() > 2)  # (the loss and its token count aside)
    assert reduced == got["params"] - expert_elements


# a dense DeepSeek-V3 layer (latent attention, a SwiGLU MLP) of small matrices, its value heads
# as wide as its query and key heads: torch's fused CPU attention needs that (a GPU's does not,
# and DeepSeek-V3's 128 against 192 take the fused kernel there); with narrower values sdpa
# here runs as its math ops, keeping every sequence's scores
SMALL_MLA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=16)
MLA_SEQ = 4096


def latent_attention_layer() -> dict:
    """One middle pipeline rank holding that layer alone (no embedding, final norm or head),
    one rank, simulated on meta: one 4K-token micro-batch forward and backward; its parameter
    bytes and the peak of what autograd saved."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(max_position_embeddings=MLA_SEQ, **SMALL_MLA)
    _unmasked_sdpa(cfg)
    h = cfg.hidden_size
    with dist.simulate(1, 0) as sim:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
        model.lm_head, model.model.norm, model.model.embed_tokens = None, torch.nn.Identity(), None
        mesh = dist.ProcessMesh([0], dim_names=["dp"])
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), mesh,
                                      {"dp_config": {"sharding_level": 0}})
        received = dist.dtensor_from_local(torch.zeros(1, MLA_SEQ, h, device="meta"), mesh, [dist.Shard(0)],
                                           shape=(1, MLA_SEQ, h)).requires_grad_()
        out = model.model(inputs_embeds=received).last_hidden_state
        out.backward(dist.dtensor_from_local(torch.zeros_like(out._local), mesh, out.placements, shape=out.shape))
        params, _, _, peak = dataclasses.astuple(sim.memory(model, opt))
    return {"params": params, "peak": peak}


def test_a_latent_attention_layer_holds_what_the_planner_prices():
    """DeepSeek-V3's latent attention priced by its own dimensions (`LatentAttention`), not as
    plain heads: a dense layer's parameters exactly, and what autograd saves within 0.5% once
    the few things the planner leaves out are added (per token: the rotary tables, the
    attention's log-sum-exp per head, each of the four norms' scale)."""
    got = evaluated("t.latent_attention_layer()", "test_plan_confirmed")
    c = SMALL_MLA
    latent = LatentAttention(q_lora=c["q_lora_rank"], kv_lora=c["kv_lora_rank"], rope_dim=c["qk_rope_head_dim"],
                             nope_dim=c["qk_nope_head_dim"], v_dim=c["v_head_dim"])
    spec = TransformerSpec(layers=1, hidden=c["hidden_size"], heads=c["num_attention_heads"],
                           kv_heads=c["num_key_value_heads"], ffn=c["intermediate_size"], vocab=c["vocab_size"],
                           seq=MLA_SEQ, latent=latent)
    terms = role_terms(spec, H100, Shape(dp=1, tp=1, pp=1, micro_batch=1, micro_batches=1, precision="fp32"),
                       False, False)
    assert got["params"] == terms.memory["params"].at(1, 0) == 4 * spec.layer_params()
    left_out = MLA_SEQ * 4 * (2 * latent.rope_dim + spec.heads + 4)
    assert got["peak"] == pytest.approx(terms.memory["activations"].at(1, 0) + left_out, rel=0.005)
    # at DeepSeek-V3's own sizes its attention keeps 3.4 times what plain heads of its hidden
    # size would (how the planner priced it before)
    deepseek = PRESETS["deepseek-v3"]
    plain = dataclasses.replace(deepseek, latent=None)
    assert sum(deepseek.attention_saved()) > 3.3 * sum(plain.attention_saved())


def deepseek_moe_layer() -> dict:
    """The DeepSeek-V3 plan's expert-parallel rank (`deepseek_rank`'s) holding one MoE layer
    alone (no embedding, final norm or head), its value heads as wide as its query heads (see
    SMALL_MLA), simulated on meta: one 4K-token micro-batch forward and backward; its parameter
    bytes and the peak of what autograd saved."""
    import numpy as np
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    plan = _deepseek_plan()
    ids = np.array(plan.mesh().process_ids).reshape(plan.mesh().shape)[1]
    sub = dist.ProcessMesh(ids.reshape(-1).tolist(), dim_names=["dp"])
    seq, dp = PRESETS["deepseek-v3"].seq, plan.degrees["dp"]
    config = {k: v for k, v in plan.config.items() if k != "pp_config"}
    cfg = DeepseekV3Config(max_position_embeddings=seq, **dict(SMALL_DEEPSEEK, v_head_dim=16))
    _unmasked_sdpa(cfg)
    h = cfg.hidden_size
    with dist.simulate(1024, int(ids.flat[0])) as sim:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(cfg)
        model.lm_head, model.model.norm, model.model.embed_tokens = None, torch.nn.Identity(), None
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), sub, config)
        received = dist.dtensor_from_local(torch.zeros(1, seq, h, device="meta"), sub, [dist.Shard(0)],
                                           shape=(dp, seq, h)).requires_grad_()
        out = model.model(inputs_embeds=received).last_hidden_state
        out.backward(dist.dtensor_from_local(torch.zeros_like(out._local), sub, out.placements, shape=out.shape))
        params, _, _, peak = dataclasses.astuple(sim.memory(model, opt))
    return {"params": params, "peak": peak}


def test_the_planned_expert_parallel_rank_holds_what_the_planner_prices():
    """The DeepSeek-V3 plan's expert-parallel rank with one MoE layer of latent attention and
    256 experts (top-8 of them, 4 on this rank, one shared expert): its parameters exactly,
    and what autograd saves within 0.5% once the few things the planner leaves out (as for the
    dense layer) are added: the experts' inner tensors, the dispatched and combined rows and
    the routing's scores, indices and weights as priced."""
    got = evaluated("t.deepseek_moe_layer()", "test_plan_confirmed")
    c = dict(SMALL_DEEPSEEK, v_head_dim=16)
    latent = LatentAttention(q_lora=c["q_lora_rank"], kv_lora=c["kv_lora_rank"], rope_dim=c["qk_rope_head_dim"],
                             nope_dim=c["qk_nope_head_dim"], v_dim=c["v_head_dim"])
    seq = PRESETS["deepseek-v3"].seq
    spec = TransformerSpec(layers=1, hidden=c["hidden_size"], heads=c["num_attention_heads"],
                           kv_heads=c["num_key_value_heads"], ffn=c["intermediate_size"], vocab=c["vocab_size"],
                           seq=seq, experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
                           expert_ffn=c["moe_intermediate_size"], shared_experts=c["n_shared_experts"], latent=latent)
    shape = dataclasses.replace(_deepseek_plan().estimate.layout.shape, precision="fp32", pp=1)
    terms = role_terms(spec, H100, shape, False, False)
    assert got["params"] == terms.memory["params"].at(1, 0)
    left_out = seq * 4 * (2 * latent.rope_dim + spec.heads + 4)
    assert got["peak"] == pytest.approx(terms.memory["activations"].at(1, 0) + left_out, rel=0.005)
