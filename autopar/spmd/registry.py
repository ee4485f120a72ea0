"""The rule registry: aten op -> rule function (and optional local-argument rewriter)."""
from __future__ import annotations

from typing import Callable, Iterable

from .strategy import out_variant

RULES: dict = {}
# op -> the function registered for it (RULES holds its out= wrapper for out overloads)
RULE_FNS: dict = {}
LOCAL_ARGS: dict = {}
KERNELS: dict = {}
# kernel name -> fn(func, in_specs, coord): True where the kernel computes exactly the plain op
KERNEL_PLAIN_WHEN: dict = {}
# op -> fn(args, kwargs): names of the arguments the op writes although its schema does not
# say so (native_batch_norm updates the running statistics it is given in training)
UNDECLARED_WRITES: dict = {}
# kernel name -> fn(call, strategy): True where that strategy of the kernel splits only dims whose
# pieces the kernel treats alike wherever they lie (rows of a loss), so that the engine reads it
# with a StridedShard of those dims as well (see engine.strided_variants)
STRIDED_KERNELS: dict = {}
# module type -> fn(module, args, kwargs, param_specs): the specs of the outputs (a DistSpec or a
# tuple of them) when the module's forward on the local pieces computes exactly the local pieces
# of its global result for these inputs (it then runs as a local region unverified; see
# local_region), else None.  Rules see specs, not tensors: each tensor argument is its DistSpec
# (None for a plain tensor), `param_specs` the module's parameters' (None for a plain one).
MODULE_RULES: dict = {}
# ops that draw from the random generator: a rank outside their mesh still draws (and
# discards) the same numbers, so every rank's stream stays the single-process stream
DRAWS_RANDOM: set = set()
# op -> fn(*meta args, **meta kwargs): its output on meta tensors, for ops whose meta kernel
# refuses inputs that their kernels on a device take (_grouped_mm's takes bf16 only; the CPU
# kernel, which HF's mixture-of-experts layers call in fp32, takes fp32 too): the shapes a
# program gets are inferred as strictly as the program runs, no more
META_OUTPUTS: dict = {}
# op -> the number of core (matrix) dims of its leading tensor inputs, for ops whose derivative
# formula writes in place into views of the inputs autograd saved (householder_product's backward
# fills a diagonal, adds into narrowed columns): autograd is given those inputs with their core
# dims whole, so every view the backward writes into is local (a view that needed communication
# holds a copy, and a write into it is refused)
WHOLE_FOR_AUTOGRAD: dict = {}


def register(ops: Iterable | object, local_args: Callable | None = None, writes: Callable | None = None):
    """Decorator: `fn(call: OpCall) -> list[OpStrategy]` becomes the rule of every op in `ops`.

    `local_args(args, kwargs, out_local_shapes)` rewrites size arguments for the local op
    (view/expand/new_zeros take the *global* size, the local op needs the local one).
    `writes(args, kwargs)` names the arguments the op writes that its schema does not mark, so
    the dispatch keeps them where they are or moves them for good (never writes a copy).
    An overload has one rule: claiming one that has a rule already raises (else the later
    import would silently decide which rule the dispatch uses).
    """
    if not isinstance(ops, (list, tuple, set)):
        ops = [ops]

    def deco(fn):
        for op in ops:
            for overload in _overloads(op):
                if overload in RULE_FNS:
                    raise ValueError(f"{overload} is claimed by two rules, {_name(RULE_FNS[overload])} and "
                                     f"{_name(fn)}: an op overload takes one rule")
                RULE_FNS[overload] = fn
                RULES[overload] = out_variant(fn) if any(a.is_out for a in overload._schema.arguments) else fn
                if local_args is not None:
                    LOCAL_ARGS[overload] = local_args
                if writes is not None:
                    UNDECLARED_WRITES[overload] = writes
        return fn

    return deco


def register_kernel(name: str, plain_when: Callable | None = None):
    """Decorator for a local kernel `fn(func, local_args, local_kwargs, in_specs, out_specs, coord)`.

    `plain_when(func, in_specs, coord)` says where the kernel is just the plain op (so a
    module calling it can still run as a local region).
    """

    def deco(fn):
        KERNELS[name] = fn
        if plain_when is not None:
            KERNEL_PLAIN_WHEN[name] = plain_when
        return fn

    return deco


def _overloads(op) -> list:
    """An OpOverloadPacket stands for all its overloads; an OpOverload for itself."""
    if hasattr(op, "overloads") and callable(op.overloads):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _name(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def rule_for(func):
    return RULES.get(func)
