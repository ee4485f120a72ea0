"""HuggingFace transformers' LlamaForCausalLM, tiny and built from a config (no download).

Shared by the tests that train a real HF model against the single-process run.

    model = tiny_llama()                   # 2 layers, GQA (4 heads, 2 kv heads), vocab 128
    for ids, labels in batches():          # plain tensors; mark them or hand them to parallelize
        loss = model(input_ids=ids, labels=labels).loss
"""
from __future__ import annotations

import torch

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, SEQ = 128, 64, 128, 4, 2, 16


def tiny_llama(layers: int = 2, tie: bool = False, seed: int = 0, **config):
    """A freshly initialised LlamaForCausalLM (fp32, eager attention: identical everywhere)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ,
        tie_word_embeddings=tie, attn_implementation="eager", **config,
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


def mp_plan(sequence_parallel: bool = False) -> dict:
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


def train(model, opt, data, clip=None, steps=None) -> list:
    """Plain training loop: returns the losses as floats (every rank reads them)."""
    losses = []
    for ids, labels in data[:steps]:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if clip is not None:
            clip(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(data, clip=None, lr: float = 1e-2, **model_kw) -> tuple[list, dict]:
    """The single-process run: losses and final weights."""
    model = tiny_llama(**model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = train(model, opt, data, clip=clip)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
