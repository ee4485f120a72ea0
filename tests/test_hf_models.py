"""HuggingFace architectures beyond Llama, tiny and built from configs (no download), trained
through `parallelize` over 2 ranks against the single-process run: GPT-2 (Conv1D layers with
[in, out] weights, a fused qkv projection, tied LM head), Qwen2 (GQA, biases on q/k/v), BERT
(post-norm encoder, masked-LM head tied to the embeddings), T5 (relative position bias shared
by the blocks, encoder-decoder) and BART (learned positions, cross-attention); and the
mixture-of-experts models Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (a top-k router, the
experts' grouped weights run through _grouped_mm; DeepSeek-V3 with latent attention, a dense
first layer and grouped routing) under data parallel."""
import pytest
import torch

import autopar as dist
from autopar.placement import Shard
from autopar.tensor import riders
from distpool import run_dist
from hf_llama import FFN, HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB, assert_matches, batches, mp_plan, optimizer, train

S0 = Shard(0)
# dropout off: the parallel run's RNG stream is not the single process's
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "t5": dict(dropout_rate=0.0), "bart": dict(dropout=0.0)}


def _config(name):
    import transformers as hf

    if name == "gpt2":
        return hf.GPT2LMHeadModel, hf.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=2, n_head=HEADS, n_positions=4 * SEQ,
            bos_token_id=0, eos_token_id=0, **NO_DROPOUT[name])
    if name == "qwen2":
        return hf.Qwen2ForCausalLM, hf.Qwen2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ)
    if name == "t5":
        return hf.T5ForConditionalGeneration, hf.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=2, num_heads=HEADS,
            decoder_start_token_id=0, pad_token_id=0, **NO_DROPOUT[name])
    if name == "bart":
        return hf.BartForConditionalGeneration, hf.BartConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=FFN,
            decoder_ffn_dim=FFN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            max_position_embeddings=4 * SEQ, **NO_DROPOUT[name])
    if name == "mixtral":
        return hf.MixtralForCausalLM, hf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=4 * SEQ)
    if name == "qwen2_moe":
        return hf.Qwen2MoeForCausalLM, hf.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN // 2,
            shared_expert_intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, num_experts=4, num_experts_per_tok=2, max_position_embeddings=4 * SEQ)
    if name == "qwen3_moe":
        return hf.Qwen3MoeForCausalLM, hf.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN // 2,
            num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=4 * SEQ)
    if name == "deepseek_v3":  # multi-head latent attention, a dense first layer, grouped routing
        return hf.DeepseekV3ForCausalLM, hf.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN // 2,
            num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
            max_position_embeddings=4 * SEQ)
    return hf.BertForMaskedLM, hf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, max_position_embeddings=4 * SEQ, **NO_DROPOUT[name])


def tiny(name, seed=0, attention="eager", padded=False, **config):
    """A freshly initialised tiny model of architecture `name` (fp32), with HF's attention
    implementation `attention` and `config` on top of the tiny config; `padded`: every call
    gets a padding mask (rows 1 and 3 of a batch of 4 left-padded)."""
    cls, cfg = _config(name)
    cfg._attn_implementation = attention
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg)
    if padded:
        mask = torch.ones(4, SEQ, dtype=torch.long)
        mask[1, :5] = mask[3, :9] = 0
        model.register_forward_pre_hook(lambda _m, args, kw: (args, {**kw, "attention_mask": mask}), with_kwargs=True)
    return model


def tp_plan(name) -> dict:
    """Megatron's plan keyed by the model's own layer names: the projections into attention
    and the MLP by columns, the ones out of them by rows, the LM head by vocabulary."""
    if name == "qwen2":
        return mp_plan()
    col, row = dist.ColWiseParallel(), dist.RowWiseParallel()
    if name == "gpt2":
        layer = r"transformer\.h\.\d+\."
        # c_attn computes q, k, v side by side: each split alike, every rank holds its heads of each
        return {layer + "attn.c_attn": dist.ColWiseParallel(fused=3), layer + "attn.c_proj": row,
                layer + "mlp.c_fc": col, layer + "mlp.c_proj": row, "lm_head": col}
    if name == "t5":
        block = r"(en|de)coder\.block\.\d+\.layer\.\d\."
        attention = block + r"(SelfAttention|EncDecAttention)\."
        return {attention + "(q|k|v)": col, attention + "o": row,
                block + r"DenseReluDense\.wi": col, block + r"DenseReluDense\.wo": row, "lm_head": col,
                # the relative position bias table [buckets, heads] by columns: by heads, as the scores
                block + r"SelfAttention\.relative_attention_bias": col}
    if name == "bart":
        layer = r"model\.(en|de)coder\.layers\.\d+\."
        attention = layer + r"(self_attn|encoder_attn)\."
        return {attention + "(q|k|v)_proj": col, attention + "out_proj": row,
                layer + "fc1": col, layer + "fc2": row, "lm_head": col}
    layer = r"bert\.encoder\.layer\.\d+\."
    return {layer + r"attention\.self\.(query|key|value)": col, layer + r"attention\.output\.dense": row,
            layer + r"intermediate\.dense": col, layer + r"output\.dense": row, "cls.predictions.decoder": col}


