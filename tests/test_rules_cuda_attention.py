"""The CUDA attention kernels (flash, memory-efficient, cuDNN) and their backward, checked on
this CPU machine through their meta implementations: the rules' choices without processes,
the kernels run through autopar's dispatch on meta distributed tensors of a simulated job
(batch, heads, 2-D and ZeRO-3 splits, forward and backward, nothing sent), and a HF Llama
step with its attention routed to each kernel sending what the CPU kernel's step sends."""
import contextlib

import pytest
import torch

import autopar as dist
from autopar import ProcessMesh, Replicate, Shard
from autopar.spmd import engine
from plain_process import evaluated
from rulecheck import meta as _m, op_call as _call

aten = torch.ops.aten
R = Replicate()
KERNELS = ("flash", "efficient", "cudnn")


def attention(kernel: str, q, k, v, bias=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None):
    """The output of one CUDA kernel, called as F.scaled_dot_product_attention calls it on a GPU."""
    if kernel == "flash":
        assert bias is None, "the flash kernel takes no mask"
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    op = aten._scaled_dot_product_efficient_attention if kernel == "efficient" else aten._scaled_dot_product_cudnn_attention
    return op(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


def _fwd_call(kernel, q, k, v, bias=None, dropout_p=0.0):
    if kernel == "flash":
        return _call(aten._scaled_dot_product_flash_attention.default, q, k, v, dropout_p, True)
    op = (aten._scaled_dot_product_efficient_attention if kernel == "efficient"
          else aten._scaled_dot_product_cudnn_attention).default
    return _call(op, q, k, v, bias, True, dropout_p, True)


# -- the rules, without processes ------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_and_head_splits_stay_where_they_are(kernel):
    mesh = ProcessMesh([0, 1])
    q = _m(2, 4, 8, 16, dtype=torch.bfloat16)
    call = _fwd_call(kernel, q, q, q)
    for d in (0, 1):
        ins, outs, chosen = engine.choose(call, mesh, [(Shard(d),)] * 3, inplace=False)
        assert ins == [(Shard(d),)] * 3 and outs[:2] == [(Shard(d),)] * 2 and chosen == "sdpa_cuda"
        assert all(o == (R,) for o in outs[2:])  # the philox state and debug outputs: whole
    # query rows do not split here: they move to a batch split (an all-to-all), not gathered
    ins, outs, _ = engine.choose(call, mesh, [(Shard(2),)] * 3, inplace=False)
    assert ins == [(Shard(0),)] * 3 and outs[0] == (Shard(0),)


def test_grouped_query_heads_split_only_into_whole_groups():
    q, kv = _m(2, 8, 6, 16), _m(2, 2, 6, 16)
    call = _fwd_call("flash", q, kv, kv)
    _, outs, _ = engine.choose(call, ProcessMesh([0, 1]), [(Shard(1),)] * 3, inplace=False)
    assert outs[0] == (Shard(1),)
    _, outs, _ = engine.choose(call, ProcessMesh([0, 1, 2]), [(Shard(1),)] * 3, inplace=False)
    assert outs[0] != (Shard(1),)  # 2 kv heads on 3 ranks would split a group
    one = _m(2, 1, 6, 16)  # a single kv head shared by every query head stays whole
    ins, outs, _ = engine.choose(_fwd_call("flash", q, one, one), ProcessMesh([0, 1]), [(Shard(1),), (R,), (R,)],
                                 inplace=False)
    assert ins == [(Shard(1),), (R,), (R,)] and outs[0] == (Shard(1),)


@pytest.mark.parametrize("kernel", ("efficient", "cudnn"))
def test_the_bias_splits_with_the_scores_where_it_has_the_dim(kernel):
    q = _m(2, 4, 8, 16)
    for bias, want in ((_m(2, 4, 8, 8), Shard(0)), (_m(1, 1, 8, 8), R)):
        call = _fwd_call(kernel, q, q, q, bias)
        ins, _, _ = engine.choose(call, ProcessMesh([0, 1]), [(Shard(0),)] * 3 + [(R,)], inplace=False)
        assert ins[3] == (want,)


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_runs_the_kernel_whole(kernel):
    """The kernel's dropout mask comes from the global positions of a philox stream: a piece
    would draw another mask, so the call runs on the whole tensors."""
    q = _m(2, 4, 8, 16)
    ins, outs, _ = engine.choose(_fwd_call(kernel, q, q, q, dropout_p=0.1), ProcessMesh([0, 1]), [(Shard(0),)] * 3,
                                 inplace=False)
    assert ins == [(R,)] * 3 and outs[0] == (R,)


# -- through the dispatch, on meta tensors of a simulated job ------------------------------------
def kernel_splits(kernel: str, rank: int) -> list:
    """Forward and backward of `kernel` as rank `rank` of 4, on a dp 2 x tp 2 mesh (batch over
    dp, heads over tp), a batch split and a head split over all 4: [(output placements, the
    gradients' placements, the ops sent)] per case."""
    with dist.simulate(4, rank):
        return [_split_case(kernel, ids, placements) for ids, placements in (
            ([[0, 1], [2, 3]], [Shard(0), Shard(1)]),
            ([0, 1, 2, 3], [Shard(0)]),
            ([0, 1, 2, 3], [Shard(1)]),
        )]


def _split_case(kernel: str, ids, placements) -> list:
    mesh = ProcessMesh(ids)
    q, k, v = (dist.shard_tensor(torch.empty(4, 8, 32, 16, device="meta", dtype=torch.bfloat16), mesh, placements,
                                 stop_gradient=False) for _ in range(3))
    with dist.comm_log() as log:
        o = attention(kernel, q, k, v, is_causal=True)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    return [[str(p) for p in o.placements], [[str(p) for p in g.placements] for g in grads], [r.op for r in log]]


def routed_llama_steps(kernel) -> list:
    """Two steps of a tiny HF Llama (sdpa attention) on dp 2 x mp 2 on meta, with attention
    routed to `kernel` (None: the CPU build's own choice), as each rank of the job: every
    rank's comm_log and how often the kernel ran."""
    from hf_llama import batches, mp_plan, optimizer, tiny_llama

    ran = []

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        ran.append(kernel)
        return attention(kernel, q, k, v, None, dropout_p, is_causal, scale)

    routing = contextlib.nullcontext() if kernel is None else _patched(torch.nn.functional,
                                                                       "scaled_dot_product_attention", sdpa)
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()}}
    logs = []
    with routing:
        for rank in range(4):
            with dist.simulate(4, rank):
                with torch.device("meta"):
                    model = tiny_llama(attention="sdpa")
                model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
                steps = []
                for ids, labels in batches(2):
                    with dist.comm_log() as log:
                        model(input_ids=ids.to("meta"), labels=labels.to("meta")).loss.backward()
                        opt.step()
                        opt.zero_grad()
                    steps.append([[r.op, list(r.ranks), r.bytes, list(r.shape)] for r in log])
                logs.append(steps)
    return [logs, len(ran)]


