"""The captured program moves what the dynamic run moves: the same collectives, in order."""
import numpy as np
import torch
import torch.nn.functional as F

import autopar as dist
from distpool import run_dist
from hf_llama import batches, optimizer, tiny_llama

STEPS = 3


class _Logits(torch.nn.Module):
    """HF's model called with input ids only; the loss is computed outside, as to_static takes it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _next_token_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _collectives(static):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    model = _Logits(tiny_llama(attention="sdpa"))
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, {"dp_config": {"sharding_level": 0}})
    step_fn = dist.to_static(model, None, _next_token_loss, opt) if static else None
    losses, logs = [], []
    for ids, labels in batches(STEPS):
        with dist.comm_log() as log:
            if static:
                loss = step_fn(ids, labels)
            else:
                loss = _next_token_loss(model(ids), labels)
                loss.backward()
                opt.step()
                opt.zero_grad()
        losses.append(loss.item())
        logs.append([(r.op, r.ranks, r.shape) for r in log])
    return losses, logs


def test_static_and_dynamic_data_parallel_steps_send_the_same_collectives():
    for (dyn_losses, dyn_logs), (st_losses, st_logs) in zip(run_dist(_collectives, 2, False),
                                                            run_dist(_collectives, 2, True)):
        np.testing.assert_allclose(st_losses, dyn_losses, rtol=1e-6)
        assert st_logs[-1] == dyn_logs[-1], (st_logs[-1], dyn_logs[-1])
        # replicated labels: the loss all-reduce and one gradient bucket, no all-to-all
        assert [op for op, _, _ in dyn_logs[-1] if op not in ("send", "recv")] == ["all_reduce", "all_reduce"], dyn_logs[-1]
