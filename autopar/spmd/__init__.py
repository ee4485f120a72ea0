"""Sharding propagation: per-op rules (one module per op family) and the engine that picks.

Importing this package registers every rule module.
"""
from . import engine, registry  # noqa: F401
from .registry import register, register_kernel, rule_for  # noqa: F401
from .strategy import OpCall, OpStrategy  # noqa: F401
from . import matmul, pointwise, view, tensor_ops, embedding, reduction, norm, softmax, loss, attention, random, optim  # noqa: F401,E402  (rule modules register on import)
from . import spatial, conv, batch_norm, pool, resample, rnn, fft  # noqa: F401,E402
from . import view_scatter, linalg, experts  # noqa: F401,E402