@contextlib.contextmanager
def _patched(owner, name, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def test_each_cuda_kernel_runs_split_forward_and_backward_sending_nothing():
    got = evaluated(f"{{k: [t.kernel_splits(k, r) for r in range(4)] for k in {KERNELS!r}}}",
                    "test_rules_cuda_attention")
    for kernel in KERNELS:
        for rank in range(4):
            (o2d, g2d, sent2d), (ob, gb, sentb), (oh, gh, senth) = got[kernel][rank]
            assert o2d == ["Shard(0)", "Shard(1)"] and g2d == [o2d] * 3, (kernel, rank, o2d, g2d)
            assert ob == ["Shard(0)"] and gb == [ob] * 3, (kernel, rank)
            assert oh == ["Shard(1)"] and gh == [oh] * 3, (kernel, rank)
            assert sent2d == sentb == senth == [], (kernel, rank, sent2d, sentb, senth)


def test_a_llama_step_on_each_cuda_kernel_sends_what_the_cpu_kernel_step_sends():
    got = evaluated(f"{{str(k): t.routed_llama_steps(k) for k in (None,) + {KERNELS!r}}}", "test_rules_cuda_attention")
    cpu_logs, _ = got["None"]
    assert all(any(step) for rank in cpu_logs for step in rank)  # the job communicates every step
    for kernel in KERNELS:
        logs, ran = got[kernel]
        assert ran == 4 * 2 * 2, kernel  # every rank, every step, both layers went through the kernel
        assert logs == cpu_logs, kernel
