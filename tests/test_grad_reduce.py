"""Data-parallel gradients all-reduced in buckets during backward (local regions, ZeRO-less
shard_optimizer): the numbers of one process, buckets started before backward ends, nothing
left for the optimizer to reduce; gradient accumulation, frozen and unused parameters."""
import numpy as np
import pytest
import torch

import autopar as dist
from autopar.runtime import grad_reduce
from autopar.tensor import riders
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist

R, S0 = Replicate(), Shard(0)


class Deep(torch.nn.Module):
    """Four linears (8 parameters, 2-8 KiB each): several buckets under small caps."""

    def __init__(self, frozen=False, unused=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.spare = torch.nn.Linear(16, 16)  # never called when `unused`
        if frozen:
            self.layers[1].requires_grad_(False)
        self.unused = unused

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x if self.unused else self.spare(x)


def _batches(micro=(1, 1, 1)):
    """Per optimizer step, `micro[step]` micro-batches."""
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(m)] for m in micro]


def _train(model, mesh=None, micro=(1, 1, 1), stage=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if mesh is not None:
        opt = dist.shard_optimizer(opt, stage)
    losses, grads_after_backward, step_comm = [], [], []
    for batch in _batches(micro):
        for x, y in batch:
            if mesh is not None:
                x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
            loss = torch.nn.functional.mse_loss(model(x), y) / len(batch)
            loss.backward()
            losses.append(loss.item())
        if mesh is not None:
            grads_after_backward.append(sorted({str(p.grad.placements) for p in model.parameters()
                                                if p.grad is not None}))
            with dist.comm_log() as log:
                opt.step()
            step_comm.append([r.op for r in log])
        else:
            opt.step()
        opt.zero_grad()
    params = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return losses, params, grads_after_backward, step_comm


def _dp(micro=(1, 1, 1), stage=None, **net):
    """Small bucket caps: the first bucket holds the last layer, the others about two layers."""
    caps = grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES
    grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = 1200, 2500
    starts = []  # how many gradients of the region were ready when each bucket started
    orig_start = grad_reduce.BackwardReduction._start

    def start(self, bucket):
        starts.append(len(self.grads))
        return orig_start(self, bucket)

    grad_reduce.BackwardReduction._start = start
    try:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        torch.manual_seed(0)
        model = dist.shard_layer(Deep(**net), mesh)
        stage = dist.ShardingStage1("dp") if stage == 1 else None
        return _train(model, mesh, micro, stage) + (starts,)
    finally:
        grad_reduce.BackwardReduction._start = orig_start
        grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = caps


def _reference(micro=(1, 1, 1), **net):
    torch.manual_seed(0)
    return _train(Deep(**net), micro=micro)[:2]


def _check_numbers(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for k, v in got[1].items():
        torch.testing.assert_close(v, ref[1][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("net", [{}, {"frozen": True}, {"unused": True}], ids=["all", "frozen", "unused"])
def test_buckets_reduce_during_backward_and_match_single_process(net):
    ref = _reference(**net)
    trainable = sum(p.requires_grad for p in Deep(**net).parameters()) - 2 * net.get("unused", False)
    for got in run_dist(_dp, 4, **net):
        _check_numbers(got, ref)
        losses, _, placements, step_comm, starts = got
        # step 1 verifies the region op by op: the optimizer reduces its gradients, in the
        # buckets backward cuts later; then the region's backward does, and the optimizer has
        # nothing left to reduce
        assert placements == [["[Partial()]"]] + [["[Replicate()]"]] * 2
        assert step_comm == [["all_reduce"] * 3] + [[]] * 2
        assert len(starts) == 2 * 3, starts  # three buckets per backward
        # the first bucket (the last layer) started while backward still had layers to go
        assert starts[0] < trainable, (starts, trainable)


def test_gradient_accumulation_defers_reduction_to_one_per_step():
    """Step 2's first backward reduces in buckets; its second finds gradients left (accumulation):
    they turn Partial again without communication and from then on the optimizer reduces once
    per step, however many micro-batches."""
    micro = (1, 2, 3)
    ref = _reference(micro)
    for got in run_dist(_dp, 4, micro):
        _check_numbers(got, ref)
        losses, _, placements, step_comm, starts = got
        assert placements == [["[Partial()]"]] * 3
        assert step_comm == [["all_reduce"] * 3] * 3  # one reduction per step (three buckets)
        assert len(starts) == 3  # only step 2's first backward reduced (three buckets)


def test_zero_stage_1_reduce_scatters_buckets_during_backward():
    """ZeRO-1 reduce-scatters the gradients onto this rank's shards, bucket by bucket while
    backward runs (after the first step, which verifies the region op by op: the optimizer
    reduces its gradients, in the same buckets), and all-gathers the updated shards, one
    bucket (of the same size cap) each."""
    ref = _reference()
    for got in run_dist(_dp, 4, stage=1):
        _check_numbers(got, ref)
        assert got[2] == [[str([Partial()])]] + [[str([Shard(0)])]] * 2
        assert len(got[4]) == 2 * 3  # three buckets reduce-scattered in each later backward
        gathers = ["all_gather"] * 3
        assert got[3] == [["reduce_scatter"] * 3 + gathers, gathers, gathers], got[3]


def _clip_first_step():
    """Step 1 runs the region op by op: its gradients wait Partial for the optimizer.  Clipping
    reads them all; the first read reduces every one, in the optimizer's buckets."""
    caps = grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES
    grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = 1200, 2500
    try:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        torch.manual_seed(0)
        model = dist.shard_layer(Deep(), mesh)
        opt = dist.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
        (x, y), = _batches((1,))[0]
        x, y = dist.shard_tensor(x, mesh, [S0]), dist.shard_tensor(y, mesh, [S0])
        torch.nn.functional.mse_loss(model(x), y).backward()
        with dist.comm_log() as clip_log:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with dist.comm_log() as step_log:
            opt.step()
        return norm.item(), [r.op for r in clip_log], [r.op for r in step_log], dist.unshard_dtensor(model.layers[0].weight.detach())
    finally:
        grad_reduce.FIRST_BUCKET_BYTES, grad_reduce.BUCKET_BYTES = caps


def test_clipping_reduces_pending_gradients_in_buckets():
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    (x, y), = _batches((1,))[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
    opt.step()
    for norm, clip_ops, step_ops, w in run_dist(_clip_first_step, 4):
        np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
        torch.testing.assert_close(w, model.layers[0].weight.detach(), rtol=1e-5, atol=1e-6)
        assert clip_ops == ["all_reduce"] * 3, clip_ops  # the three buckets; the norm needs nothing more
        assert step_ops == [], step_ops


def _llama_gradient_collectives():
    """HF Llama under dp 2 with a 64 KiB first bucket: the gradient all-reduces of a step
    after the regions are verified."""
    from hf_llama import batches, optimizer, tiny_llama

    caps = grad_reduce.FIRST_BUCKET_BYTES
    grad_reduce.FIRST_BUCKET_BYTES = 64 << 10
    try:
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        model = tiny_llama(layers=3)
        model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, {"dp_config": {"sharding_level": 0}})
        sizes = []
        for ids, labels in batches(5):
            with dist.comm_log() as log:
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
            opt.zero_grad()
            sizes = [r.bytes for r in log if r.op == "all_reduce" and r.bytes > 64]
        return sizes, sum(p.numel() * 4 for p in model.parameters())
    finally:
        grad_reduce.FIRST_BUCKET_BYTES = caps


def test_small_regions_share_ddp_sized_buckets():
    """Decoder layers are regions of their own, each far below a bucket: their gradients wait
    for the pre-step and travel in DDP's buckets (the 64 KiB first one, then one for the rest),
    not in a first bucket per region."""
    for sizes, model_bytes in run_dist(_llama_gradient_collectives, 2):
        assert len(sizes) == 2, sizes  # an all-reduce of k=2 sends its whole buffer
        # (the first bucket, started first in backward, carries the mean loss's (sum, count):
        # `deferred_mean`)
        pair = 4 * (riders.PIECES + 1)
        assert sizes[0] - pair <= 64 << 10 and sum(sizes) == model_bytes + pair, (sizes, model_bytes)
