"""Recurrent layers: the fused RNN ops of each backend and the pieces of the composite cells.

A recurrent layer runs each sequence of the batch alone: with the batch split, every rank runs
the layer on its own sequences, the weights whole, and the weight gradients come out
Partial(sum).  The ops that take a whole sequence:
  CPU LSTM  mkldnn_rnn_layer (one layer, one direction): input (T, B, F), states (B, H) (the caller
            has transposed a batch-first input already: its batch_first flag only misleads the
            meta shapes, which are the same);
  GPU       _cudnn_rnn (every layer and direction): states (layers x directions, B, H);
and the fused cells of the GPU's step-by-step path (_thnn_fused_lstm_cell/_gru_cell: rows are
sequences).  Their workspace/reserve outputs are opaque buffers of the local call, valid only
for the same pieces: they are never moved (None in the backward), and the backward's batch
strategy is always the cheapest there (the saved input and output are batch-split already).
A packed sequence (batch_sizes given) is one flat time-major tensor: it stays whole.

CPU GRU/RNN (and LSTM off mkldnn) are composite: their per-step ops have their own rules, but
the input projection merges time and batch into one dim, which a split batch cannot follow; the
module-level declaration below makes nn.RNN/GRU/LSTM over a split batch run as a local region.
"""
from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from ..spec import DistSpec, TensorMeta
from .registry import MODULE_RULES, register
from .strategy import OpCall, OpStrategy
from .tensor_ops import split_rule, split_sizes_local

aten = torch.ops.aten
_R, _P = Replicate(), Partial()

# GRU/LSTM cells' chunk (the same number of pieces locally) and its split forms
register([aten.unsafe_split, aten.unsafe_split_with_sizes], local_args=split_sizes_local)(split_rule)
register([aten.unsafe_chunk])(split_rule)


def _batch_dim(call: OpCall, batch_first_at: int) -> int:
    return 0 if call.arg(batch_first_at, "batch_first") else 1


def _packed(call: OpCall, at: int) -> bool:
    return bool(call.arg(at, "batch_sizes"))


# -- CPU: mkldnn_rnn_layer ---------------------------------------------------------------------
@register(aten.mkldnn_rnn_layer)
def mkldnn_rnn_layer_rule(call: OpCall) -> list[OpStrategy]:
    """(input, w0..w3, hx (B, H), cx (B, H)) -> (output, hy, cy, workspace)."""
    if _packed(call, 8) or call.inputs[0].shape[1] == 1:
        return []
    b = Shard(1)
    return [OpStrategy((b, Shard(0), Shard(0), _R), (b, _R, _R, _R, _R, Shard(0), Shard(0)))]


