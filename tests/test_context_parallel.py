"""Context parallel over the mesh dim "sep": ring ("p2p") and Ulysses ("all2all") attention
against the single-process attention, forward and backward, their bytes from comm_log, and
HF Llama trained through `parallelize` with Paddle's plans against one process."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distpool import run_dist
import hf_llama
from test_simulate import each_rank  # noqa: F401  (the plain process calls t.each_rank)

B, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 16, 8


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, SEQ, DIM, generator=g)
    k, v = (torch.randn(B, KV_HEADS, SEQ, DIM, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, HEADS, SEQ, DIM, generator=g)


def _reference(causal):
    q, k, v, w = _qkv()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _attention(backend, causal):
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    q, k, v, w = (dist.shard_sequence(t, mesh, 2, backend).detach() for t in _qkv())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with dist.comm_log() as forward, dist.context_parallel(mesh, backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    with dist.comm_log() as backward:
        (out * w).sum().backward()
    moved = [[(c.op, c.bytes) for c in log] for log in (forward, backward)]
    return [dist.unshard_dtensor(t) for t in (out, q.grad, k.grad, v.grad)], out.placements, moved


def _natural(t, backend):
    """A global tensor in `backend`'s layout (dim 2) back in the natural order."""
    from autopar.runtime.context_parallel import load_balanced_order

    if backend == "all2all":
        return t
    return t[:, :, torch.argsort(load_balanced_order(t.shape[2], 2))]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_head_tail_split_gives_every_rank_the_same_work(cp):
    """Under a causal mask, the blocks each rank computes over a full turn of the ring, a
    causal diagonal counted half: the same on every rank (a contiguous split: 1 to cp); and
    the blocks cover every (query chunk, key chunk) pair at or below the diagonal once."""
    from autopar.runtime.context_parallel import block_pairs, held_chunks, load_balanced_order

    def turn(r, balanced):
        for step in range(cp):
            mine, held = held_chunks(r, cp, balanced), held_chunks((r - step) % cp, cp, balanced)
            yield from ((mine[a], held[b], diagonal) for a, b, diagonal in block_pairs(mine, held, True))

    work = [sum(1 if d else 2 for *_, d in turn(r, True)) for r in range(cp)]
    assert work == [4 * cp] * cp
    assert [sum(1 if d else 2 for *_, d in turn(r, False)) for r in range(cp)] == [2 * r + 1 for r in range(cp)]
    seen = sorted((a, b) for r in range(cp) for a, b, _ in turn(r, True))
    assert seen == [(a, b) for a in range(2 * cp) for b in range(a + 1)]
    order = load_balanced_order(4 * cp, cp).reshape(cp, 4)  # rank r's 4 tokens: chunks r and 2cp-1-r
    assert [row.tolist() for row in order] == [[2 * r, 2 * r + 1, 4 * cp - 2 - 2 * r, 4 * cp - 1 - 2 * r]
                                               for r in range(cp)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_plain_torch_block_matches_the_flash_kernel(causal):
    """The ring's block attention off the CPU (plain torch) against the CPU flash kernel:
    output, log-sum-exp, and the block gradients from the whole rows' output (grouped heads)."""
    from autopar.runtime.context_parallel import (block_backward, block_backward_math, block_forward,
                                                  block_forward_math)

    q, k, v, dout = (t.double() for t in _qkv())
    kernel, math = block_forward(q, k, v, causal, None), block_forward_math(q, k, v, causal, None)
    for a, b in zip(kernel, math):
        torch.testing.assert_close(a, b)
    for a, b in zip(block_backward(dout, q, k, v, *kernel, causal, 0.3),
                    block_backward_math(dout, q, k, v, *kernel, causal, 0.3)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("backend", ["p2p", "all2all"])
def test_attention_matches_one_process(backend, causal):
    """Output and the gradients of q, k, v (grouped-query heads) to rtol 1e-5; the ring sends
    each rank's K and V block once (cp-1 = 1 hop) in the forward and nothing else, Ulysses
    makes four all-to-alls of half of each local q, k, v, out."""
    ref = _reference(causal)
    local_kv = B * KV_HEADS * SEQ // 2 * DIM * 4 * 2  # this rank's K and V, fp32
    local_q = B * HEADS * SEQ // 2 * DIM * 4
    for got, placements, (forward, backward) in run_dist(_attention, 2, backend, causal):
        assert placements == [__import__("autopar").Shard(2)]
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(_natural(g, backend), r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if backend == "p2p":
            assert forward == [("send", local_kv), ("recv", 0)]
            sends = [b for op, b in backward if op == "send"]
            # K/V once around (cp-1 hops), their gradients (fp32) all the way home (cp hops)
            assert sends == [local_kv, local_kv, local_kv], backward
        else:
            assert [op for op, _ in forward] == ["all_to_all"] * 4
            assert sum(b for _, b in forward) == (local_q * 2 + local_kv) // 2
            assert [op for op, _ in backward] == ["all_to_all"] * 4


def _ulysses_grouped_heads():
    """4 query heads over 2 key/value heads on 4 ranks: each key/value head repeated once."""
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["sep"])
    q, k, v, w = (dist.shard_sequence(t, mesh, 2, "all2all").detach() for t in _qkv())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with dist.context_parallel(mesh, "all2all"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return [dist.unshard_dtensor(t) for t in (out, q.grad, k.grad, v.grad)]


def test_ulysses_repeats_key_value_heads_fewer_than_the_ranks():
    """Ulysses on more ranks than key/value heads (grouped-query attention, DeepSpeed's
    repeat): output and gradients as one process."""
    from autopar.runtime.context_parallel import kv_head_repeats

    assert (kv_head_repeats(4, 2, 4), kv_head_repeats(4, 4, 4), kv_head_repeats(4, 2, 8)) == (2, 1, None)
    ref = _reference(True)
    for got in run_dist(_ulysses_grouped_heads, 4):
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _ring_bf16():
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    q, k, v, w = (dist.shard_sequence(t.bfloat16(), mesh, 2, "p2p").detach() for t in _qkv())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with dist.context_parallel(mesh, "p2p"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return [dist.unshard_dtensor(t) for t in (out, q.grad, k.grad, v.grad)]


def test_ring_in_bf16_is_as_close_as_one_process():
    """In bf16 (blocks merged and gradients summed in fp32) the ring's output and gradients
    are as close to the float64 attention as one process's bf16 attention is (to 25%)."""
    def attention(dtype):
        q, k, v, w = (t.to(dtype) for t in _qkv())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (out * w).sum().backward()
        return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]

    exact, single = attention(torch.float64), attention(torch.bfloat16)
    got = run_dist(_ring_bf16, 2)[0]
    for name, g, s, e in zip(("out", "dq", "dk", "dv"), got, single, exact):
        assert g.dtype == torch.bfloat16
        assert (_natural(g, "p2p").double() - e).abs().max() <= 1.25 * (s - e).abs().max(), name


def _errors():
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    found = []
    with pytest.raises(ValueError) as err:
        dist.shard_sequence(torch.zeros(2, 10), mesh, 1, "p2p")
    found.append(str(err.value))
    q = dist.shard_sequence(torch.randn(1, 3, 8, 4), mesh, 2, "all2all")
    with pytest.raises(ValueError) as err, dist.context_parallel(mesh, "all2all"):
        F.scaled_dot_product_attention(q, q, q)
    found.append(str(err.value))
    q = dist.shard_sequence(torch.randn(1, 2, 8, 4), mesh, 2, "p2p")
    with pytest.raises(ValueError) as err, dist.context_parallel(mesh, "p2p"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8))
    found.append(str(err.value))
    return found


def test_bad_input_gets_a_clear_error():
    import autopar as dist

    padding, heads, mask = run_dist(_errors, 2)[0]
    assert "ring ('p2p')" in mask and "attention mask [8, 8] is not supported" in mask and "'all2all'" in mask
    assert "sequence of 10 tokens" in padding and "pad it by 2 to 12" in padding and "'sep'" in padding
    assert "3 heads, not divisible by 2" in heads and "[1, 3, 8, 4]" in heads
    with pytest.raises(ValueError, match="backend must be one of"):
        dist.ContextParallel("ring")
    with pytest.raises(ValueError, match="has no dim named 'sep'"):
        dist.context_parallel(dist.ProcessMesh([0], dim_names=["dp"])).__enter__()
    for plan, dims, dim in ((dist.ContextParallel(), ["mp"], "sep"), (dist.ColWiseParallel(), ["sep"], "mp")):
        with pytest.raises(ValueError, match=f"{type(plan).__name__} on '0' acts along a mesh dim named '{dim}'"):
            dist.parallelize(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh=dist.ProcessMesh([0], dim_names=dims),
                             config={"mp_config": {"parallelize_plan": {"0": plan}}})


def _llama(backend, data, mesh_ids=(0, 1), dims=("sep",), sharding_level=None, checkpointed=False):
    import autopar as dist

    model = hf_llama.tiny_llama(attention="sdpa")
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    mesh = dist.ProcessMesh(list(mesh_ids), dim_names=list(dims))
    plan = {"model": dist.PrepareContextParallel(backend), "model.layers.*.self_attn": dist.ContextParallel(backend)}
    if "mp" in dims:
        plan.update(hf_llama.mp_plan())
    config = {"mp_config": {"parallelize_plan": plan}}
    if sharding_level is not None:
        config["dp_config"] = {"sharding_level": sharding_level}
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh, config)
    grads = []
    with dist.comm_log() as log:
        losses = hf_llama.train(model, opt, data, steps=1, grads=grads)
    with dist.comm_log() as forward:
        model(input_ids=data[1][0], labels=data[1][1])
    losses += hf_llama.train(model, opt, data[1:], grads=grads)
    weights = {k: dist.unshard_dtensor(v).detach() for k, v in model.state_dict().items()}
    return (losses, weights, grads), [(c.op, c.bytes, c.shape, c.ranks) for c in forward]


@pytest.mark.parametrize("backend", ["p2p", "all2all"])
def test_hf_llama_trains_as_one_process(backend):
    """Tiny HF Llama (sdpa attention, grouped-query heads), 3 SGD steps through parallelize with
    PrepareContextParallel on the model and ContextParallel on every attention layer: losses,
    gradients and weights match one process; each layer's forward makes exactly the ring's
    sends (cp-1 = 1 hop of each rank's K and V) or Ulysses's four all-to-alls."""
    data = hf_llama.batches(n=3, batch=2)
    grads = []
    ref = hf_llama.reference(data, grads=grads, attention="sdpa")
    layers, half = 2, hf_llama.SEQ // 2
    kv = 2 * (2 * hf_llama.KV_HEADS * half * (hf_llama.HIDDEN // hf_llama.HEADS) * 4)  # batch 2, fp32
    for got, forward in run_dist(_llama, 2, backend, data):
        hf_llama.assert_matches(got, ref + (grads,))
        ops = [op for op, *_ in forward]
        assert "all_gather" not in ops, forward  # the loss takes the rows split as they are
        if backend == "p2p":  # (the other sends scatter the inputs from rank 0, as shard_tensor does)
            ring = [(b, shape) for op, b, shape, _ in forward if op == "send" and b >= kv]
            assert ring == [(kv, (kv // 4,))] * layers
            assert "all_to_all" not in ops
        else:
            assert ops.count("all_to_all") == 4 * layers
            # half of each local piece: q and the output hold twice the heads of k and v
            assert [b for op, b, *_ in forward if op == "all_to_all"] == [kv // 2, kv // 4, kv // 4, kv // 2] * layers


def test_hf_llama_ring_under_activation_checkpointing():
    """HF's gradient checkpointing of every decoder layer: the ring runs again in backward,
    where the layer is recomputed, and training stays exact."""
    data = hf_llama.batches(n=3, batch=2)
    grads = []
    ref = hf_llama.reference(data, grads=grads, attention="sdpa")
    for got, _ in run_dist(_llama, 2, "p2p", data, checkpointed=True):
        hf_llama.assert_matches(got, ref + (grads,))


@pytest.mark.parametrize("other,level", [("dp", 0), ("dp", 3), ("mp", None)], ids=["dp", "zero3", "tp"])
def test_hf_llama_context_parallel_with_another_dim(other, level):
    """The ring over "sep" on 4 ranks (mesh [[0, 1], [2, 3]], dims [other, "sep"]) beside plain
    data parallel, ZeRO-3 over "dp", or Megatron's tensor parallel over "mp" (heads and the
    vocabulary split there): as one process; each rank's ring runs within its "sep" pair and
    sends its K and V block (of its rows, or its heads) once per layer."""
    data = hf_llama.batches(n=3, batch=4)
    grads = []
    ref = hf_llama.reference(data, grads=grads, attention="sdpa")
    kv = 2 * (4 * hf_llama.KV_HEADS * hf_llama.SEQ // 2 * (hf_llama.HIDDEN // hf_llama.HEADS) * 4) // 2  # half of
    results = run_dist(_llama, 4, "p2p", data, [[0, 1], [2, 3]], (other, "sep"), level)  # the rows or heads
    for rank, (got, forward) in enumerate(results):
        hf_llama.assert_matches(got, ref + (grads,))
        partner = rank ^ 1
        assert [(b, r) for op, b, _, r in forward if op == "send" and b >= kv] == [(kv, (rank, partner))] * 2


def _cp_plan(backend):
    import autopar as dist

    plan = {"model": dist.PrepareContextParallel(backend), "model.layers.*.self_attn": dist.ContextParallel(backend)}
    return {"mp_config": {"parallelize_plan": plan}}


@pytest.mark.parametrize("backend,padded", [("p2p", False), ("all2all", False), ("p2p", True), ("all2all", True)],
                         ids=["ring", "ulysses", "ring-padded", "ulysses-padded"])
def test_hf_qwen2_trains_as_one_process(backend, padded):
    """Tiny HF Qwen2 (sdpa) through the same plans, also with a padding mask (left-padded rows):
    the ring takes it as its key padding, Ulysses's attention takes HF's mask: as one process."""
    from test_hf_models import _parallel, reference

    variant = dict(attention="sdpa", padded=padded)
    ref = reference("qwen2", **variant)
    for got, *_ in run_dist(_parallel, 2, "qwen2", _cp_plan(backend), ["sep"], **variant):
        hf_llama.assert_matches(got, ref)


def _activation_peak(cp, backend):
    """The most bytes autograd holds for backward on one rank of a cp-rank "sep" mesh, in a
    simulated job (tiny HF Llama, a 64-token sequence)."""
    import autopar as dist

    with dist.simulate(cp, 0) as sim:
        model = hf_llama.tiny_llama(attention="sdpa")
        mesh = dist.ProcessMesh(list(range(cp)), dim_names=["sep"])
        model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh, _cp_plan(backend))
        ids = torch.randint(0, hf_llama.VOCAB, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        return sim.memory(model, opt).activations_peak


def test_each_rank_holds_its_share_of_the_activations():
    """simulate's peak of the activations saved for backward on one rank: under the ring 1/cp
    of one rank's on 2 and 4 ranks (to 1%); under Ulysses to 6% and 12%: its attention saves
    the head-split copies of q, k, v (on 4 ranks the 2 key/value heads repeated), which one
    rank does not make."""
    whole, two, four = (_activation_peak(cp, "p2p") for cp in (1, 2, 4))
    assert two <= whole / 2 * 1.01 and four <= whole / 4 * 1.01, (whole, two, four)
    whole, two, four = (_activation_peak(cp, "all2all") for cp in (1, 2, 4))
    assert two <= whole / 2 * 1.06 and four <= whole / 4 * 1.12, (whole, two, four)


def _ring_padded():
    """Causal attention with left-padded rows (the first rows see no key at all), the key
    padding given to the ring."""
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    keep = torch.ones(B, SEQ, dtype=torch.long)
    keep[1, :11] = 0
    q, k, v, w = (dist.shard_sequence(t, mesh, 2, "p2p").detach() for t in _qkv())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with dist.context_parallel(mesh, "p2p", key_padding_mask=dist.shard_sequence(keep, mesh, 1, "p2p")):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return [dist.unshard_dtensor(t) for t in (out, q.grad, k.grad, v.grad)], keep


def test_ring_with_a_key_padding_mask_matches_one_process():
    """The ring with left padding (11 of 16 keys of row 1 hidden: query rows that see no key
    come out 0, as torch gives them) against torch's masked attention, output and gradients."""
    for got, keep in run_dist(_ring_padded, 2):
        q, k, v, w = _qkv()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        mask = keep.bool()[:, None, None, :] & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        (out * w).sum().backward()
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, (out.detach(), q.grad, k.grad, v.grad)):
            torch.testing.assert_close(_natural(g, "p2p"), r, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["p2p", "all2all"], ids=["ring", "ulysses"])
@pytest.mark.parametrize("level", [0, 3], ids=["dp", "zero3"])
def test_hf_llama_context_tensor_and_data_parallel_on_8_ranks(backend, level):
    """cp x tp x dp: the ring or Ulysses over "sep", Megatron's tensor parallel over "mp" and
    data parallel (plain or ZeRO-3) over "dp" on a [2, 2, 2] mesh: 2 steps as one process;
    each rank's ring sends its K/V block (its batch row, its head) once per layer and only to
    its "sep" partner; Ulysses makes its four all-to-alls per layer within that pair, splitting
    further the heads tensor parallel gave the rank (none dealt out anew over "mp")."""
    data = hf_llama.batches(n=2, batch=2)
    grads = []
    ref = hf_llama.reference(data, grads=grads, attention="sdpa")
    layers, head_dim = 2, hf_llama.HIDDEN // hf_llama.HEADS
    kv = 2 * (1 * hf_llama.KV_HEADS // 2 * hf_llama.SEQ // 2 * head_dim * 4)  # 1 row, 1 kv head, half the tokens
    mesh = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    results = run_dist(_llama, 8, backend, data, mesh, ("dp", "sep", "mp"), level)
    for rank, (got, forward) in enumerate(results):
        hf_llama.assert_matches(got, ref + (grads,))
        partner = rank ^ 2  # the other rank of its "sep" pair: same dp and mp coordinates
        if backend == "p2p":
            assert [(b, r) for op, b, _, r in forward if op == "send" and b >= kv] == [(kv, (rank, partner))] * layers
            assert "all_to_all" not in [op for op, *_ in forward]
        else:  # q, k (its 1 head repeated to q's 2), v, out: half of each local piece, as kv is
            pair = tuple(sorted((rank, partner)))
            assert [(b, r) for op, b, _, r in forward if op == "all_to_all"] == [(kv // 2, pair)] * 4 * layers


class _SelfAttention(torch.nn.Module):
    """Causal self-attention on (batch, sequence, HEADS * DIM), its sdpa call the one
    ContextParallel makes context parallel."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * DIM, HEADS * DIM)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM)).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _squares(out):
    return out.pow(2).mean()  # indifferent to the order of the tokens (the ring's is load-balanced)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, SEQ, HEADS * DIM, generator=g) for _ in range(3)]


def _train(model, opt, loss_fn, static, batches):
    """SGD steps over `batches` (the model's input, then the loss's other arguments), eager or
    as a `to_static` program (captured at the first step, replayed after): the losses, the
    last step's comm_log and the program (None when eager)."""
    import autopar as dist

    step = dist.to_static(model, None, loss_fn, opt) if static else None
    losses = []
    for batch in batches:
        with dist.comm_log() as log:
            if static:
                loss = step(*batch)
            else:
                loss = loss_fn(model(batch[0]), *batch[1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
        losses.append(float(loss))
    return losses, [(c.op, c.ranks, c.bytes) for c in log], step.dist_main_program() if static else None


def _attention_steps(backend, static):
    """3 steps of `_SelfAttention` under ContextParallel(backend) on 2 "sep" ranks: losses,
    weights and the last step's comm_log."""
    import autopar as dist

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    model = torch.nn.Sequential(_SelfAttention())
    plan = {"0": dist.ContextParallel(backend)}
    model, opt = dist.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh,
                                  {"mp_config": {"parallelize_plan": plan}})
    losses, log, program = _train(model, opt, _squares, static,
                                  [(dist.shard_sequence(x, mesh, 1, backend),) for x in _inputs()])
    return losses, {k: dist.unshard_dtensor(v).detach() for k, v in model.state_dict().items()}, log, program


@pytest.mark.parametrize("backend", ["p2p", "all2all"], ids=["ring", "ulysses"])
def test_to_static_replays_context_parallel_attention(backend):
    """`to_static` of a step whose attention is the ring or Ulysses: the captured program
    gives the eager step's losses and weights bit for bit (and one process's to rtol 1e-5)
    and sends what the eager step sends: the ring's K/V block once in the forward and K/V
    and their gradients in the backward (1 + 3 sends of this rank's K and V), Ulysses's four
    all-to-alls each way.  The program overlaps the ring's transfers as the eager step does:
    each send and receive is posted before a block's attention and arrives after it."""
    model = torch.nn.Sequential(_SelfAttention())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for x in _inputs():
        loss = _squares(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    local_kv = 2 * B * HEADS * SEQ // 2 * DIM * 4
    eager, static = run_dist(_attention_steps, 2, backend, False), run_dist(_attention_steps, 2, backend, True)
    for rank, ((losses, weights, log, _), (s_losses, s_weights, s_log, program)) in enumerate(zip(eager, static)):
        assert s_losses == losses and s_log == log, (rank, s_log, log)
        np.testing.assert_allclose(s_losses, ref, rtol=1e-5)
        for k, v in model.state_dict().items():
            assert torch.equal(s_weights[k], weights[k]), k
            torch.testing.assert_close(s_weights[k], v, rtol=1e-5, atol=1e-6)
        moved = [(op, b) for op, _, b in s_log if op != "all_reduce"]  # (the gradients' all-reduce over "sep")
        if backend == "p2p":
            assert moved == [("send", local_kv), ("recv", 0)] * 4, s_log
            assert {r for op, r, _ in s_log if op == "send"} == {(rank, 1 - rank)}
            _assert_posted_around_attention(program, posts=4)
        else:
            assert moved == [("all_to_all", local_kv // 4)] * 8, s_log


def _assert_posted_around_attention(program: str, posts: int, layers: int = 1) -> None:
    """`program` posts its `posts` sends and receives, each arriving after some attention
    kernel (forward or backward) ran since it was posted: the transfers overlap the ring's
    blocks; all but each layer's last hop of the gradients home, after its last block."""
    lines = program.splitlines()
    assert f"send x{posts}, recv x{posts}" in lines[0], lines[0]
    for op in ("send", "recv"):
        posted = [n for n, line in enumerate(lines) if line.startswith(f"post {op}(")]
        arrived = [n for n, line in enumerate(lines) if line.startswith(f"arrive {op}(")]
        assert len(posted) == len(arrived) == posts, (op, posted, arrived)
        bare = [(p, a) for p, a in zip(posted, arrived)
                if not any("scaled_dot_product_flash_attention" in line for line in lines[p:a])]
        assert all(p < a for p, a in zip(posted, arrived)) and len(bare) == layers, bare


_CP_TP_DP = ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["dp", "sep", "mp"])


def _llama_steps(backend, device="cpu", steps=2, layout=([0, 1], ["sep"])):
    """`steps` SGD steps of the tiny HF Llama (sdpa) under the context-parallel plans (and
    Megatron's over "mp", if the mesh has it) on the mesh `layout` (ids, dim names), the
    model and batches on `device`; each step's comm_log."""
    import autopar as dist

    with torch.device(device):
        model = hf_llama.tiny_llama(attention="sdpa")
    mesh = dist.ProcessMesh(*layout)
    config = _cp_plan(backend)
    if "mp" in layout[1]:
        config["mp_config"]["parallelize_plan"].update(hf_llama.mp_plan())
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh, config)
    logs = []
    for ids, labels in hf_llama.batches(steps, batch=2):
        with dist.comm_log() as log:
            model(input_ids=ids.to(device), labels=labels.to(device)).loss.backward()
            opt.step()
            opt.zero_grad()
        logs.append([[c.op, list(c.ranks), c.bytes, list(c.shape)] for c in log])
    return logs


@pytest.mark.parametrize("backend,world", [("p2p", 2), ("all2all", 2), ("p2p", 8), ("all2all", 8)],
                         ids=["ring", "ulysses", "ring-cp-tp-dp", "ulysses-cp-tp-dp"])
def test_simulate_on_meta_sends_what_the_real_context_parallel_run_sends(backend, world):
    """`dist.simulate` of each rank with the HF Llama and its batches on the meta device: HF
    builds no attention mask under the plans (reading an all-ones mask or the positions, as
    its mask builder does, has no answer on meta), and every rank logs the collectives and
    bytes of the real run, step by step: on 2 "sep" ranks, and the ring on 8 ranks [2, 2, 2]
    ("dp", "sep", "mp", with Megatron's plan over "mp")."""
    from plain_process import evaluated

    args = (backend, "cpu", 2) + ((_CP_TP_DP,) if world == 8 else ())
    simulated = evaluated(f"t.each_rank({world}, t._llama_steps, {backend!r}, 'meta', *{args[2:]!r})",
                          "test_context_parallel")
    real = run_dist(_llama_steps, world, *args)
    for rank in range(world):
        assert simulated[rank] == real[rank], rank
        ops = {op for step in real[rank] for op, *_ in step}
        assert ("all_to_all" in ops) == (backend == "all2all"), ops



def _llama_static_steps(backend, static):
    """5 steps of the tiny HF Llama under the plans on 2 "sep" ranks, the next-token loss taken
    outside on the labels shifted and laid out as the logits (no gathering)."""
    import autopar as dist
    from test_static_collectives import _Logits  # HF's model called with the ids only

    mesh = dist.ProcessMesh([0, 1], dim_names=["sep"])
    plan = {"model.model": dist.PrepareContextParallel(backend),
            "model.model.layers.*.self_attn": dist.ContextParallel(backend)}
    model = _Logits(hf_llama.tiny_llama(attention="sdpa"))
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"mp_config": {"parallelize_plan": plan}})

    def next_token_loss(logits, labels):
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        shifted = dist.shard_sequence(shifted, mesh, 1, backend, src_data_rank=None)
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)

    # (5 steps: regions verify one level of the module tree per step, each verification a
    # small all-reduce of its verdict; the eager step's last log is then settled)
    return _train(model, opt, next_token_loss, static, hf_llama.batches(5, batch=2))


@pytest.mark.parametrize("backend", ["p2p", "all2all"], ids=["ring", "ulysses"])
def test_to_static_replays_hf_llama_under_the_context_parallel_plans(backend):
    """The tiny HF Llama under PrepareContextParallel and ContextParallel as a `to_static`
    program: the eager step's transfers (but for the mean loss's (sum, count), which the eager
    step carries in its gradient bucket), its losses, and one process's losses."""
    from test_static_collectives import _carried

    ref = hf_llama.reference(hf_llama.batches(5, batch=2), attention="sdpa")[0]
    kv = 2 * (2 * hf_llama.KV_HEADS * hf_llama.SEQ // 2 * (hf_llama.HIDDEN // hf_llama.HEADS) * 4)  # batch 2, fp32
    eager, static = run_dist(_llama_static_steps, 2, backend, False), run_dist(_llama_static_steps, 2, backend, True)
    for (losses, log, _), (s_losses, s_log, program) in zip(eager, static):
        assert _carried(s_log, in_bytes=True) == log, (s_log, log)
        # (the eager step's gradients: its backward's with every target counted, scaled by
        # their number over the count once the bucket brings it: the last bits may differ)
        np.testing.assert_allclose(s_losses, losses, rtol=1e-6)
        np.testing.assert_allclose(s_losses, ref, rtol=1e-5)
        assert ("all_to_all" in {op for op, *_ in log}) == (backend == "all2all")
        if backend == "p2p":  # per layer: K/V once in the forward, K/V and their gradients in the backward
            assert [b for op, _, b in log if op == "send" and b == kv] == [kv] * 4 * 2, log
            _assert_posted_around_attention(program, posts=4 * 2, layers=2)
