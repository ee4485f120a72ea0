"""Gradients written where their bucket reduces them (DDP's `gradient_as_bucket_view`): after
the first pre-step has packed a bucket, the local regions' backward writes each first
gradient into its slot of the bucket's buffer, and the next pre-step reduces that buffer in
place.  The numbers stay the single process's; the collectives stay the same; a gradient
someone still holds is never written over."""
import torch

import autopar as dist
from autopar.runtime import grad_reduce
from distpool import run_dist
import hf_llama


def _landed(model) -> bool:
    """The gradients lie, last parameter first, whole and in order in one flat buffer."""
    locals_ = [p.grad._local for p in reversed(list(model.parameters())) if p.grad is not None]
    return grad_reduce._tiled(locals_) is not None


def _llama_dp(steps: int = 4):
    """HF Llama (each decoder layer a region of its own: the bucket spans regions) under dp 2:
    per step whether the gradients landed, the step's collectives, and the training record."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama()
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    landed, collectives, losses = [], [], []
    for ids, labels in hf_llama.batches(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        landed.append(_landed(model))
        with dist.comm_log() as log:
            opt.step()
        collectives.append([(r.op, r.bytes) for r in log])
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: dist.unshard_dtensor(v.detach()) for k, v in model.state_dict().items()}
    return landed, collectives, (losses, weights, [])  # (reading a gradient would reduce it early)


def test_gradients_land_in_their_bucket_and_train_as_one_process():
    ref = hf_llama.reference(hf_llama.batches(4))
    for landed, collectives, got in run_dist(_llama_dp, 2):
        hf_llama.assert_matches(got, ref + ([],))
        # step 1 verifies the regions op by op and its pre-step packs the bucket, learning its
        # layout; from step 2 on the gradients are written into the bucket in backward
        assert landed == [False, True, True, True], landed
        # the same collectives at every step: packed or landed, one bucket all-reduced whole
        assert all(c == collectives[1] for c in collectives[1:]), collectives
        assert [op for op, _ in collectives[1]].count("all_reduce") >= 1


def _holding(drop_without_step: bool):
    """Hold a step's gradients (the DistTensors and a copy of their values) past `zero_grad`
    (after the step, or without one), then run the next backwards: the held gradients keep
    their values."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = hf_llama.tiny_llama()
    model, opt = dist.parallelize(model, hf_llama.optimizer(model.parameters()), mesh,
                                  {"dp_config": {"sharding_level": 0}})
    data = hf_llama.batches(6)
    held, kept, landed = None, None, []
    for n, (ids, labels) in enumerate(data):
        model(input_ids=ids, labels=labels).loss.backward()
        landed.append(_landed(model))
        if held is not None:  # the gradients of the step before, written over would differ
            assert all(torch.equal(g._local, v) for g, v in zip(held, kept))
        if not (drop_without_step and n == 3):
            opt.step()  # (reduces the gradients in place: one holding them sees them reduced)
        if n == 3:
            held = [p.grad for p in model.parameters()]
            kept = [g._local.clone() for g in held]
        opt.zero_grad()
    return landed, all(torch.equal(g._local, v) for g, v in zip(held, kept))


def test_a_held_gradient_is_never_written_over():
    # step 1 verifies the regions op by op; the gradients land from step 2 on: past the held
    # ones into a fresh buffer; after gradients dropped without a step, the next backward's
    # stay where autograd made them (the round of slots ends at a pre-step)
    for drop, expected in ((False, [False] + [True] * 5), (True, [False, True, True, True, False, True])):
        for landed, unchanged in run_dist(_holding, 2, drop):
            assert unchanged
            assert landed == expected, (drop, landed)
