"""Discrete Fourier transforms (_fft_r2c/_fft_c2r/_fft_c2c: torch.fft.*, stft's spectra) and
the complex<->real views around them (a magnitude's backward goes through view_as_real).

A transform mixes every position of its dims and none across the others: dims it leaves alone
(batch, channels, frames) keep their shards, transformed dims stay whole.  It is linear:
Partial(sum/avg) passes.  view_as_real adds a trailing (re, im) dim, view_as_complex takes it
away: every other dim keeps its shard.
"""
from __future__ import annotations

import torch

from ..placement import Shard
from .registry import register
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten


@register([aten._fft_r2c, aten._fft_c2r, aten._fft_c2c])
def fft_rule(call: OpCall) -> list[OpStrategy]:
    shape = call.inputs[0].shape
    transformed = {d % len(shape) for d in call.arg(1, "dim")}
    strategies = [OpStrategy((Shard(d),), (Shard(d),))
                  for d in range(len(shape)) if d not in transformed and shape[d] != 1]
    return strategies + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register([aten.view_as_real, aten.view_as_complex])
def complex_view_rule(call: OpCall) -> list[OpStrategy]:
    shape = call.outputs[0].shape if call.func._schema.name == "aten::view_as_real" else call.inputs[0].shape
    strategies = [OpStrategy((Shard(d),), (Shard(d),)) for d in range(len(shape) - 1) if shape[d] != 1]
    return strategies + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]
