"""The analytic transformer accounting against formulas worked by hand."""
import dataclasses

import pytest
import torch

from autopar.planner.cost import H100, collective_time, matmul_time
from autopar.planner.model import Layout, Shape, TransformerSpec, evaluate, pipeline_time, stage_terms

LLAMA70B = TransformerSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=4096)
SMALL = TransformerSpec(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=4096, vocab=32000, seq=2048)


def _layout(spec=SMALL, stages=None, recompute=None, **shape):
    shape = Shape(**{"dp": 1, "tp": 1, "pp": 1, "micro_batch": 1, "micro_batches": 1, **shape})
    stages = stages or tuple([spec.layers // shape.pp] * shape.pp)
    return Layout(shape, stages, recompute or (0,) * shape.pp)


def test_llama3_70b_has_70_6b_parameters():
    h, kv, f, v = 8192, 1024, 28672, 128256
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    assert LLAMA70B.params() == 80 * per_layer + 2 * v * h + h
    assert round(LLAMA70B.params() / 1e9, 1) == 70.6


@pytest.mark.parametrize("zero, weights, grads, states", [
    (0, 2, 4, 12), (1, 2, 4, 12 / 4), (2, 2, 4 / 4, 12 / 4), (3, 2 / 4, 4 / 4, 12 / 4),
])
def test_model_states_per_rank_under_each_zero_level(zero, weights, grads, states):
    est = evaluate(SMALL, H100, _layout(dp=4, zero=zero))
    n = SMALL.params()
    assert est.memory["grads"] == pytest.approx(grads * n)
    assert est.memory["optimizer"] == pytest.approx(states * n)
    gathered = 2 * SMALL.layer_params() * 2 * (1 - 1 / 4) if zero == 3 else 0  # two layers gathered at a time
    assert est.memory["params"] == pytest.approx(weights * n + gathered)
    assert est.memory["reserved"] == H100.reserved_bytes


def test_tensor_and_pipeline_parallel_split_the_weights():
    est = evaluate(SMALL, H100, _layout(tp=2, pp=2))
    h, kv, f, v = 1024, 512, 4096, 32000
    layer = (2 * h * h + 2 * h * kv + 3 * h * f) / 2 + 2 * h  # matrices split over tp, norms whole
    first, last = 2 * layer + v * h / 2, 2 * layer + v * h / 2 + h  # the final norm whole too
    assert est.memory["params"] == pytest.approx(2 * max(first, last))
    assert est.memory["optimizer"] == pytest.approx(12 * max(first, last))


def test_activations_per_layer_with_and_without_recompute():
    b, s, h, kv, f, v = 2, 2048, 1024, 512, 4096, 32000
    # bf16: the norms' inputs and normalized inputs, the attention's and the MLP's inputs, q k v,
    # the attention output and its contiguous copy, the MLP's gate, its activation, up, their product
    per_layer = 2 * b * s * (4 * h + 2 * h + 3 * h + 2 * kv + 4 * f)
    layer_input = 2 * b * s * h
    logits = b * s * v * (2 + 8) + 2 * b * s * 3 * h  # and the head's input, the final norm's two
    embedding_out = 2 * b * s * h
    est = evaluate(SMALL, H100, _layout(micro_batch=b, micro_batches=4))
    assert est.memory["activations"] == pytest.approx(4 * per_layer + per_layer + logits + embedding_out)
    est = evaluate(SMALL, H100, _layout(micro_batch=b, micro_batches=4, recompute=(3,)))
    assert est.memory["activations"] == pytest.approx(per_layer + 3 * layer_input + per_layer + logits + embedding_out)


def test_sequence_parallel_splits_the_norm_activations_too():
    b, s, h, kv, f = 1, 2048, 1024, 512, 4096
    no_sp = evaluate(SMALL, H100, _layout(tp=4, pp=2, micro_batches=8)).memory_per_stage[1]
    sp = evaluate(SMALL, H100, _layout(tp=4, pp=2, micro_batches=8, sequence_parallel=True)).memory_per_stage[1]
    saved_per_layer = 2 * b * s * 4 * h * (1 - 1 / 4)
    final_norm = 2 * b * s * 2 * h * (1 - 1 / 4)
    # stage 1 of 2 keeps one micro-batch in flight + the working layer; the head's input is whole
    assert no_sp - sp == pytest.approx(2 * saved_per_layer + saved_per_layer + final_norm)


def test_1f1b_bubble():
    t, p, m = 0.5, 4, 12
    assert pipeline_time([t] * p, [0.0] * p, m) == pytest.approx((m + p - 1) * t)
    bubble = (pipeline_time([t] * p, [0.0] * p, m) - m * t) / pipeline_time([t] * p, [0.0] * p, m)
    assert bubble == pytest.approx((p - 1) / (m + p - 1))


def test_interleaving_cuts_the_fill_by_vpp_and_holds_what_its_order_holds():
    from autopar.pipelining import orders
    from autopar.planner.model import held_micro_batches

    t, p, m, v = 0.5, 4, 12, 2
    # Narayanan et al.: the bubble of interleaved 1F1B is (p - 1) / v micro-batch times
    assert pipeline_time([t] * p, [0.0] * p, m, v) == pytest.approx((m + (p - 1) / v) * t)
    plain = _layout(pp=p, micro_batches=m).shape
    inter = _layout(pp=p, micro_batches=m, vpp=v).shape
    assert [held_micro_batches(plain, s) for s in range(p)] == [4, 3, 2, 1]
    peaks = orders.peak_held(orders.interleaved(p, v, m))  # chunk activations held, per rank
    assert [held_micro_batches(inter, s) for s in range(p)] == [k / v for k in peaks]
    assert held_micro_batches(inter, 0) > held_micro_batches(plain, 0)  # the price of a smaller bubble


def test_single_rank_step_time_is_flops_at_the_device_rate():
    b, s, h, kv, f, v, m = 1, 2048, 1024, 512, 4096, 32000, 3
    spec = dataclasses.replace(SMALL, layer_ops=0, other_ops=0)  # no host cost: the device's time alone
    est = evaluate(spec, H100, _layout(spec, micro_batch=b, micro_batches=m))
    tokens = b * s
    layer_fwd_flops = 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * tokens * s * h
    layer_fwd = matmul_time(layer_fwd_flops, 8, H100) + 2 * tokens * (10 * h + 2 * (h + kv) + 4 * f) / H100.hbm_bandwidth
    head = matmul_time(6 * tokens * h * v, 3, H100) + 3 * tokens * v * 10 / H100.hbm_bandwidth
    embedding = 3 * tokens * h * 2 / H100.hbm_bandwidth
    adam = SMALL.params() * 30 / H100.hbm_bandwidth
    assert est.step_time == pytest.approx(m * (4 * 3 * layer_fwd + head + embedding) + adam)
    assert est.mfu == pytest.approx(SMALL.flops_per_token() * m * tokens / (989e12 * est.step_time))
    assert est.bytes_per_step == {}


def test_host_time_adds_on_a_cpu_and_hides_behind_the_device_on_a_gpu():
    """Each forward op costs three aten ops, two distributed dispatches and an autograd node
    over forward and backward.  A CPU adds that to its compute, ranks sharing its cores slow
    it all; a GPU's host only counts where it outlasts the device."""
    quiet = dataclasses.replace(SMALL, layer_ops=0, other_ops=0)
    busy = dataclasses.replace(SMALL, layer_ops=100, other_ops=0)
    cpu = dataclasses.replace(H100, host_overlaps=False, op_latency=5e-6, autograd_node=10e-6, dispatch_overhead=30e-6)
    layer = 100 * (3 * 5e-6 + 2 * 30e-6 + 10e-6)
    for tp in (1, 2):
        step = lambda spec, dev: evaluate(spec, dev, _layout(spec, tp=tp)).step_time  # noqa: E731
        assert step(busy, cpu) - step(quiet, cpu) == pytest.approx(SMALL.layers * layer)
    gpu_extra = evaluate(busy, H100, _layout(busy)).step_time - evaluate(quiet, H100, _layout(quiet)).step_time
    device = stage_terms(quiet, H100, _layout(quiet).shape, 0).micro_time["compute"].per_layer
    gpu_layer = 100 * (3 * H100.op_latency + 2 * H100.dispatch_overhead + H100.autograd_node)
    assert gpu_extra == pytest.approx(SMALL.layers * max(0.0, gpu_layer - device))
    crowded = dataclasses.replace(cpu, cores=2, ranks_per_node=1 << 16)
    one, four = (evaluate(busy, crowded, _layout(busy, dp=d)) for d in (1, 8))
    assert four.time["host"] == pytest.approx(4 * one.time["host"])  # 8 ranks on 2 cores


def test_collective_bytes_and_time_per_step():
    b, s, h, m = 1, 2048, 1024, 2
    act = 2 * b * s * h
    est = evaluate(SMALL, H100, _layout(dp=2, tp=4, micro_batches=m, zero=1, sequence_parallel=True))
    # per layer: 4 gathers and 4 reduce-scatters (forward and backward), + the head's; the
    # embedding's hidden split to the sequence split an all-to-all each way
    assert est.bytes_per_step["reduce_scatter"] == pytest.approx(m * (4 * 4 + 1) * act + 2 * _shard_params(4))
    assert est.bytes_per_step["all_to_all"] == pytest.approx(m * 2 * act / 4)
    assert est.time["tp_comm"] == pytest.approx(2 * m * (4 * 4 + 1) * collective_time("all_gather", act, 4, H100)
                                                + 2 * m * collective_time("all_to_all", act / 4, 4, H100))
    est = evaluate(SMALL, H100, _layout(dp=2, tp=4, micro_batches=m))
    assert est.bytes_per_step["all_reduce"] == pytest.approx(m * (4 * 4 + 2) * act + 2 * _shard_params(4))
    assert est.time["dp_comm"] == pytest.approx(collective_time("all_reduce", 2 * _shard_params(4), 2, H100, 4))


def _shard_params(tp):
    return SMALL.layers * (SMALL.layer_split_params() / tp + SMALL.layer_replicated_params()) + (
        SMALL.embedding_params() + SMALL.head_params() - SMALL.hidden) / tp + SMALL.hidden  # the final norm whole


def test_hand_config_for_llama3_70b_on_1024_h100_fits_with_plausible_mfu():
    est = evaluate(LLAMA70B, H100, _layout(LLAMA70B, dp=32, tp=8, pp=4, micro_batches=32, zero=1,
                                           sequence_parallel=True), memory_limit=80e9)
    assert est.fits and 0.3 < est.mfu < 0.5


def test_a_bad_stage_split_is_refused():
    with pytest.raises(ValueError, match=r"stage_layers \(3, 3\) must split 4 layers into 2 stages"):
        evaluate(SMALL, H100, _layout(pp=2, stages=(3, 3)))


def test_describe_counts_a_layers_ops_without_touching_the_model():
    """The host cost is priced per aten op: describe counts one block's forward and the rest
    on a short sequence (eval mode, no gradients, the random stream put back)."""
    import hf_llama
    from autopar.planner import describe

    model = hf_llama.tiny_llama()
    model.train()
    state = torch.random.get_rng_state()
    spec, _ = describe(model)
    assert 60 < spec.layer_ops < 200 and 10 < spec.other_ops < 100, spec  # HF Llama: ~100 and ~50
    assert model.training and torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