@register(aten.mkldnn_rnn_layer_backward)
def mkldnn_rnn_layer_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(input, w1..w4, hx, cx, output, hy, cy, grad_output?, grad_hy?, grad_cy?, ..., workspace)
    -> (grad_input, grad_w1..w4, grad_hx, grad_cx)."""
    if _packed(call, 20) or call.inputs[0].shape[1] == 1:
        return []
    b, rows = Shard(1), Shard(0)
    grads = tuple(b if name == "grad_output" else rows
                  for i, name in ((10, "grad_output"), (11, "grad_hy"), (12, "grad_cy")) if call.arg(i, name) is not None)
    ins = (b, _R, _R, _R, _R, rows, rows, b, rows, rows) + grads + (None,)
    return [OpStrategy((b, _P, _P, _P, _P, rows, rows), ins)]


# -- GPU: _cudnn_rnn ---------------------------------------------------------------------------
@register(aten._cudnn_rnn)
def cudnn_rnn_rule(call: OpCall) -> list[OpStrategy]:
    """(input, weights[], weight_buf?, hx, cx?, ..., dropout_state?) -> (output, hy, cy, reserve, weight_buf)."""
    if _packed(call, 14) or call.inputs[0].shape[_batch_dim(call, 10)] == 1:
        return []
    if call.arg(12, "train") and call.arg(11, "dropout"):
        return []  # dropout between layers draws per rank
    b = Shard(_batch_dim(call, 10))
    n_weights = len(call.arg(1, "weight"))
    ins = (b,) + (_R,) * n_weights + (_R,) * (call.arg(3, "weight_buf") is not None) + (Shard(1),)
    ins += (Shard(1),) * (call.arg(5, "cx") is not None) + (_R,) * (call.arg(15, "dropout_state") is not None)
    outs = (b, Shard(1), Shard(1), _R, _R)[: len(call.outputs)]
    return [OpStrategy(outs, ins)]


@register(aten._cudnn_rnn_backward)
def cudnn_rnn_backward_rule(call: OpCall) -> list[OpStrategy]:
    """(input, weights[], weight_buf, hx, cx?, output, grad_output?, grad_hy?, grad_cy?, ...,
    dropout_state?, reserve) -> (grad_input, grad_hx, grad_cx, grad_weights[]) as output_mask asks."""
    if _packed(call, 18) or call.inputs[0].shape[_batch_dim(call, 14)] == 1:
        return []
    b, states = Shard(_batch_dim(call, 14)), Shard(1)
    n_weights = len(call.arg(1, "weight"))
    present = lambda i: call.args[i] is not None  # noqa: E731  (every argument arrives positionally)
    ins = (b,) + (_R,) * n_weights + (_R, states) + (states,) * present(5) + (b,)
    ins += (b,) * present(7) + (states,) * present(8) + (states,) * present(9)
    ins += (_R,) * present(19) + (None,)
    mask = call.arg(21, "output_mask")
    outs = (b,) * mask[0] + (states,) * mask[1] + (states,) * (mask[2] and present(5)) + (_P,) * n_weights * mask[3]
    return [OpStrategy(outs[: len(call.outputs)], ins)]


# -- fused cells (rows are sequences) ------------------------------------------------------------
@register([aten._thnn_fused_lstm_cell, aten._thnn_fused_lstm_cell_backward_impl, aten._thnn_fused_gru_cell,
           aten._thnn_fused_gru_cell_backward])
def fused_cell_rule(call: OpCall) -> list[OpStrategy]:
    """Row-shaped (2-D) operands split their rows; biases (1-D) stay whole and their gradients
    come out Partial(sum)."""
    rows = [m.shape[0] for m in call.inputs if len(m.shape) == 2]
    if not rows or rows[0] == 1:
        return []
    ins = tuple(Shard(0) if len(m.shape) == 2 else _R for m in call.inputs)
    outs = tuple(Shard(0) if len(m.shape) == 2 else _P for m in call.outputs)
    return [OpStrategy(outs, ins)]


# -- nn.RNN / nn.GRU / nn.LSTM as a whole ---------------------------------------------------------
def recurrent_module_rule(module: torch.nn.RNNBase, args, kwargs, param_specs):
    """nn.RNN/GRU/LSTM over a batch split on its batch dim (every other dim and the parameters
    whole, no dropout drawn between layers): each rank's layer runs on its own sequences, so the
    output is split on its batch dim and the final state on its dim 1, alike.  An LSTM's nested
    (h, c) output and explicit state stay op by op (its fused ops have rules)."""
    if kwargs or len(args) not in (1, 2) or isinstance(module, torch.nn.LSTM):
        return None
    spec, hx = args[0], (args[1] if len(args) == 2 else None)
    if not isinstance(spec, DistSpec) or spec.ndim != 3 or (
            module.dropout and module.training and module.num_layers > 1):
        return None
    bd = 0 if module.batch_first else 1
    if any(type(p) is Partial or (type(p) is Shard and p.dim != bd) for p in spec.placements):
        return None
    if not any(type(p) is Shard for p in spec.placements):
        return None  # nothing split: verification decides
    state_placements = tuple(Shard(1) if type(p) is Shard else _R for p in spec.placements)
    if hx is not None and (not isinstance(hx, DistSpec) or hx.placements != state_placements):
        return None
    if any(p is None or not p.is_replicated() for p in param_specs):
        return None
    directions = 2 if module.bidirectional else 1
    width = module.proj_size or module.hidden_size
    steps, batch, dtype = spec.shape[1 - bd], spec.shape[bd], spec.meta.dtype
    time_major = TensorMeta.contiguous((steps, batch, directions * width), dtype)
    out = time_major if not module.batch_first else TensorMeta(
        (batch, steps, directions * width), _swap01(time_major.stride), dtype)
    h_n = TensorMeta.contiguous((directions * module.num_layers, batch, width), dtype)
    return DistSpec(spec.mesh, spec.placements, out), DistSpec(spec.mesh, state_placements, h_n)


def _swap01(stride) -> tuple:
    return (stride[1], stride[0]) + tuple(stride[2:])


MODULE_RULES[torch.nn.RNNBase] = recurrent_module_rule
