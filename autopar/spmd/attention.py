"""scaled_dot_product_attention: F.scaled_dot_product_attention on CPU reaches
aten._scaled_dot_product_flash_attention_for_cpu and its backward (with dropout it takes
the math path, made of matmul/softmax/dropout ops ruled elsewhere).

q (B, Hq, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev), optional additive mask broadcastable
to the scores (B, Hq, L, S); outputs out (B, Hq, L, Ev) and logsumexp (B, Hq, L).
  batch or heads shard q, k, v, outputs (and the mask where it has the dim) alike: no
  communication.  With grouped-query heads (Hq != Hk) both head counts must split evenly so
  each rank keeps whole groups; a single shared kv head (Hk == 1) stays whole and its
  gradient comes back Partial;
  the query rows (L) shard with k, v whole: each row attends to every key.  Causal
  attention needs the global row index, so a kernel turns is_causal into an explicit mask
  offset by this rank's first row.  In the backward, k and v get Partial gradients;
  the backward is linear in grad_out (out and logsumexp fixed): a Partial grad_out gives
  Partial gradients.
The sharded strategies run the kernel `sdpa`, which also skips the op on an empty piece
(more ranks than heads or rows: the CPU op faults on zero heads or rows).
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import register, register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_B, _H, _L = 0, 1, 2  # dims of q / the scores


def _mask_placement(mask, scores: tuple, dim: int):
    """Shard the mask on its dim aligned with scores dim `dim` unless it broadcasts there."""
    j = dim - (len(scores) - len(mask.shape))
    return Shard(j) if j >= 0 and mask.shape[j] == scores[dim] != 1 else Replicate()


def _strategies(q, k, mask, backward: bool) -> list[OpStrategy]:
    """The forward (inputs q, k, v, [mask]; outputs out, lse) or the backward (inputs
    grad_out, q, k, v, out, lse, [mask]; outputs grad_q, grad_k, grad_v) strategies."""
    scores = (q.shape[_B], q.shape[_H], q.shape[_L], k.shape[2])
    hq, hk = q.shape[_H], k.shape[_H]
    off = 1 if backward else 0  # index of q among the inputs
    qkv_even = tuple((off + i, _H) for i in range(3))
    # (scores dim sharded, whether k/v shard with it, operand dims that must split evenly)
    options = [(_B, True, ()), (_H, True, () if hq == hk else qkv_even)]
    if hk == 1 and hq != 1:
        options.append((_H, False, ()))
    options.append((_L, False, ()))
    strategies = []
    for dim, kv_sharded, even in options:
        row = Shard(dim)
        kv = row if kv_sharded else Replicate()
        m = (_mask_placement(mask, scores, dim),) if mask is not None else ()
        if backward:
            grads = (row, kv, kv) if kv_sharded else (row, Partial(), Partial())
            strategies.append(OpStrategy(grads, (row, row, kv, kv, row, row) + m, "sdpa", even))
        else:
            strategies.append(OpStrategy((row, row), (row, kv, kv) + m, "sdpa", even))
    if backward:
        rest = (Replicate(),) * (5 + (mask is not None))
        strategies += [OpStrategy((p, p, p), (p,) + rest) for p in LINEAR_PARTIALS]
    return strategies


@register(_FWD)
def sdpa_rule(call: OpCall) -> list[OpStrategy]:
    mask = call.inputs[3] if len(call.inputs) > 3 else None
    return _strategies(call.inputs[0], call.inputs[1], mask, False)


@register(_BWD)
def sdpa_backward_rule(call: OpCall) -> list[OpStrategy]:
    mask = call.inputs[6] if len(call.inputs) > 6 else None
    return _strategies(call.inputs[1], call.inputs[2], mask, True)


def _sdpa_is_plain(func, in_specs, coord) -> bool:
    """Whole query rows and non-empty pieces: the kernel has nothing to fix."""
    qi = 1 if func is _BWD else 0
    q, k = in_specs[qi], in_specs[qi + 1]
    return not q.sharding_mesh_dims(_L) and 0 not in q.local_shape(coord) and 0 not in k.local_shape(coord)


def _unit_last_stride(args: list, n: int) -> list:
    """`args` with its first `n` tensors given a unit stride on their last dim.  The CPU
    flash op reads q, k, v (and grad_out, out in the backward) as if their last dim were
    contiguous, and silently computes garbage otherwise: F.scaled_dot_product_attention
    checks that on the global tensor, but a piece may be laid out otherwise (a reshard lays
    it out in the global tensor's dim order, where a broadcast dim, stride 0, as HF's
    repeat_kv makes, comes innermost)."""
    return [a.contiguous() if i < n and a.dim() and a.stride(-1) != 1 else a for i, a in enumerate(args)]


@register_kernel("sdpa", plain_when=_sdpa_is_plain)
def sdpa_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The local attention, with three fixes a plain call lacks:
    q, k, v get a contiguous last dim (see _unit_last_stride);
    an empty piece (fewer heads or query rows than ranks) skips the op, which faults on
    empty heads/rows, and gives zeros (its share of any Partial gradient);
    query rows [a, b) of a causal attention see keys j <= a + i (top-left aligned, as
    is_causal means globally): is_causal becomes an explicit mask offset by a."""
    qi = 1 if func is _BWD else 0
    args = _unit_last_stride(list(args), 5 if func is _BWD else 3)
    q, k = args[qi], args[qi + 1]
    if q.numel() == 0 or k.numel() == 0:
        return tuple(torch.zeros(s.local_shape(coord), dtype=s.meta.dtype, device=q.device) for s in out_specs)
    at = [a.name for a in func._schema.arguments].index("is_causal")
    causal = args[at] if at < len(args) else kwargs.get("is_causal", False)
    if causal and in_specs[qi].sharding_mesh_dims(_L):
        first = in_specs[qi].local_box(coord)[_L][0]
        rows = torch.arange(first, first + q.shape[_L], device=q.device).unsqueeze(1)
        explicit = torch.zeros(q.shape[_L], k.shape[2], dtype=q.dtype, device=q.device)
        explicit.masked_fill_(torch.arange(k.shape[2], device=q.device) > rows, float("-inf"))
        mask = kwargs.get("attn_mask")
        kwargs = {**kwargs, "attn_mask": explicit if mask is None else mask + explicit}
        if at < len(args):
            args = list(args[:at]) + [False] + list(args[at + 1:])
        else:
            kwargs["is_causal"] = False
    return func(*args, **kwargs)