def reference(name, **variant):
    """The single-process run: losses, final weights, full gradients per step (`variant`:
    tiny's keywords)."""
    model, grads = tiny(name, **variant), []
    losses = train(model, optimizer(model.parameters()), batches(), grads=grads)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def _parallel(name, config, dims, **variant):
    """The same run through parallelize on 2 ranks; also the collectives of its last step."""
    mesh = dist.ProcessMesh([0, 1], dim_names=dims)
    model = tiny(name, **variant)
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    data, grads = batches(), []
    losses = train(model, opt, data[:-1], grads=grads)
    with dist.comm_log() as log:  # forward, backward and update only (reading gradients gathers them)
        losses += train(model, opt, data[-1:])
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logits = model(input_ids=data[0][0], labels=data[0][1]).logits.placements
    return (losses, weights, grads), [(r.op, r.bytes) for r in log], pbytes, logits


MODELS = ["gpt2", "qwen2", "bert", "t5", "bart"]


def _bytes(comm, op):
    return [b for o, b in comm if o == op]


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("name", MODELS)
def test_data_parallel_matches_one_process(name, level):
    """parallelize marks the batch Shard(0) over dp and it stays split to the logits.  A step
    after the first few gathers no activation: every all-reduce but the gradient bucket is a
    scalar of the loss; under ZeRO-3 each reduce-scatter moves one unit's gradients, each
    all-gather fetches a unit's parameters (one of those sizes), in all at most every
    parameter twice (forward and backward)."""
    ref = reference(name)
    for got, comm, pbytes, logits in run_dist(_parallel, 2, name, {"dp_config": {"sharding_level": level}}, ["dp"]):
        assert_matches(got, ref)
        assert logits == [S0], logits
        assert {op for op, _ in comm} <= {"send", "recv", "all_reduce", "all_gather", "reduce_scatter"}, comm
        scalars = [b for b in _bytes(comm, "all_reduce") if b <= 8]
        if level == 0:
            assert _bytes(comm, "all_gather") == [] and _bytes(comm, "reduce_scatter") == [], comm
            # (the bucket may carry the mean loss's (sum, count): `deferred_mean`)
            buckets = [b for b in _bytes(comm, "all_reduce") if b > 8]
            assert buckets in ([pbytes], [pbytes + 4 * (riders.PIECES + 1)]), (pbytes, comm)
        else:
            assert _bytes(comm, "all_reduce") == scalars, comm
            assert sum(_bytes(comm, "reduce_scatter")) == pbytes // 2, (pbytes, comm)
            assert set(_bytes(comm, "all_gather")) <= set(_bytes(comm, "reduce_scatter")), comm
            # (T5's blocks hand back the position bias they were given: it is no sign of the
            # block's backward, which would otherwise gather it once more)
            assert sum(_bytes(comm, "all_gather")) <= pbytes, (pbytes, comm)


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_matches_one_process(name):
    """Megatron's communication: a step reduces activations and gradients, it gathers no
    activation (GPT-2's fused q/k/v included: ColWiseParallel(fused=3))."""
    ref = reference(name)
    for got, comm, *_ in run_dist(_parallel, 2, name, {"mp_config": {"parallelize_plan": tp_plan(name)}}, ["mp"]):
        assert_matches(got, ref)
        gathered = [c for c in comm if c[0] in ("all_gather", "all_to_all")]
        assert not gathered, comm


def test_plans_split_hf_conv1d_weights_laid_out_in_by_out():
    """GPT-2's Conv1D computes x @ w + b with w [in, out]: by columns it is split on its last
    dim (with its bias), by rows on its first (its bias added once, after the reduction)."""
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(12, 4)
    assert list(layer.weight.shape) == [4, 12]
    assert dist.ColWiseParallel().param_dims(layer, "c_attn") == {"weight": -1, "bias": -1}
    assert dist.RowWiseParallel().param_dims(layer, "c_proj") == {"weight": 0, "bias": None}


