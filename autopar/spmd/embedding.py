"""Embedding lookup and its weight gradient; embedding_bag over a hidden-split weight.

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
from .registry import register, register_kernel
from .strategy import ALL_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy
from .tensor_ops import with_arg

aten = torch.ops.aten


@register([aten.embedding.default])
def embedding_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.inputs[1].shape)
    strategies = [OpStrategy((Shard(d),), (Replicate(), Shard(d))) for d in range(nd)]
    strategies.append(OpStrategy((Shard(nd),), (Shard(1), Replicate())))
    strategies.append(OpStrategy((Partial(),), (Shard(0), Replicate()), kernel="vocab_embedding"))
    return strategies + [OpStrategy((p,), (p, Replicate())) for p in ALL_PARTIALS]


@register([aten.embedding_dense_backward.default])
def embedding_backward_rule(call: OpCall) -> list[OpStrategy]:
    """From a Replicate grad the op cannot tell how the weight lies; the engine's memory
    tie-break picks the vocab-row gradient (no rank ever holds the full vocab x hidden
    gradient, the point of a vocab-sharded weight), so a replicated or column-sharded weight
    reached by a Replicate grad gets a Shard(0) gradient too (the optimizer moves it to the
    weight's placement once per step)."""
    nd = len(call.inputs[0].shape)
    strategies = [OpStrategy((Shard(1),), (Shard(nd - 1), Replicate()))]
    if not call.arg(4, "scale_grad_by_freq", False):
        strategies += [OpStrategy((Partial(),), (Shard(d), Shard(d))) for d in range(nd - 1)]
    strategies.append(
        OpStrategy((Shard(0),), (Replicate(), Replicate()), kernel="vocab_embedding_backward")
    )
    return strategies + [OpStrategy((p,), (p, Replicate())) for p in LINEAR_PARTIALS]


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


# -- embedding_bag: the hidden dim split ------------------------------------------------------------
def _bag_tensors(call: OpCall, split_like: tuple) -> tuple:
    """Shard(1) for the tensors shaped (bags, hidden) (split_like: their sizes), the rest whole."""
    return tuple(Shard(1) if len(m.shape) == 2 and tuple(m.shape) == split_like else Replicate() for m in call.inputs)


@register([aten._embedding_bag.default, aten._embedding_bag_forward_only.default])
def embedding_bag_rule(call: OpCall) -> list[OpStrategy]:
    """(output, offset2bag, bag_size, max_indices): each bag sums, averages or takes the max of
    its rows column by column, so a weight split on the hidden dim gives the output (and max's
    per-column indices) split alike; the rest depend on the indices alone.  Sum and mean are
    linear in the weight: a Partial weight passes."""
    out, idx = call.outputs[0].shape, call.outputs[3].shape
    if out[1] == 1:
        return []
    ins = (Shard(1),) + (Replicate(),) * (len(call.inputs) - 1)
    outs = (Shard(1), Replicate(), Replicate(), Shard(1) if idx == out else Replicate())
    strategies = [OpStrategy(outs, ins)]
    if call.arg(4, "mode", 0) != 2:
        rest = (Replicate(),) * (len(call.inputs) - 1)
        strategies += [OpStrategy((p, Replicate(), Replicate(), Replicate()), (p,) + rest) for p in LINEAR_PARTIALS]
    return strategies


@register([aten._embedding_bag_backward.default])
def embedding_bag_backward_rule(call: OpCall) -> list[OpStrategy]:
    """grad (bags, hidden) split on the hidden dim gives the weight gradient's columns (max's
    per-column indices split with it); the dense gradient only."""
    grad = tuple(call.inputs[0].shape)
    if call.arg(9, "sparse", False) or grad[1] == 1:
        return []
    return [OpStrategy((Shard(1),), _bag_tensors(call, grad))]


@register([aten._embedding_bag_per_sample_weights_backward.default])
def embedding_bag_per_sample_weights_backward_rule(call: OpCall) -> list[OpStrategy]:
    """d(bag) / d(sample weight) sums grad * row over the hidden dim: split, a Partial(sum) term."""
    if call.inputs[0].shape[1] == 1:
        return []
    return [OpStrategy((Partial(),), (Shard(1), Shard(1)) + (Replicate(),) * (len(call.inputs) - 2))]
