"""Tensor parallel on a real Llama at the Megatron minimum, counted from comm_log.

Megatron's column/row split of a decoder layer needs, per layer, one all-reduce after the
attention and one after the MLP in forward (their row-parallel outputs are partial sums),
and the same two in backward (the column-parallel inputs' gradients); the vocab-parallel
loss adds two small forward all-reduces (row max, row sum of exponentials) and one in
backward; the replicated parameters' partial gradients (norms, embedding) are reduced in
one bucket, at the end of backward once they land in it.  Nothing else moves.
"""
import pytest
import torch

import autopar as dist
from distpool import run_dist
from hf_llama import HIDDEN, VOCAB, assert_matches, batches, mp_plan, optimizer, reference, tiny_llama

LAYERS, STEPS, BATCH, SEQ = 2, 6, 4, 16


def _counted_steps(attention):
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    model = tiny_llama(layers=LAYERS, attention=attention)
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh,
                                  {"mp_config": {"parallelize_plan": mp_plan()}})
    losses, grads, logs = [], [], []
    for ids, labels in batches(STEPS):
        with dist.comm_log() as fwd:
            loss = model(input_ids=ids, labels=labels).loss
        with dist.comm_log() as bwd:
            loss.backward()
        grads.append({k: dist.unshard_dtensor(p.grad) for k, p in model.named_parameters()})
        with dist.comm_log() as step:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logs.append([[(r.op, r.shape, r.bytes) for r in log] for log in (fwd, bwd, step)])
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, weights, grads, logs


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_tensor_parallel_moves_only_megatrons_collectives(attention):
    """Eager attention (q @ k^T per head, softmax, @ v) merges the heads into the batched
    matmul's batch: the heads' split goes through as a StridedShard, no all-to-all."""
    ref_grads = []
    ref = (*reference(batches(STEPS), grads=ref_grads, layers=LAYERS, attention=attention), ref_grads)
    activation = (BATCH, SEQ, HIDDEN)
    act_bytes = BATCH * SEQ * HIDDEN * 4  # an all-reduce over 2 ranks sends 2 (k-1)/k of it
    for losses, weights, grads, logs in run_dist(_counted_steps, 2, attention):
        assert_matches((losses, weights, grads), ref)
        # the last step: every sublayer's local-region verification is behind it
        fwd, bwd, step = logs[-1]
        assert [(op, shape) for op, shape, _ in fwd] == (
            [("all_reduce", activation)] * (2 * LAYERS) + [("all_reduce", (BATCH * SEQ, 1))] * 2), fwd
        replicated = (VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN,)  # (the embedding and the norms)
        assert [(op, shape) for op, shape, _ in bwd] == (
            [("all_reduce", (BATCH * SEQ, 1))] + [("all_reduce", activation)] * (2 * LAYERS)
            + [("all_reduce", replicated)]), bwd
        assert sum(b for op, shape, b in fwd if shape == activation) == 2 * LAYERS * act_bytes
        assert step == [], step


def _clipped_norms():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = tiny_llama(layers=LAYERS)
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": mp_plan()}})
    norms, logs = [], []
    for ids, labels in batches(3):
        loss = model(input_ids=ids, labels=labels).loss
        with dist.comm_log() as bwd:
            loss.backward()
        with dist.comm_log() as log:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        with dist.comm_log() as step:
            opt.step()
        opt.zero_grad()
        logs.append(([(r.op, len(r.ranks)) for r in bwd if len(r.ranks) != 2 or r.ranks[1] - r.ranks[0] != 1],
                     [(r.op, len(r.ranks)) for r in log], len(step)))
    return norms, logs


def test_clipping_dp_x_mp_gradients_takes_a_collective_per_bucket_and_norm_group():
    """The gradients are reduced in the optimizer's buckets (one over each dp pair, one over
    the mesh for the replicated weights): at the first read, clip_grad_norm_'s, in the first
    step, and in backward once they land in the buckets, from the second; the norm adds one
    all-reduce per placement of the mp-split gradients (columns, rows): not one collective
    per parameter."""
    model = tiny_llama(layers=LAYERS)
    opt = optimizer(model.parameters())
    ref = []
    for ids, labels in batches(3):
        model(input_ids=ids, labels=labels).loss.backward()
        ref.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
    for norms, logs in run_dist(_clipped_norms, 4):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref), rtol=1e-5, atol=0)
        buckets, norms_ = [("all_reduce", 2), ("all_reduce", 4)], [("all_reduce", 2)] * 2
        for n, (bwd_ops, clip_ops, step_ops) in enumerate(logs):  # (bwd_ops: those not over mp)
            assert sorted(bwd_ops) == ([] if n == 0 else buckets), (n, bwd_ops)
            assert sorted(clip_ops) == sorted(norms_ + (buckets if n == 0 else [])), (n, clip_ops)
            assert step_ops == 0