# Qwen2 with a single kv head: the column plan splits its head dim, HF's repeat_kv expands it
# (stride 0) and the attention, split by heads, gets k, v pieces laid out with the heads innermost
PADDED = {"gpt2": {}, "qwen2": {"num_key_value_heads": 1}, "bert": {}, "t5": {}, "bart": {}}


@pytest.mark.parametrize("dims", [["dp"], ["mp"]], ids=["dp", "mp"])
@pytest.mark.parametrize("name", MODELS)
def test_sdpa_with_a_padding_mask_matches_one_process(name, dims):
    """HF's sdpa attention and masks built from a padded batch (the mask a plain tensor: under
    dp it is sliced with the batch)."""
    variant = dict(attention="sdpa", padded=True, **PADDED[name])
    ref = reference(name, **variant)
    setup = ({"dp_config": {"sharding_level": 0}} if dims == ["dp"]
             else {"mp_config": {"parallelize_plan": tp_plan(name)}})
    for got, *_ in run_dist(_parallel, 2, name, setup, dims, **variant):
        assert_matches(got, ref)


def test_sdpa_kernel_gives_the_cpu_flash_op_a_contiguous_last_dim():
    """The CPU flash op reads q, k, v, grad_out and out as if their last dim were contiguous;
    a piece laid out with its heads innermost must still give the plain op's numbers."""
    from autopar.spec import DistSpec, TensorMeta
    from autopar.spmd.attention import _BWD, _FWD, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=g) for _ in range(3))
    heads_inner = lambda t: t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # noqa: E731
    assert heads_inner(k).stride(-1) != 1
    spec = DistSpec(dist.ProcessMesh([0, 1]), (Shard(1),), TensorMeta.contiguous((2, 4, 6, 16), torch.float32))
    want = _FWD(q, k, v)
    got = sdpa_kernel(_FWD, [heads_inner(t) for t in (q, k, v)], {}, [spec] * 3, [spec] * 2, (0,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    grad = torch.randn(want[0].shape, generator=g)
    want = _BWD(grad, q, k, v, want[0], want[1], 0.0, False)
    odd = [heads_inner(t) for t in (grad, q, k, v, got[0])]
    got = sdpa_kernel(_BWD, [*odd, got[1], 0.0, False], {}, [spec] * 6, [spec] * 3, (0,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_mixture_of_experts_models_train_data_parallel_as_one_process(name, level):
    """HF's MoE blocks route each token to its top-2 of 4 experts and run the experts' grouped
    weights through _grouped_mm in fp32 (whose meta kernel takes bf16 only): data parallel
    and ZeRO-3 match one process.  Each rank's experts run on its own tokens (a local region,
    spmd/experts.py: op by op they would sort the whole batch's tokens by expert), so the batch
    stays split to the logits."""
    ref = reference(name)
    for got, comm, _, logits in run_dist(_parallel, 2, name, {"dp_config": {"sharding_level": level}}, ["dp"]):
        assert_matches(got, ref)
        assert logits == [S0], logits
        # the batch from the first rank (send/recv), the loss's scalars and the gradients (and
        # ZeRO-3's parameters): no activation gathered
        assert {op for op, _ in comm} <= {"send", "recv", "all_reduce", "all_gather", "reduce_scatter"}, comm
        if level == 0:
            assert not {op for op, _ in comm} & {"all_gather", "reduce_scatter"}, comm


def test_the_experts_rule_vouches_only_for_tokens_split_alike_and_whole_weights():
    from autopar.spec import DistSpec, TensorMeta
    from autopar.spmd.experts import experts_module_rule

    experts = tiny("mixtral").model.layers[0].mlp.experts
    mesh = dist.ProcessMesh([0, 1])
    R = dist.Replicate()

    def spec(shape, placement, dtype=torch.float32):
        return DistSpec(mesh, (placement,), TensorMeta.contiguous(shape, dtype))

    weights = [spec(tuple(p.shape), R) for p in experts.parameters()]
    tokens = (spec((64, HIDDEN), S0), spec((64, 2), S0, torch.long), spec((64, 2), S0))
    assert experts_module_rule(experts, tokens, {}, weights) is tokens[0]
    assert experts_module_rule(experts, tokens[:1] + (spec((64, 2), R, torch.long), tokens[2]), {}, weights) is None
    assert experts_module_rule(experts, (spec((64, HIDDEN), Shard(1)),) + tokens[1:], {}, weights) is None
    assert experts_module_rule(experts, tokens, {}, [spec(tuple(p.shape), S0) for p in experts.parameters()]) is None
    assert experts_module_rule(experts, tuple(spec(t.shape, R, t.meta.dtype) for t in tokens), {}, weights) is None
    assert experts_module_rule(torch.nn.Linear(4, 4), tokens, {}, weights) is None
