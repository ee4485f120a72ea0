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

On a GPU the same call reaches one of three CUDA kernels, each with its backward:
_scaled_dot_product_flash_attention, _efficient_attention (with an additive bias) and
_cudnn_attention.  They split by batch and by heads as above (the bias and its gradient
with them).  Their query rows do not split here: the flash and cuDNN kernels carry the
longest sequence as an int the backward reads, the efficient kernel pads its logsumexp
to a multiple of 32 rows, and a causal flash kernel takes no mask to offset (a sequence
split is context parallel's ring).  With dropout the kernel draws its mask from the
global positions of a philox stream no piece can reproduce: such a call runs whole
(Replicate), never split into different masks.
"""
from __future__ import annotations

import functools

import torch

from ..placement import Partial, Replicate, Shard
from ..spec import TensorMeta
from .registry import register, register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_B, _H, _L = 0, 1, 2  # dims of q / the scores


@functools.lru_cache(maxsize=None)
def _arg_names(func) -> tuple:
    """The names of an op's arguments, in its schema's order (read per call by the kernels)."""
    return tuple(a.name for a in func._schema.arguments)


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
    at = _arg_names(func).index("is_causal")
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


# -- the CUDA kernels ---------------------------------------------------------------------------
_CUDA_FWD = (
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
_CUDA_BWD = (
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)
# each tensor argument's part: split like the query rows, like the keys, like the scores
# (the bias), or whole (the philox seed and offset, the cumulative sequence lengths)
_ROW_ARGS = {"query", "grad_out", "grad_out_", "out", "logsumexp"}
_KV_ARGS = {"key", "value"}


def _tensor_args(call: OpCall) -> list:
    """(argument name, meta) of each tensor input, in the order of `call.inputs`."""
    names = _arg_names(call.func)
    given = list(zip(names, call.args)) + list(call.kwargs.items())
    return [(name, v) for name, v in given if isinstance(v, TensorMeta)]


def _cuda_strategies(call: OpCall, backward: bool) -> list[OpStrategy]:
    args = _tensor_args(call)
    by_name = dict(args)
    q, k = by_name["query"], by_name["key"]
    mask = by_name.get("attn_bias")
    scores = (q.shape[_B], q.shape[_H], q.shape[_L], k.shape[2])
    hq, hk = q.shape[_H], k.shape[_H]
    at = {name: i for i, (name, _) in enumerate(args)}
    dropout = call.arg(_arg_names(call.func).index("dropout_p"), "dropout_p", 0.0)
    strategies = []
    if not dropout:
        qkv_even = tuple((at[n], _H) for n in ("query", "key", "value"))
        options = [(_B, True, ()), (_H, True, () if hq == hk else qkv_even)]
        if hk == 1 and hq != 1:
            options.append((_H, False, ()))
        for dim, kv_sharded, even in options:
            row = Shard(dim)
            kv = row if kv_sharded else Replicate()
            bias = _mask_placement(mask, scores, dim) if mask is not None else None
            part = {**{n: row for n in _ROW_ARGS}, **{n: kv for n in _KV_ARGS}, "attn_bias": bias}
            inputs = tuple(part.get(name, Replicate()) for name, _ in args)
            if backward:  # grad_query, grad_key, grad_value[, grad_bias]
                grads = (row, kv, kv) if kv_sharded else (row, Partial(), Partial())
                outputs = (grads + (bias,))[: len(call.outputs)]
            else:  # output, logsumexp, then the philox state and debug outputs, whole
                outputs = (row, row) + (Replicate(),) * (len(call.outputs) - 2)
            strategies.append(OpStrategy(outputs, inputs, "sdpa_cuda", even))
    if backward:  # linear in grad_out, the rest fixed: a Partial grad_out gives Partial gradients
        first = at["grad_out"] if "grad_out" in at else at["grad_out_"]
        rest = [Replicate()] * len(args)
        for p in LINEAR_PARTIALS:
            inputs = tuple(p if i == first else r for i, r in enumerate(rest))
            strategies.append(OpStrategy((p,) * len(call.outputs), inputs))
    return strategies


@register(_CUDA_FWD)
def sdpa_cuda_rule(call: OpCall) -> list[OpStrategy]:
    return _cuda_strategies(call, False)


@register(_CUDA_BWD)
def sdpa_cuda_backward_rule(call: OpCall) -> list[OpStrategy]:
    return _cuda_strategies(call, True)


def _cuda_is_plain(func, in_specs, coord) -> bool:
    """Non-empty pieces: the kernel has nothing to fix."""
    return all(0 not in s.local_shape(coord) for s in in_specs[:4])


@register_kernel("sdpa_cuda", plain_when=_cuda_is_plain)
def sdpa_cuda_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The local attention on a batch or head split, with the two fixes of `sdpa_kernel`
    that apply: q, k, v (and grad_out, out) get a contiguous last dim, and an empty piece
    (fewer heads or sequences than ranks) gives zeros instead of calling the kernel."""
    names = _arg_names(func)
    args = [a.contiguous() if names[i] in _ROW_ARGS | _KV_ARGS and a.dim() and a.stride(-1) != 1 else a
            for i, a in enumerate(args)]
    qi = names.index("query")
    if args[qi].numel() == 0 or args[qi + 1].numel() == 0:
        device = args[qi].device
        return tuple(torch.zeros(s.local_shape(coord), dtype=s.meta.dtype, device=device) for s in out_specs)
    return func(*args, **kwargs)
