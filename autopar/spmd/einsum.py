"""Strategies from an einsum-like equation, e.g. "mk,kn->mn" for mm.

A letter kept in the output can shard every operand that has it (output sharded too);
a contracted letter shards the operands that have it and leaves the output Partial(sum).
`linear_in` lists operands the op is linear in: a Partial(sum/avg) there (others
Replicate) gives a Partial output of the same kind.
"""
from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .strategy import LINEAR_PARTIALS, OpStrategy



def einsum_strategies(equation: str, linear_in: tuple = (), sizes: dict | None = None) -> list[OpStrategy]:
    """Single-mesh-dim strategies for `equation` ("ab,bc->ac").

    `sizes` (letter -> size per operand, optional) lets broadcast operands of size 1 stay
    Replicate while the others shard.
    """
    lhs, out = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    letters = sorted(set("".join(operands)), key=lambda c: (c not in out, (out + lhs).index(c)))
    strategies = []
    for c in letters:
        ins = tuple(Shard(op.index(c)) if c in op and not _broadcast(sizes, i, c) else Replicate()
                    for i, op in enumerate(operands))
        if all(type(p) is Replicate for p in ins):
            continue
        output = Shard(out.index(c)) if c in out else Partial()
        strategies.append(OpStrategy((output,), ins))
    for i in linear_in:
        for p in LINEAR_PARTIALS:
            strategies.append(OpStrategy((p,), tuple(p if j == i else Replicate() for j in range(len(operands)))))
    return strategies


def _broadcast(sizes, i: int, c: str) -> bool:
    return bool(sizes) and sizes.get((i, c)) == 1 and any(
        v != 1 for (j, l), v in sizes.items() if l == c and j != i
    )
