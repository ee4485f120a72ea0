"""Embedding lookup and its weight gradient.

Forward `embedding(weight, ids)`: ids sharded (weight Replicate) -> output sharded the same;
weight sharded on the hidden dim 1 -> output sharded on its last dim; weight sharded on the
vocab dim 0 -> Megatron's VocabParallelEmbedding: each rank looks up the ids in its row range
and zeroes the others, so the output is Partial(sum) with no communication.

Backward `embedding_dense_backward(grad, ids, num_weights, ...)`: grad and ids batch-sharded
-> Partial(sum) (not with scale_grad_by_freq: the counts would be local); grad hidden-sharded
-> Shard(1); grad and ids Replicate -> each rank builds only its vocab rows -> Shard(0).
padding_idx (whose row gets no gradient) is shifted into each rank's row range.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .pointwise import _ALL_PARTIALS, _SUM_AVG
from .registry import register, register_kernel
from .strategy import OpCall, Strategy
from .tensor_ops import with_arg

aten = torch.ops.aten


@register([aten.embedding.default])
def embedding_rule(call: OpCall) -> list[Strategy]:
    nd = len(call.inputs[1].shape)
    strategies = [Strategy((Shard(d),), (Replicate(), Shard(d))) for d in range(nd)]
    strategies.append(Strategy((Shard(nd),), (Shard(1), Replicate())))
    strategies.append(Strategy((Partial(),), (Shard(0), Replicate()), kernel="vocab_embedding"))
    return strategies + [Strategy((p,), (p, Replicate())) for p in _ALL_PARTIALS]


@register([aten.embedding_dense_backward.default])
def embedding_backward_rule(call: OpCall) -> list[Strategy]:
    """From a Replicate grad the op cannot tell how the weight lies; the engine's memory
    tie-break picks the vocab-row gradient (no rank ever holds the full vocab x hidden
    gradient, the point of a vocab-sharded weight), so a replicated or column-sharded weight
    reached by a Replicate grad gets a Shard(0) gradient too (the optimizer moves it to the
    weight's placement once per step)."""
    nd = len(call.inputs[0].shape)
    strategies = [Strategy((Shard(1),), (Shard(nd - 1), Replicate()))]
    if not call.arg(4, "scale_grad_by_freq", False):
        strategies += [Strategy((Partial(),), (Shard(d), Shard(d))) for d in range(nd - 1)]
    strategies.append(
        Strategy((Shard(0),), (Replicate(), Replicate()), kernel="vocab_embedding_backward")
    )
    return strategies + [Strategy((p,), (p, Replicate())) for p in _SUM_AVG]


def _local_ids(ids: torch.Tensor, spec, coord, fill: int):
    """ids shifted into this rank's vocab rows, the others set to `fill`; their mask; the rows."""
    lo, hi = spec.local_box(coord)[0]
    outside = (ids < lo) | (ids >= hi)
    return (ids - lo).masked_fill(outside, fill), outside, (lo, hi)


def _local_padding(args, kwargs, index: int, lo: int, hi: int):
    """padding_idx as a row of this rank's piece (-1: the padding row lies elsewhere)."""
    padding = args[index] if index < len(args) else kwargs.get("padding_idx", -1)
    return with_arg(args, kwargs, index, "padding_idx", padding - lo if lo <= padding < hi else -1)


@register_kernel("vocab_embedding")
def vocab_embedding_kernel(func, args, kwargs, in_specs, out_specs, coord):
    weight = args[0]
    ids, outside, (lo, hi) = _local_ids(args[1], in_specs[0], coord, 0)
    if hi == lo:  # an empty piece of the vocab: every id lies elsewhere
        return weight.new_zeros(tuple(ids.shape) + (weight.shape[1],))
    args, kwargs = with_arg(args, kwargs, 1, "indices", ids)
    args, kwargs = _local_padding(args, kwargs, 2, lo, hi)
    return func(*args, **kwargs).masked_fill_(outside.unsqueeze(-1), 0)


@register_kernel("vocab_embedding_backward")
def vocab_embedding_backward_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Ids of other ranks' rows go to one extra row, dropped at the end (so with
    scale_grad_by_freq this rank's rows keep their global counts)."""
    rows = out_specs[0].local_shape(coord)[0]
    ids, _, (lo, hi) = _local_ids(args[1], out_specs[0], coord, rows)
    args, kwargs = with_arg(args, kwargs, 1, "indices", ids)
    args, kwargs = with_arg(args, kwargs, 2, "num_weights", rows + 1)
    args, kwargs = _local_padding(args, kwargs, 3, lo, hi)
    return func(*args, **kwargs)[:rows]
