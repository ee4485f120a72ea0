"""The captured program moves what the dynamic run moves: the same collectives, in order (but
for the mean loss's (sum, count), which the dynamic step carries in its first gradient bucket
and the captured one reduces in its forward)."""
import numpy as np
import torch
import torch.nn.functional as F

import autopar as dist
from autopar.tensor import riders
from distpool import run_dist
from hf_llama import batches, mp_plan, optimizer, tiny_llama
from test_hf_models import tiny

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


def _collectives(static, mp=False, steps=STEPS, family="llama", **model_config):
    if mp:
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        plan = {"model." + name: layer for name, layer in mp_plan().items()}
        config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": plan}}
    else:
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        config = {"dp_config": {"sharding_level": 0}}
    model = _Logits(tiny_llama(attention="sdpa", **model_config) if family == "llama" else tiny(family, **model_config))
    model, opt = dist.parallelize(model, optimizer(model.parameters()), mesh, config)
    step_fn = dist.to_static(model, None, _next_token_loss, opt) if static else None
    losses, logs = [], []
    for ids, labels in batches(steps):
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


def _carried(log: list, in_bytes: bool = False) -> list:
    """A captured step's collectives, (op, ranks, shape or bytes), as the dynamic step sends
    them: the mean loss's (sum, count) all-reduce, of two float32 elements, carried by the first
    gradient bucket over its ranks instead (`tensor/deferred_mean.py`)."""
    pair_size, extra = (8, 4 * (riders.PIECES + 1)) if in_bytes else ((2,), riders.PIECES + 1)
    out, pair = [], None
    for op, ranks, size in log:
        if op == "all_reduce" and size == pair_size and pair is None:
            pair = ranks
            continue
        if pair and op == "all_reduce" and ranks == pair and (size > 8 if in_bytes else len(size) == 1 and size[0] > 2):
            size, pair = (size + extra if in_bytes else (size[0] + extra,)), ()
        out.append((op, ranks, size))
    return out


def test_static_and_dynamic_data_parallel_steps_send_the_same_collectives():
    for (dyn_losses, dyn_logs), (st_losses, st_logs) in zip(run_dist(_collectives, 2, False),
                                                            run_dist(_collectives, 2, True)):
        np.testing.assert_allclose(st_losses, dyn_losses, rtol=1e-6)
        assert _carried(st_logs[-1]) == dyn_logs[-1], (st_logs[-1], dyn_logs[-1])
        # replicated labels: the loss all-reduce and one gradient bucket, no all-to-all (the
        # dynamic step: the bucket alone)
        assert [op for op, _, _ in st_logs[-1] if op not in ("send", "recv")] == ["all_reduce", "all_reduce"], st_logs[-1]


def test_hf_llama_trained_without_its_key_cache_is_captured():
    """With `use_cache=False` (training) HF reads its position ids' values into Python (a check
    for packed sequences): made from `arange` alone, they are read at capture."""
    ref = None
    for (dyn_losses, dyn_logs), (st_losses, st_logs) in zip(run_dist(_collectives, 2, False, use_cache=False),
                                                            run_dist(_collectives, 2, True, use_cache=False)):
        np.testing.assert_allclose(st_losses, dyn_losses, rtol=1e-6)
        assert _carried(st_logs[-1]) == dyn_logs[-1], (st_logs[-1], dyn_logs[-1])
        assert ref is None or st_losses == ref
        ref = st_losses


def test_a_moe_block_is_captured_as_its_rules_region():
    """Mixtral's experts under data parallel: the experts rule vouches for the block, so the
    capture runs it as its region on each rank's tokens, as the dynamic step does after its
    first call, instead of op by op (where the routing of a token-split batch gathers and
    scatters: 21 collectives a step before)."""
    for (dyn_losses, dyn_logs), (st_losses, st_logs) in zip(
            run_dist(_collectives, 2, False, family="mixtral", use_cache=False),
            run_dist(_collectives, 2, True, family="mixtral", use_cache=False)):
        np.testing.assert_allclose(st_losses, dyn_losses, rtol=1e-6)
        assert _carried(st_logs[-1]) == dyn_logs[-1], (st_logs[-1], dyn_logs[-1])
        # besides the batch handed out, the loss's count and the gradient bucket: nothing for the experts
        assert [op for op, _, _ in st_logs[-1] if op not in ("send", "recv")] == ["all_reduce"] * 2, st_logs[-1]


def test_static_and_dynamic_dp_x_mp_steps_send_the_same_collectives():
    """dp x mp: the layers whose forward does not communicate (the MLPs) become local regions
    one nesting level per step (each level is tried once); from then on their gradients wait
    for the optimizer's pre-step and share its buckets, as the captured step's do."""
    steps = 5
    for (dyn_losses, dyn_logs), (st_losses, st_logs) in zip(run_dist(_collectives, 4, False, True, steps),
                                                            run_dist(_collectives, 4, True, True, steps)):
        np.testing.assert_allclose(st_losses, dyn_losses, rtol=1e-6)
        assert _carried(st_logs[-1]) == dyn_logs[-1], (st_logs[-1], dyn_logs[-1])
        # one gradient bucket per group of ranks: the dp pairs (mp-split weights) and the whole
        # mesh (replicated weights: norms, embedding)
        buckets = [(ranks, shape) for op, ranks, shape in dyn_logs[-1] if op == "all_reduce" and len(shape) == 1 and shape[0] > 2]
        assert len(buckets) == 2 and {len(r) for r, _ in buckets} == {2, 4}, dyn_logs[-1]
