"""What a sharding rule returns: the valid placements of an op along ONE mesh dim."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..placement import Partial, Replicate
from ..spec import TensorMeta

# The Partial kinds an op keeps, by what it does to its operands' terms:
# a linear map: the map of a sum of terms is the sum of the mapped terms, a mean alike;
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))
# adding one number to every term: the mean of x_i + c is mean(x) + c, a sum would add c k times;
AFFINE_PARTIALS = (Partial("avg"),)
# writing one value over every rank's terms: the largest and smallest of equal values are that value;
EXTREME_PARTIALS = (Partial("max"), Partial("min"))
# moving, copying or selecting elements without combining them: every kind.
ALL_PARTIALS = LINEAR_PARTIALS + EXTREME_PARTIALS


@dataclass(frozen=True)
class OpStrategy:
    """One way to run an op along one mesh dim.

    `inputs[i]` is the placement tensor input i must have (None: any, the op only reads its
    shape); `outputs[j]` the placement of tensor output j.  `kernel` names a local kernel
    that replaces the plain op when this strategy is picked (vocab-sharded embedding...).
    `even` lists (input index, tensor dim) pairs that this strategy shards and whose size
    must divide evenly by the mesh dim (views that merge or split a sharded dim need it).
    """

    outputs: tuple
    inputs: tuple
    kernel: Optional[str] = None
    even: tuple = ()

    def __repr__(self) -> str:
        k = f", kernel={self.kernel}" if self.kernel else ""
        return f"{list(self.outputs)} <- {list(self.inputs)}{k}"


def replicated(n_in: int, n_out: int) -> OpStrategy:
    return OpStrategy((Replicate(),) * n_out, (Replicate(),) * n_in)


@dataclass
class OpCall:
    """What a rule sees: the op, its arguments with tensors replaced by their global
    `TensorMeta`, and the metas of the tensor inputs/outputs in flattened order."""

    func: Any
    args: tuple
    kwargs: dict
    inputs: Sequence[TensorMeta]
    outputs: Sequence[TensorMeta]

    def arg(self, index: int, name: str, default=None):
        """Positional-or-keyword argument value."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def in_ndim(self) -> int:
        return len(self.inputs[0].shape)

    @property
    def out_ndim(self) -> int:
        return len(self.outputs[0].shape)


def out_variant(rule):
    """The rule of an out= overload (mm.out, add.out...): the functional rule on the operands,
    each out tensor placed as the output it receives.  Kernels compute a new tensor rather
    than writing the out tensor, so their strategies are left out."""

    def with_out(call: OpCall) -> list:
        outs = [call.kwargs.get(a.name) for a in call.func._schema.arguments if a.is_out]
        n = sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in outs if v is not None)
        if not call.outputs or n != len(call.outputs) or any(
            o.shape != m.shape for o, m in zip(call.inputs[-n:], call.outputs)
        ):
            return []  # an out tensor torch resizes: whole on every rank
        inner = OpCall(call.func, call.args, call.kwargs, call.inputs[:-n], call.outputs)
        return [OpStrategy(s.outputs, s.inputs + s.outputs, even=s.even) for s in rule(inner) if s.kernel is None]

    return with_out
