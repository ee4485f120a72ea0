"""Mixture-of-experts expert layers, as a whole: each token's output comes from that token alone.

A module holding its experts' weights as 3-D Parameters ([experts, ...]) and a `num_experts`,
called as `experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights
[tokens, k])` (HuggingFace's MixtralExperts, Qwen2MoeExperts and their kin), computes each
token's result from its own hidden state, expert choice and weights: with the tokens split
alike over a mesh dim and the weights whole there, each rank's forward on its own tokens is its
piece of the result.  So the module runs as a local region without verification; op by op it
would sort the whole batch's tokens by expert (a gather of the batch) to compute the same.
Dropless routing only: a module with a capacity (tokens dropped by how many others chose the
same expert) is not per token, and has no `num_experts` with 3-D weights and no other
parameters, or is not called this way.  Weights split over their experts (`ExpertParallel`)
are not whole: runtime/experts.py sends each token to its expert's rank instead.
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from ..spec import DistSpec
from .registry import MODULE_RULES


def experts_module_rule(module: torch.nn.Module, args, kwargs, param_specs):
    """The output spec (the hidden states') when `module` is an expert layer called on tokens
    split alike on their dim 0 (or whole) with whole weights; else None (verification decides)."""
    if getattr(module, "num_experts", None) is None or kwargs or len(args) != 3:
        return None
    params = list(module.parameters())
    if not params or any(p.dim() != 3 or p.shape[0] != module.num_experts for p in params):
        return None
    hidden, index, weights = args
    if not all(isinstance(s, DistSpec) for s in args) or any(p is None or not p.is_replicated() for p in param_specs):
        return None
    if hidden.ndim != 2 or index.ndim != 2 or weights.ndim != 2 or not (
            hidden.shape[0] == index.shape[0] == weights.shape[0]):
        return None
    if not hidden.mesh == index.mesh == weights.mesh or hidden.mesh != param_specs[0].mesh:
        return None
    for ph, pi, pw in zip(hidden.placements, index.placements, weights.placements):
        if not (ph == pi == pw and type(ph) in (Shard, Replicate) and (type(ph) is Replicate or ph.dim == 0)):
            return None
    if not any(type(p) is Shard for p in hidden.placements):
        return None  # nothing split: verification decides
    return hidden


MODULE_RULES[torch.nn.Module] = experts_module_rule
