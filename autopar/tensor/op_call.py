"""Calling an aten op on plain tensors by the quickest route that provably reaches it.

`OpOverload._op`, what a `__torch_dispatch__` handler usually calls, goes through torch's
boxed calling convention: every argument converted to an IValue and back, 0.6-0.9 us per
call over the generated Python binding (`torch.add`, `Tensor.view`, `torch._C._nn.gelu`),
whose argument parser calls the unboxed C++ kernel.  Both reach the same kernel unless the
parser picks another overload of the name for the given arguments, fills an omitted
argument with another default (`torch._C._nn.mse_loss(a, b)` reduces nothing, the schema's
default is the mean), or the binding is a composite that does more than the op.  So
`fast_op` finds out once per call site: it calls `_op` and the binding on meta stand-ins
under a dispatch mode that records every op reached with the arguments it receives, and
keeps the binding only when both reach the op once with the same arguments.

A binding, unlike `_op`, would show its call to a user's `TorchFunctionMode`; inside
`__torch_dispatch__` torch-function handling is off (torch turns it off there), and a
captured program replays with it turned off, so no mode sees the local ops.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# where the generated bindings live: torch.*, Tensor methods, torch.nn.functional's C half
_HOLDERS = (torch._C._VariableFunctions, torch._C.TensorBase, torch._C._nn)


class _Reached(TorchDispatchMode):
    """Records every aten op a call reaches, with its arguments as the op receives them (on
    meta tensors: shapes only, no data)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _reached(call: Callable, args, kwargs) -> list:
    seen = _Reached()
    with seen:
        call(*args, **kwargs)
    return seen.calls


def _same(a: Any, b: Any) -> bool:
    """The same argument: the same tensor object, or equal values of the same type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A data-less stand-in with t's shape, strides and dtype (a distributed tensor's are global)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return meta_like(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    if isinstance(v, torch.device):
        return torch.device("meta")
    return v


def fast_op(func: torch._ops.OpOverload, args, kwargs) -> Callable:
    """The quickest callable that runs `func` on arguments like `args`/`kwargs` (same types,
    any shapes): a Python binding that reaches `func` itself, else `func._op`.

    >>> import torch
    >>> a = torch.ones(2, 2)
    >>> fast_op(torch.ops.aten.add.Tensor, (a, a), {}) is torch._C._VariableFunctions.add
    True
    >>> fast_op(torch.ops.aten.add.Scalar, (a, 2), {}) is torch.ops.aten.add.Scalar._op  # torch.add(a, 2) is add.Tensor
    True
    """
    schema = func._schema
    namespace, _, name = schema.name.partition("::")
    if namespace != "aten" or not any(isinstance(a, torch.Tensor) for a in args):
        return func._op
    margs, mkwargs = _meta(tuple(args)), {k: _meta(v) for k, v in kwargs.items()}
    try:
        expected = _reached(func._op, margs, mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: nothing to compare with
        return func._op
    for holder in _HOLDERS:
        binding = getattr(holder, name, None)
        if binding is None:
            continue
        try:
            got = _reached(binding, margs, mkwargs)
        except Exception:  # noqa: BLE001 - a binding that does not take these arguments
            continue
        if len(got) == 1 and _same(got, expected):
            return binding
    return func._op
