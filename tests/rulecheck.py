"""Build a rule's input as the dispatcher does, without processes: an OpCall from running the
op on meta tensors (tests of rules call `rule_for(op)(op_call(...))` or `engine.choose`)."""
from __future__ import annotations

import torch

from autopar.spec import TensorMeta
from autopar.spmd.strategy import OpCall


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    """A meta tensor of this shape: the rule sees only its meta."""
    return torch.empty(shape, dtype=dtype, device="meta")


def op_call(func, *args, **kwargs) -> OpCall:
    """The OpCall of `func` on these (meta) tensors: tensors, also inside lists, become their
    TensorMeta in the arguments and in the inputs; the outputs are the tensors the meta kernel
    makes (none where it makes None)."""
    metas = []

    def described(a):
        if isinstance(a, torch.Tensor):
            metas.append(TensorMeta.of(a))
            return metas[-1]
        if isinstance(a, (list, tuple)):
            return type(a)(described(x) for x in a)
        return a

    margs = tuple(described(a) for a in args)  # before the call: an out= op resizes its out tensor
    mkwargs = {k: described(v) for k, v in kwargs.items()}
    out = func(*args, **kwargs)
    outs = out if isinstance(out, (list, tuple)) else [out]
    return OpCall(func, margs, mkwargs, metas, [TensorMeta.of(o) for o in outs if isinstance(o, torch.Tensor)])
