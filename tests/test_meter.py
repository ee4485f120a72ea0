"""StepMeter: tokens/s, MFU against the device profile's peak, peak memory and the share of a
step blocked in transfers, measured on a real data-parallel job."""
import pytest
import torch

import autopar as dist
from autopar.comm.log import blocked_seconds
from autopar.planner import load_profile
from distpool import run_dist
from hf_llama import tiny_llama


def _data_parallel_steps():
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = tiny_llama()
    meter = dist.StepMeter(tokens_per_step=4 * 16, model=model, seq=16, device="cpu")
    model = dist.shard_layer(model, mesh)
    opt = dist.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    before = blocked_seconds()
    for _ in range(3):
        ids = dist.shard_tensor(torch.randint(0, 128, (4, 16), generator=g), mesh, [dist.Shard(0)])
        with meter.step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return meter.steps, meter.summary(), meter.flops_per_token, blocked_seconds() - before


def test_a_data_parallel_step_is_measured_from_the_model_and_the_profile():
    peak = load_profile("cpu").peak_flops("fp32")
    for steps, summary, flops_per_token, blocked in run_dist(_data_parallel_steps, 2):
        assert len(steps) == 3 and flops_per_token > 0
        for s in steps:
            assert s.tokens_per_second == pytest.approx(64 / s.seconds)
            assert s.mfu == pytest.approx(flops_per_token * 64 / (s.seconds * 2 * peak))
            assert 0 < s.comm_share <= 1 and s.peak_memory_bytes > 0  # the gradients are all-reduced
        assert blocked > 0
        assert summary.seconds == sorted(s.seconds for s in steps[1:])[1]  # the median after the warm-up step
        assert summary.peak_memory_bytes == max(s.peak_memory_bytes for s in steps[1:])


def test_flops_come_from_the_planner_or_are_given():
    from autopar.planner import describe

    model = tiny_llama()
    assert dist.StepMeter(64, model, seq=16).flops_per_token == describe(model, 16)[0].flops_per_token()
    assert dist.StepMeter(64, flops_per_token=1e6).flops_per_token == 1e6
    with pytest.raises(ValueError, match="give the model"):
        dist.StepMeter(64)
    with pytest.raises(ValueError, match="no step measured yet"):
        dist.StepMeter(64, flops_per_token=1e6).summary()
