"""Batched linear algebra: solves, factorizations, inverses, determinants, decompositions.

Each operand is a batch of matrices (or vectors, or scalars per matrix): its last `core` dims
belong to one problem, the dims before are batch dims that broadcast as in elementwise ops.
Problems are independent, so a batch dim shards on every operand that has it (the outputs
too); the matrix dims stay whole.  The solves are linear in their right-hand side: a Partial
sum/avg B with A whole gives a Partial solution.

An op that checks its results (check_errors=True, cholesky) would raise on the ranks holding
a bad matrix only: it runs whole, so every rank raises torch's error.  _linalg_check_errors
(the check linalg.inv, linalg.cholesky... make after the op) checks every matrix's info on
every rank for the same reason.
"""
from __future__ import annotations

import math

import torch

from ..placement import Replicate, Shard
from .registry import WHOLE_FOR_AUTOGRAD, register
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten


def _solve_cores(call: OpCall):
    """B (and the result) are vectors where torch reads them so: B 1-D, or A's shape less its last dim."""
    a, b = call.inputs[0].shape, call.inputs[1].shape
    vector = len(b) == 1 or (len(b) == len(a) - 1 and b == a[:-1])
    return (2, 1 if vector else 2), (1 if vector else 2, 2, 1, 0)


# op -> (core dims of each input, of each output) or a function of the call giving them;
# the position of check_errors, where the op has one; the (input, output) it is linear in
_OPS = {
    aten._linalg_solve_ex.default: (_solve_cores, 3, (1, 0)),
    aten.linalg_solve_triangular.default: (((2, 2), (2,)), None, (1, 0)),
    aten.triangular_solve.default: (((2, 2), (2, 2)), None, (0, 0)),
    aten.cholesky_solve.default: (((2, 2), (2,)), None, (0, 0)),
    aten.linalg_lu_solve.default: (((2, 1, 2), (2,)), None, (2, 0)),
    aten.linalg_ldl_solve.default: (((2, 1, 2), (2,)), None, (2, 0)),
    aten.linalg_cholesky_ex.default: (((2,), (2, 0)), 2, None),
    aten.linalg_inv_ex.default: (((2,), (2, 0)), 1, None),
    aten.linalg_lu_factor_ex.default: (((2,), (2, 1, 0)), 2, None),
    aten.linalg_ldl_factor_ex.default: (((2,), (2, 1, 0)), 2, None),
    aten.linalg_lu.default: (((2,), (2, 2, 2)), None, None),
    aten.lu_unpack.default: (((2, 1), (2, 2, 2)), None, None),
    aten.cholesky_inverse.default: (((2,), (2,)), None, None),
    aten._linalg_det.default: (((2,), (0, 2, 1)), None, None),
    aten._linalg_slogdet.default: (((2,), (0, 0, 2, 1)), None, None),
    aten._linalg_eigh.default: (((2,), (1, 2)), None, None),
    aten.linalg_eig.default: (((2,), (1, 2)), None, None),
    aten._linalg_svd.default: (((2,), (2, 1, 2)), None, None),
    aten.linalg_qr.default: (((2,), (2, 2)), None, None),
    aten.linalg_householder_product.default: (((2, 1), (2,)), None, None),
    aten.ormqr.default: (((2, 1, 2), (2,)), None, None),
    aten.linalg_matrix_exp.default: (((2,), (2,)), None, None),
    aten.linalg_pinv.atol_rtol_tensor: (((2, 0, 0), (2,)), None, None),
}


def _batch_dim(shape, core: int, nb: int, b: int):
    """Dim of an operand aligned with broadcast batch dim b (None: the operand lacks it)."""
    d = b - (nb - (len(shape) - core))
    return d if 0 <= d < len(shape) - core else None


# their backward writes into the diagonal and narrowed columns of the reflectors it saved (input
# and tau: see the registry); ormqr's `other` splits as its rule allows
WHOLE_FOR_AUTOGRAD.update({aten.linalg_householder_product.default: (2, 1), aten.ormqr.default: (2, 1)})


@register(list(_OPS))
def batched_rule(call: OpCall) -> list[OpStrategy]:
    cores, check_at, linear = _OPS[call.func]
    in_cores, out_cores = cores(call) if callable(cores) else cores
    if check_at is not None and call.arg(check_at, "check_errors", False):
        return []
    in_cores = in_cores[:len(call.inputs)]  # pinv's tolerances may be None
    tensors = [(m.shape, c) for m, c in zip(list(call.inputs) + list(call.outputs), in_cores + out_cores)]
    nb = max(len(s) - c for s, c in tensors)
    strategies = []
    for b in range(nb):
        dims = [_batch_dim(s, c, nb, b) for s, c in tensors]
        size = max(s[d] for (s, _), d in zip(tensors, dims) if d is not None)
        placed = [Shard(d) if d is not None and s[d] == size else Replicate() for (s, _), d in zip(tensors, dims)]
        outs = placed[len(call.inputs):]
        if size == 1 or any(p == Replicate() and math.prod(s) for p, (s, _) in zip(outs, tensors[len(call.inputs):])):
            continue  # an output without this batch dim (an empty placeholder aside) needs it whole
        strategies.append(OpStrategy(tuple(outs), tuple(placed[:len(call.inputs)])))
    if linear is not None:
        i, o = linear
        n_in, n_out = len(call.inputs), len(call.outputs)
        strategies += [OpStrategy(tuple(p if j == o else Replicate() for j in range(n_out)),
                                  tuple(p if j == i else Replicate() for j in range(n_in))) for p in LINEAR_PARTIALS]
    return strategies


@register([aten._linalg_check_errors.default, aten.cholesky.default])
def whole_rule(call: OpCall) -> list[OpStrategy]:
    """Checks that raise where a matrix is bad: whole on every rank, so every rank raises."""
    return []
