"""HuggingFace transformers' LlamaForCausalLM, tiny and built from a config (no download).

Shared by the tests that train a real HF model against the single-process run.

    model = tiny_llama()                   # 2 layers, GQA (4 heads, 2 kv heads), vocab 128
    for ids, labels in batches():          # plain tensors; mark them or hand them to parallelize
        loss = model(input_ids=ids, labels=labels).loss
"""
from __future__ import annotations

import torch

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, SEQ = 128, 64, 128, 4, 2, 16


def tiny_llama(layers: int = 2, tie: bool = False, seed: int = 0, attention: str = "eager", **config):
    """A freshly initialised LlamaForCausalLM (fp32; `attention` is HF's attn_implementation,
    "eager" or "sdpa")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ,
        tie_word_embeddings=tie, attn_implementation=attention, **config,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def batches(n: int = 3, batch: int = 4, seq: int = SEQ, seed: int = 1) -> list:
    """n (input_ids, labels) pairs; labels are the ids (HF shifts them inside the loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append((ids, ids.clone()))
    return out


def mp_plan() -> dict:
    """Megatron's plan keyed by HF's names: q/k/v/gate/up by columns, o/down by rows, the
    LM head by vocabulary."""
    import autopar as dist

    plan = {
        "model.layers.*.self_attn.q_proj": dist.ColWiseParallel(),
        "model.layers.*.self_attn.k_proj": dist.ColWiseParallel(),
        "model.layers.*.self_attn.v_proj": dist.ColWiseParallel(),
        "model.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
        "model.layers.*.mlp.gate_proj": dist.ColWiseParallel(),
        "model.layers.*.mlp.up_proj": dist.ColWiseParallel(),
        "model.layers.*.mlp.down_proj": dist.RowWiseParallel(),
        "lm_head": dist.ColWiseParallel(),
    }
    return plan


def train(model, opt, data, clip=None, steps=None, grads=None) -> list:
    """Plain training loop: returns the losses as floats (every rank reads them).  With a
    list `grads`, each step appends {name: the full gradient} before the update."""
    import autopar as dist

    losses = []
    for ids, labels in data[:steps]:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if clip is not None:
            clip(model)
        if grads is not None:
            grads.append({k: dist.unshard_dtensor(p.grad) for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the gradient, so float rounding in a
    parallel run's gradients stays rounding in its weights (AdamW divides a near-zero
    gradient by its own magnitude and turns rounding into a step-sized difference)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(data, clip=None, grads=None, make_optimizer=optimizer, **model_kw) -> tuple[list, dict]:
    """The single-process run: losses and final weights (and gradients, given a list)."""
    model = tiny_llama(**model_kw)
    losses = train(model, make_optimizer(model.parameters()), data, clip=clip, grads=grads)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_matches(got: tuple, ref: tuple) -> None:
    """(losses, weights, gradients per step) of a parallel run against the single-process
    run's, to rtol 1e-5."""
    import numpy as np

    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for k, v in ref[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"weight {k}: {m}")
    for step, (g, r) in enumerate(zip(got[2], ref[2])):
        assert g.keys() == r.keys(), (step, sorted(set(g) ^ set(r)))
        for k, v in r.items():
            torch.testing.assert_close(g[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} grad {k}: {m}")
