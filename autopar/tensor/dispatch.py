"""Op dispatch for DistTensor: decide once per (op, argument specs), then execute.

`decide` is the planning half (meta shapes, rule choice, target specs) and is cached;
`dispatch` is the hot half: look the decision up, reshard the inputs that need it, run the
local op, wrap (a decision whose inputs never move runs as unwrap + C++ op + wrap).
A rank outside the op's mesh computes nothing and returns empty pieces with the right meta
(random ops still draw, so its generator stays on the single-process stream).

Exact or refused: a write made on a moved copy of an input goes back into the piece that
the tensor and whatever shares its storage hold (where nothing does, the tensor takes the new
placement), a write that cannot reach the tensor is refused, an op whose output shape
depends on values runs on the gathered inputs on every rank, and an op that raises while it
runs on this rank's pieces is told to the other ranks (`comm.faults.raised`) so that none of
them waits for it.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from .. import comm

from . import rng
from ..comm import faults
from ..comm.backend import CommError, value_read
from ..comm.collectives import reading_values
from ..comm.fake import readable
from .dtensor import DistTensor, local_piece, new_dist, on_first_dist_tensor
from .observers import _REDUCERS, _WATCHERS, before_partial_read  # (read on every op)
from .op_call import fast_op, meta_like
from ..placement import Partial, Replicate, Shard, StridedShard
from ..redistribute import piece_of_replicated, redistribute_local
from ..spec import DistSpec, TensorMeta
from ..spmd import engine
from ..spmd.registry import DRAWS_RANDOM, KERNELS, LOCAL_ARGS, META_OUTPUTS, UNDECLARED_WRITES, WHOLE_FOR_AUTOGRAD
from ..spmd.strategy import OpCall

aten = torch.ops.aten

# Ops whose result is a Python value (a read of values): computed on the global tensors, on
# every rank; a captured program cannot replay one (`static.program` refuses them)
VALUE_READ_OPS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
}
# Views that set a lazy bit (torch's conj and neg views): inside __torch_dispatch__ torch
# turns off the dispatch keys that apply those bits, so a local piece must never carry one:
# these run as the op that applies it
_APPLY_LAZY = {aten._conj.default: torch.conj_physical, aten._neg_view.default: torch.neg}
_LAZY_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative)


def _honouring_lazy_bits(call):
    """`call` run with torch's conj/neg keys back on: a complex kernel that conjugates lazily
    inside (linalg_lstsq's QR, a composite's `.mH`) or a plain conjugate operand would
    otherwise be computed unconjugated."""

    def run(*args, **kwargs):
        with torch._C._SetExcludeDispatchKeyGuard(_LAZY_KEYS[0], False), \
                torch._C._SetExcludeDispatchKeyGuard(_LAZY_KEYS[1], False):
            return call(*args, **kwargs)

    return run


class Decision:
    """The cached plan for one (op, argument specs): where every input must be, what comes
    out, and the precomputed facts the hot path needs (this rank's coordinate, where the
    tensors sit in the argument list, whether the result is one plain output).

    `route`: "rule" (the rule's placements, the op on the local pieces), "value_read" (a
    Python value from the global tensors) or "gathered" (an output shape that depends on
    values: every rank runs the op on the gathered inputs).  `returns`: ("alias", (position,
    name)) of the argument an in-place or out= op returns, or ("value", the meta result)."""

    __slots__ = ("mesh", "in_specs", "out_specs", "kernel", "local_args", "mutated", "returns", "route",
                 "on_mesh", "coord", "tensor_positions", "one_output", "out_local_shapes", "inputs_in_place",
                 "plain_call", "from_other_meshes", "local_op", "inplace_view")

    def __init__(self, mesh, in_specs, out_specs, kernel, local_args, mutated, returns, route="rule"):
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.kernel = kernel
        self.local_args = local_args
        self.mutated = mutated  # flat indices of the inputs the op writes
        self.returns = returns
        self.route = route
        rank = _rank()
        self.on_mesh = mesh is not None and rank in mesh  # this rank computes (else: empty pieces)
        self.coord = mesh.coordinate(rank) if self.on_mesh else None
        # where the tensors sit in args, when all are positional and none in a list
        self.tensor_positions = None
        self.inputs_in_place = False  # every input is a DistTensor placed as the op needs it
        self.plain_call = None  # the local op, where the whole execution is: unwrap, call it, wrap
        self.local_op = None  # the local op (op_call.fast_op), where no kernel replaces it
        self.from_other_meshes: tuple = ()  # flat indices of inputs sent here (they need no gradient)
        self.inplace_view = None  # the op, for unsqueeze_, transpose_, ...: it changes its input's shape
        self.one_output = (  # the result is one tensor
            returns is not None and returns[0] == "value" and isinstance(returns[1], torch.Tensor)
        )
        self.out_local_shapes = (
            [s.local_shape(self.coord) for s in out_specs] if self.on_mesh and out_specs is not None else None
        )


_CACHE: dict = {}
# Decisions kept at most; beyond, the older half goes (insertion order: an evicted decision that
# is still in use is decided again and goes to the back). A job's working set is a few hundred;
# a key holds int arguments and shapes, so varying lengths would grow the cache without bound.
CACHE_CAPACITY = 4096
_STATE = {"rank": None}


def storage_key(t: torch.Tensor, start: bool = False):
    """Which storage `t` looks at (with `start`: and at which element it starts), right on
    every device: a meta tensor's `data_ptr()` is 0 plus its offset whatever its storage, so
    addresses would take every meta piece for one and the same."""
    key = t.untyped_storage()._cdata
    return (key, t.storage_offset()) if start else key


def _rank() -> int:
    r = _STATE["rank"]
    if r is None:
        r = _STATE["rank"] = comm.get_rank()
    return r


def _remember(key, value) -> None:
    if len(_CACHE) >= CACHE_CAPACITY:
        for old in list(itertools.islice(_CACHE, len(_CACHE) // 2)):
            del _CACHE[old]
    _CACHE[key] = value


def clear_cache() -> None:
    _CACHE.clear()
    _STATE["rank"] = None
    rng.forget()


# -- flattening ------------------------------------------------------------------------
def _scan(values, flat: list, key: list) -> None:
    for a in values:
        if isinstance(a, torch.Tensor):
            flat.append(a)
            key.append(a._spec if type(a) is DistTensor else (a.shape, a.dtype))
        elif isinstance(a, (list, tuple)):
            if a and all(type(x) is DistTensor for x in a):  # foreach lists: the common case, in C loops
                key.append(("[", len(a)))
                key.extend([x._spec for x in a])
                flat.extend(a)
            elif a and any(isinstance(x, torch.Tensor) for x in a):
                key.append(("[", len(a)))
                _scan(a, flat, key)
            else:  # sizes, dims, or an optimizer's per-tensor scalars (floats: changed every step)
                key.append(tuple(float if isinstance(x, float) else x for x in a))
        elif isinstance(a, float):
            key.append(float)  # rules never read float values; keep one cache entry for all
        else:
            key.append(a)


def _rebuild(values, it):
    out = []
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(next(it))
        elif isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            out.append(type(a)(_rebuild(a, it)) if isinstance(a, list) else tuple(_rebuild(a, it)))
        else:
            out.append(a)
    return out


def _flatten_out(out, acc: list):
    """Tensor leaves of an op result, in order."""
    if isinstance(out, torch.Tensor):
        acc.append(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _flatten_out(o, acc)
    return acc


def _rebuild_out(template, it):
    if isinstance(template, torch.Tensor):
        return next(it)
    if isinstance(template, (list, tuple)):
        items = [_rebuild_out(o, it) for o in template]
        return items if isinstance(template, list) else tuple(items)
    return template


# -- planning ----------------------------------------------------------------------------
def _mesh_of(func, flat) -> tuple:
    """The mesh the op runs on, and the inputs to send there from other meshes.  Inputs on
    several meshes (a pipeline's labels, masks or ids given to a later stage): those that need
    no gradient go to the mesh of those that do, or with no gradient anywhere to the mesh
    holding the most bytes.  A tensor that needs a gradient is never moved here (its gradient
    would come back on the wrong mesh): the differentiable `reshard` moves it."""
    on: dict = {}
    for i, t in enumerate(flat):
        if type(t) is DistTensor:
            on.setdefault(t._spec.mesh, []).append(i)
    if len(on) <= 1:
        return next(iter(on), None), ()
    meshes = list(on)
    graded = [m for m in meshes if any(flat[i].requires_grad for i in on[m])]
    if len(graded) == 1:
        target = graded[0]
    else:
        size = {m: sum(flat[i]._spec.meta.nbytes for i in on[m]) for m in meshes}
        ranked = sorted(meshes, key=size.get, reverse=True)
        if graded or size[ranked[0]] == size[ranked[1]]:
            why = "each holds tensors that need gradients" if graded else "neither needs a gradient nor holds more bytes"
            raise ValueError(
                f"{func}: operands live on different meshes {meshes[0]} and {meshes[1]} "
                f"(shapes {[tuple(x.shape) for x in flat]}) and {why}: move one with "
                f"dist.reshard(t, mesh, placements) (differentiable) first"
            )
        target = ranked[0]
    return target, tuple(i for m in meshes if m != target for i in on[m])


def _mutated_inputs(func, args, kwargs) -> tuple[list[int], Any]:
    """Flat indices of inputs the op writes, and the (position, name) of the argument it returns."""
    schema = func._schema
    mutated, written = [], {}
    undeclared = UNDECLARED_WRITES[func](args, kwargs) if func in UNDECLARED_WRITES else ()
    pos = 0
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        n = len(_flatten_out(value, [])) if value is not None else 0
        if arg.alias_info is not None and arg.alias_info.is_write:
            mutated.extend(range(pos, pos + n))
            written[frozenset(arg.alias_info.before_set)] = (i, arg.name)
        elif arg.name in undeclared:
            mutated.extend(range(pos, pos + n))
        pos += n
    alias = None
    for ret in schema.returns:
        if ret.alias_info is not None and ret.alias_info.is_write:
            alias = written.get(frozenset(ret.alias_info.before_set))
    return mutated, alias


def written_tensors(func, args, kwargs) -> list:
    """The tensors the op writes in place: its mutable arguments, and those its rule says it
    writes without declaring them (batch norm's running statistics)."""
    flat = _flatten_out([args, list(kwargs.values())], [])  # (the order `_mutated_inputs` counts in)
    return [flat[i] for i in _mutated_inputs(func, args, kwargs)[0]]


def _substitute(args, kwargs, new_flat):
    """args/kwargs with their tensor leaves replaced, in order, by `new_flat`."""
    it = iter(new_flat)
    new_args = _rebuild(args, it)
    new_kwargs = dict(zip(kwargs.keys(), _rebuild(list(kwargs.values()), it))) if kwargs else {}
    return new_args, new_kwargs


def _no_meta_kernel(err: Exception) -> bool:
    """The meta kernel that infers the output's global shape is missing (NotImplementedError,
    or an error about meta tensors): the op's output shape depends on values (nonzero,
    unique, masked_select) or nobody wrote one."""
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def _user_error(func, flat, err: Exception) -> Exception:
    """The meta kernel refused the operands: the user's error, as torch raises it on plain
    tensors (same type, torch's message) plus the op and the operands' global shapes and
    placements."""
    operands = "; ".join(
        f"{list(t.shape)} {list(t._spec.placements)} on {t._spec.mesh}" if type(t) is DistTensor
        else f"{list(t.shape)} plain" for t in flat
    )
    try:
        return type(err)(f"{err}\n(autopar: in {func} on operands {operands})")
    except TypeError:  # an exception type that takes other arguments
        return RuntimeError(f"{err}\n(autopar: in {func} on operands {operands})")


def decide(func, args, kwargs, flat) -> Decision:
    if func in DRAWS_RANDOM:  # the first draw of a program: every rank takes rank 0's stream
        rng.agree_once(kwargs.get("generator") or rng.default_generator(flat[0].device))
    mesh, moved = _mesh_of(func, flat)
    if func in VALUE_READ_OPS:
        if moved:
            raise ValueError(f"{func}: operands live on different meshes; reshard them onto one first")
        return Decision(mesh, None, None, None, None, [], None, route="value_read")
    mutated, alias = _mutated_inputs(func, args, kwargs)
    meta_out = None  # an op returning nothing (fused optimizer steps; some lack a meta kernel)
    if func._schema.returns:
        meta_args, meta_kwargs = _substitute(args, kwargs, [meta_like(t) for t in flat])
        if meta_kwargs.get("device") is not None:  # _to_copy(..., device=cpu), new_zeros(..., device=...)
            meta_kwargs["device"] = "meta"
        try:
            meta_out = META_OUTPUTS.get(func, func)(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError, ValueError, IndexError) as err:
            if not _no_meta_kernel(err):
                raise _user_error(func, flat, err) from err
            engine.warn_replicated(
                func, "its output's shape depends on values (it has no meta kernel): every rank gathers its "
                "inputs, runs it whole and holds its output Replicate"
            )
            return Decision(mesh, None, None, None, None, mutated, ("alias", alias) if alias else None, route="gathered")
    in_metas = [t._spec.meta if type(t) is DistTensor else TensorMeta.of(t) for t in flat]
    out_metas = [TensorMeta.of(o) for o in _flatten_out(meta_out, [])]
    rule_args, rule_kwargs = _substitute(args, kwargs, in_metas)
    call = OpCall(func, tuple(rule_args), rule_kwargs, in_metas, out_metas)
    current = [
        t._spec.placements if type(t) is DistTensor and t._spec.mesh.ndim == mesh.ndim else (Replicate(),) * mesh.ndim
        for t in flat
    ]
    if set(mutated) & set(moved):
        raise ValueError(f"{func} writes an input that lives on another mesh than the op's {mesh}: reshard it first")
    written_plain = tuple(i for i in mutated if type(flat[i]) is not DistTensor)
    in_pl, out_pl, kernel = engine.choose(call, mesh, current, inplace=0 in mutated, pinned=written_plain)
    in_specs = [DistSpec(mesh, p, m) for p, m in zip(in_pl, in_metas)]
    out_specs = [DistSpec(mesh, p, m) for p, m in zip(out_pl, out_metas)]
    dec = Decision(
        mesh, in_specs, out_specs, kernel, LOCAL_ARGS.get(func), mutated,
        ("alias", alias) if alias is not None else ("value", meta_out),
    )
    dec.from_other_meshes = moved
    dec.inplace_view = func if torch.Tag.inplace_view in func.tags else None
    if dec.on_mesh and kernel is None:
        dec.local_op = _APPLY_LAZY.get(func) or fast_op(func, args, kwargs)
        if any(m.dtype.is_complex for m in in_metas + out_metas):  # decided once: real ops pay nothing
            dec.local_op = _honouring_lazy_bits(dec.local_op)
    # the key holds each input's spec, so "no input moves" holds for every call with this key
    dec.inputs_in_place = all(type(t) is DistTensor and t._spec is s for t, s in zip(flat, in_specs))
    if not kwargs or not any(isinstance(v, (torch.Tensor, list, tuple)) for v in kwargs.values()):
        if not any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a) for a in args):
            dec.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    if (
        dec.inputs_in_place and dec.one_output and dec.on_mesh and not kwargs and not mutated and dec.kernel is None
        and dec.local_args is None and dec.tensor_positions is not None
        and all(type(args[i]) is DistTensor for i in dec.tensor_positions)
    ):
        dec.plain_call = dec.local_op  # the whole execution is: unwrap, run the C++ op, wrap
    return dec


# -- execution ---------------------------------------------------------------------------
def _plain_to(t: torch.Tensor, spec: DistSpec, rank: int) -> torch.Tensor:
    """A plain tensor is Replicate on the op's mesh: cut it to the target spec locally."""
    if t.requires_grad and t.is_leaf and not getattr(t, "_autopar_grad_hook", False):
        t._autopar_grad_hook = True
        t.register_hook(_densify_grad)
    if spec.is_replicated() or rank not in spec.mesh:
        return t
    return piece_of_replicated(t, spec, rank)


def _densify_grad(grad):
    """A plain leaf used with distributed tensors gets a plain, fully reduced gradient."""
    if type(grad) is DistTensor:
        from .convert import full_value  # (convert imports this module)

        return full_value(grad)
    return grad


_densify_grad.only_places = True  # (linear: a mean loss's gradients may be scaled after it, `deferred_mean`)


def dispatch(func, args, kwargs):
    # the key: the op and every argument's spec (tensors) or value (floats: their type)
    flat: list = []
    key: list = [id(func)]  # OpOverload hashes in Python; its id hashes in C (ops live forever)
    for a in args:
        ta = type(a)
        if ta is DistTensor:
            flat.append(a)
            key.append(a._spec)
        elif ta is float:
            key.append(float)
        elif ta is list or ta is tuple or isinstance(a, torch.Tensor):
            _scan((a,), flat, key)
        else:
            key.append(a)
    if kwargs:
        key.append(tuple(kwargs))
        _scan(kwargs.values(), flat, key)
    key_t = tuple(key)
    dec = _CACHE.get(key_t)
    if type(dec) is list:  # a list op placed unalike: these index groups, one call each
        return _run_groups(func, args, kwargs, dec)
    if dec is None:
        if _is_list_op(func):
            groups = _foreach_groups(args, kwargs)
            if len(groups) > 1:
                _remember(key_t, groups)
                return _run_groups(func, args, kwargs, groups)
        if _plain_inplace(func, args):
            for w in _WATCHERS:
                w.see(func, None, flat)
            return _run_on_dense(func, args, kwargs, flat)
        dec = decide(func, args, kwargs, flat)
        _remember(key_t, dec)
    if _WATCHERS:
        for w in _WATCHERS:
            w.see(func, dec, flat)
    try:  # free while nothing raises; what raises here may have raised on this rank only
        plain_call = dec.plain_call
        if plain_call is not None:  # every argument a DistTensor already in place or a plain value
            return new_dist(plain_call(*[a._local if type(a) is DistTensor else a for a in args]), dec.out_specs[0])
        if dec.route != "rule":
            if dec.route == "value_read":
                return _run_on_dense(func, args, kwargs, flat)
            return _run_gathered(func, args, kwargs, flat, dec)
        # execution (inlined: this is the per-op hot path)
        written = None
        if dec.inputs_in_place:
            locals_ = [t._local for t in flat]
        else:
            if dec.mutated and dec.inplace_view is None:  # an in-place shape op changes the tensor itself
                written = _moved_writes(dec, flat)
            locals_ = _inputs_in_place(dec, flat, written or ())
        if dec.mutated:
            _check_writes_reach_bases(func, dec, flat, locals_, written)
        if not dec.on_mesh:
            device = flat[0].device
            if func in DRAWS_RANDOM:  # keep this rank's generator on the single-process stream
                _draw_and_discard(func, args, kwargs, flat)
            return _wrap(dec, [torch.empty(0, dtype=s.meta.dtype, device=device) for s in dec.out_specs], args, kwargs)
        if dec.tensor_positions is not None:
            largs = list(args)
            for pos, loc in zip(dec.tensor_positions, locals_):
                largs[pos] = loc
            lkwargs = kwargs
        elif dec.inputs_in_place and not kwargs:  # every tensor is a DistTensor in place: swap in the locals
            largs = [_local_of(a) for a in args]
            lkwargs = kwargs
        else:
            largs, lkwargs = _substitute(args, kwargs, locals_)
        if dec.local_args is not None:
            largs, lkwargs = dec.local_args(largs, lkwargs, dec.out_local_shapes)
        if dec.kernel is not None:
            out = KERNELS[dec.kernel](func, largs, lkwargs, dec.in_specs, dec.out_specs, dec.coord)
        else:
            out = dec.local_op(*largs, **lkwargs)
        if written:
            _write_back(dec, locals_, written)
        if dec.one_output:
            return new_dist(out, dec.out_specs[0])
        local_outs = _flatten_out(out, [])
        if len(local_outs) != len(dec.out_specs):  # the local op left undefined what the meta kernel made
            local_outs = _at_meta_leaves(dec.returns[1], out)
        return _wrap(dec, local_outs, args, kwargs)
    except CommError:  # a collective failed: `faults` has told every rank already
        raise
    except Exception as err:  # any error at all, told to the op's other ranks and raised as it is
        faults.raised(str(func), err, tuple(dec.mesh.process_ids))
        raise


def _local_of(a):
    """A DistTensor argument's local piece; a list of them, their pieces; anything else as is."""
    t = type(a)
    if t is DistTensor:
        return a._local
    if (t is list or t is tuple) and a and type(a[0]) is DistTensor:
        return [x._local for x in a]
    return a


def _inputs_in_place(dec: Decision, flat, written=()) -> list:
    """Each input's local piece where the decision wants it (resharding what must move).
    An input the op writes takes the new placement, unless it is in `written` (a copy is
    moved and the write goes back into its own piece afterwards: `_moved_writes`)."""
    moved = dec.from_other_meshes
    if moved and torch.is_grad_enabled() and any(flat[i].requires_grad for i in moved):
        raise ValueError(
            f"an input on {flat[moved[0]]._spec.mesh} needs a gradient but the op runs on {dec.mesh}: "
            f"move it with dist.reshard(t, mesh, placements) (differentiable) first"
        )
    locals_ = []
    for i, (t, spec) in enumerate(zip(flat, dec.in_specs)):
        if type(t) is DistTensor:
            src = t._spec
            if src is not spec and _REDUCERS and t.grad_fn is None and _only_reduces(src, spec):
                before_partial_read(t)  # a pending gradient: reduced with its optimizer's others
                src = t._spec
            if src is spec:
                loc = t._local
            elif _only_reduces(src, spec):  # same value: later reads skip the reduction
                loc = _reduced_view(t, spec)
                if loc is None:
                    loc = redistribute_local(t._local, src, spec)
                if i not in written:
                    keep_reduced(t, loc, spec)
            else:
                loc = redistribute_local(t._local, src, spec)
        else:
            loc = _plain_to(t, spec, _rank())
        locals_.append(loc)
    for i in dec.mutated:
        t = flat[i]
        if type(t) is DistTensor and t._spec is not dec.in_specs[i] and i not in written:
            t._local, t._spec = locals_[i], dec.in_specs[i]
    return locals_


def _moved_writes(dec: Decision, flat) -> dict:
    """{flat index: (piece, spec)} of the inputs the op writes that must move for it while
    something else holds their piece's storage (a view, a `detach()` alias, a Parameter made
    from the tensor, a flat buffer): the op writes a moved copy and `_write_back` puts the
    result into that piece.  An input whose piece nothing else holds takes the new placement
    for good (nobody can tell, and an optimizer's state then follows its parameter), and so
    does a Partial input the op needs reduced, as a read does (`keep_reduced`)."""
    written = {}
    for i in dec.mutated:
        t = flat[i]
        if type(t) is DistTensor and t._spec is not dec.in_specs[i] and not _only_reduces(t._spec, dec.in_specs[i]):
            piece = t._local
            if torch._C._storage_Use_Count(piece.untyped_storage()._cdata) > 2:  # piece + this storage object
                written[i] = (piece, t._spec)
    return written


def _write_back(dec: Decision, locals_, written: dict) -> None:
    """The op wrote moved copies: each written tensor gets the result in its own pieces, in its
    own placement (what its views, its `detach()` aliases, a Parameter and an optimizer hold),
    as torch's in-place ops write into the tensor's storage."""
    for i, (piece, spec) in written.items():
        result = locals_[i]
        if result is not piece:
            piece.copy_(redistribute_local(result, dec.in_specs[i], spec))


def _check_writes_reach_bases(func, dec: Decision, flat, locals_, written) -> None:
    """An in-place op on a view of a distributed tensor must write into the base's piece: a
    view that needed communication (a slice across the sharded dim, a reshape merging it)
    holds a copy, and the write would be lost without a word.  The write lands in the piece
    the op runs on, and for a moved input also in the view's own piece (`_write_back`)."""
    if not dec.on_mesh:
        return
    for i in dec.mutated:
        t = flat[i]
        if type(t) is not DistTensor or not t._is_view():
            continue
        base = t._base
        if type(base) is not DistTensor:
            continue
        into = storage_key(base._local)
        if storage_key(locals_[i]) != into and not (written and i in written and storage_key(written[i][0]) == into):
            raise ValueError(
                f"{func} writes in place into a view of a distributed tensor of shape {list(base.shape)} placed "
                f"{list(base._spec.placements)} on {base._spec.mesh}, but that view (shape {list(t.shape)}, "
                f"{list(t._spec.placements)}) needed communication and holds a copy: the write would not reach the "
                f"tensor. Reshard the tensor to Replicate() on that mesh dim first, or compute out of place "
                f"(torch.where, index_put, cat)."
            )


def keep_reduced(t: DistTensor, reduced: torch.Tensor, spec: DistSpec) -> None:
    """`t` now holds its reduced piece; the address of the one it replaces is noted, so that
    views made from `t` before are reduced from it rather than once more."""
    old = t._local
    if old is not reduced:
        t._reduced_from = (storage_key(old), old.storage_offset(), old.is_contiguous(), t._spec)
    t._local, t._spec = reduced, spec


def _reduced_view(t: DistTensor, spec: DistSpec):
    """The reduced piece of `t`, a view of a Partial base tensor, taken from the base reduced
    once for all its views (backward uses a gradient and its transpose: one all-reduce, not
    two), or None when `t` is not such a view.  Only Partial -> Replicate reductions: the
    view's elements keep their places in the base's contiguous piece (in the base's dtype: a
    real view of a complex base, `.real`, counts its strides in other units)."""
    if not t._is_view() or any(type(b) is not Replicate for a, b in zip(t._spec.placements, spec.placements) if a != b):
        return None
    base = t._base
    if type(base) is not DistTensor or base._spec.mesh != spec.mesh or base.dtype != t.dtype:
        return None
    view = t._local
    ptr = storage_key(view)
    if storage_key(base._local) == ptr and base._local.is_contiguous():
        reduced = [Replicate() if a != b else p for a, b, p in zip(t._spec.placements, spec.placements, base._spec.placements)]
        if any(type(p) is not Partial for a, b, p in zip(t._spec.placements, spec.placements, base._spec.placements) if a != b):
            return None
        target = base._spec.with_placements(reduced)
        keep_reduced(base, redistribute_local(base._local, base._spec, target), target)
    before = getattr(base, "_reduced_from", None)
    if before is None or before[0] != ptr or not before[2] or not base._local.is_contiguous():
        return None
    if any(a != b and before[3].placements[m] != a for m, (a, b) in enumerate(zip(t._spec.placements, spec.placements))):
        return None  # the base was reduced over other mesh dims than this view needs
    offset = base._local.storage_offset() + view.storage_offset() - before[1]
    return base._local.as_strided(view.size(), view.stride(), offset)


def _draw_and_discard(func, args, kwargs, flat) -> None:
    """Run a random op on full-size stand-ins so the generator advances as on the mesh."""
    stand_ins = [
        torch.zeros(t._spec.meta.shape, dtype=t._spec.meta.dtype, device=t.device) if type(t) is DistTensor else t
        for t in flat
    ]
    sargs, skwargs = _substitute(args, kwargs, stand_ins)
    func(*sargs, **skwargs)


def _only_reduces(src: DistSpec, dst: DistSpec) -> bool:
    """dst differs from src only by reducing Partial mesh dims (to Replicate or Shard)."""
    return src.mesh == dst.mesh and all(
        a == b or (type(a) is Partial and type(b) is not Partial) for a, b in zip(src.placements, dst.placements)
    )


def _wrap(dec: Decision, local_outs: list, args, kwargs):
    how, what = dec.returns
    if how == "alias":  # in-place / out= ops return the argument they wrote
        pos, name = what
        written = args[pos] if pos < len(args) else kwargs[name]
        if dec.inplace_view is not None:
            _reshape_wrapper(dec.inplace_view, written, dec.out_specs[0], args, kwargs)
        return written
    if dec.mutated and not dec.out_specs:
        return what  # foreach in-place ops return None
    wrapped = [None if loc is None else new_dist(loc, spec) for loc, spec in zip(local_outs, dec.out_specs)]
    return _rebuild_out(what, iter(wrapped))


def _at_meta_leaves(meta, out, acc=None) -> list:
    """The local result's tensors at the meta result's tensor leaves, None where the local op
    returned none (native_batch_norm_backward's meta makes every gradient, masked or not)."""
    acc = [] if acc is None else acc
    if isinstance(meta, torch.Tensor):
        acc.append(out if isinstance(out, torch.Tensor) else None)
    elif isinstance(meta, (list, tuple)):
        for m, o in zip(meta, out):
            _at_meta_leaves(m, o, acc)
    return acc


def _reshape_wrapper(func, t: DistTensor, spec: DistSpec, args, kwargs) -> None:
    """After an in-place shape op (`unsqueeze_`, `transpose_`): the wrapper's own sizes and
    strides change as the op says (run on its metadata only), and so does its spec."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
    t._spec = spec


# -- ops handled outside the rule path -------------------------------------------------------
def _dense_inputs(flat) -> list:
    """Every input's global value, on every rank of the job (collective over the job)."""
    from .convert import gather_everywhere  # (convert imports this module)

    return [readable(gather_everywhere(t._local, t._spec)) if type(t) is DistTensor else readable(t) for t in flat]


def _run_on_dense(func, args, kwargs, flat):
    """Run on the global values (ops returning Python values, in-place ops on plain tensors).
    Below autograd (the wrapper-level graph already holds the op), so the gather need not be
    differentiable: `loss.item()` costs the gather and the read, no autograd Function."""
    dargs, dkwargs = _substitute(args, kwargs, _dense_inputs(flat))
    return _honouring_lazy_bits(func)(*dargs, **dkwargs)


def _run_gathered(func, args, kwargs, flat, dec: Decision):
    """An op whose output's shape depends on values (nonzero, unique, masked_select): every
    rank of the job gathers its inputs (a value read: `comm.value_read`), runs it whole and
    holds its outputs Replicate on the op's mesh; an input it writes gets the result in its
    own pieces."""
    reading_values(str(func))  # a captured step cannot replay a value-dependent shape
    if dec.mutated:
        _check_writes_reach_bases(func, dec, flat, [local_piece(t) for t in flat], None)
    with value_read(str(func)):
        dense = _dense_inputs(flat)
    dargs, dkwargs = _substitute(args, kwargs, dense)
    out = _honouring_lazy_bits(func)(*dargs, **dkwargs)
    rank = _rank()
    for i in dec.mutated:
        t = flat[i]
        if type(t) is DistTensor and dec.on_mesh and dense[i] is not t._local:
            t._local.copy_(piece_of_replicated(dense[i], t._spec, rank))
    if dec.returns is not None:
        pos, name = dec.returns[1]
        return args[pos] if pos < len(args) else kwargs[name]
    mesh = dec.mesh
    replicate = [Replicate()] * mesh.ndim

    def held(o: torch.Tensor):
        if o.layout is not torch.strided:  # a sparse result: the plain global value, on every rank
            return o
        local = o if dec.on_mesh else o.new_empty(0)
        return new_dist(local, DistSpec(mesh, replicate, TensorMeta.of(o)))

    return _rebuild_out(out, iter([held(o) for o in _flatten_out(out, [])]))


def _plain_inplace(func, args) -> bool:
    schema_args = func._schema.arguments
    return bool(
        args
        and schema_args
        and schema_args[0].alias_info is not None
        and schema_args[0].alias_info.is_write
        and isinstance(args[0], torch.Tensor)
        and type(args[0]) is not DistTensor
    )


def _is_list_op(func) -> bool:
    name = func._schema.name
    return name.startswith("aten::_foreach_") or name.startswith("aten::_fused_")


def _foreach_groups(args, kwargs) -> list[list[int]]:
    """Indices of the list arguments grouped by the mesh, placements and rank of the tensors at
    each index (not their shapes: one local foreach op serves every shape alike)."""
    lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple)) and a]
    n = len(lists[0]) if lists else 0
    groups: dict = {}
    for i in range(n):
        sig = tuple(
            (_placed(x[i]._spec) if type(x[i]) is DistTensor
             else ("plain", x[i].dim()) if isinstance(x[i], torch.Tensor) else None)
            for x in lists
            if len(x) == n
        )
        groups.setdefault(sig, []).append(i)
    return list(groups.values())


def _placed(spec: DistSpec) -> tuple:
    """What a foreach group shares (a mesh dim of size 1 holds everything whatever it says)."""
    shape = spec.mesh.shape
    return spec.mesh, tuple(p if k > 1 else Replicate() for p, k in zip(spec.placements, shape)), spec.ndim


def _sub(a, idx, n):
    if isinstance(a, (list, tuple)) and len(a) == n:
        return [a[i] for i in idx]
    return a


def _run_groups(func, args, kwargs, groups):
    n = sum(len(g) for g in groups)
    results = [None] * n
    any_out = False
    for idx in groups:
        out = dispatch(func, [_sub(a, idx, n) for a in args], {k: _sub(v, idx, n) for k, v in kwargs.items()})
        if isinstance(out, (list, tuple)) and len(out) == len(idx):
            any_out = True
            for i, o in zip(idx, out):
                results[i] = o
    return results if any_out else None


_SPLIT_BY_TENSOR = aten.tensor_split.tensor_indices_or_sections
_KERNELS_OVER_TORCH: list = []  # the torch.library registrations below, kept alive


def _split_by_tensor(self, indices, dim=0):
    """tensor_split by a 1-D tensor of indices reads that tensor's memory in C++, before any op
    reaches dispatch, and a DistTensor has none ("data is not allocated"): a distributed one is
    read as its value (collective, as `.tolist()`), then split by the list.  Any other call
    runs torch's own kernel."""
    if type(indices) is DistTensor and indices.dim() == 1 and indices.dtype == torch.int64:
        return aten.tensor_split.indices(self, indices.tolist(), dim)
    return _SPLIT_BY_TENSOR._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, self, indices, dim)


_PAD_CIRCULAR = aten._pad_circular.default


def _pad_circular(self, pad):
    """Circular padding of a distributed tensor, out of place: along each padded dim the input
    is cropped by its negative pads to rows [a, b), then output row o is row a + (o - before)
    mod (b - a), an index_select per dim (its gradient sums the wrapped rows back).  torch's
    composite writes the wrapped borders into slices of its output, which are copies wherever
    a slice needed communication (the write is refused there).  torch's own checks run first,
    on the meta device."""
    composite = functools.partial(_PAD_CIRCULAR._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)
    if type(self) is not DistTensor:
        return composite(self, pad)
    composite(torch.empty(self.shape, dtype=self.dtype, device="meta"), pad)
    out = self
    for i in range(len(pad) // 2):
        dim, before, after = self.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before or after:
            a, b = max(-before, 0), self.shape[dim] - max(-after, 0)
            if max(before, after) > b - a:
                raise ValueError(f"circular padding {list(pad)} of a distributed tensor of shape {list(self.shape)} "
                                 f"wraps dim {dim}, cropped to {b - a}, more than once (torch reads uninitialised "
                                 f"memory there): crop and pad in two steps")
            rows = torch.arange(-max(before, 0), b - a + max(after, 0), device=self.device) % (b - a) + a
            out = out.index_select(dim, rows)
    return out


def _cores_whole(t: DistTensor, core: int) -> DistTensor:
    """`t` (differentiably) with its last `core` dims whole and no Partial; batch shards kept."""
    from .convert import reshard_to  # (convert imports this module)

    first = t.dim() - core
    placements = [Replicate() if type(p) is Partial or (type(p) in (Shard, StridedShard) and p.dim >= first) else p
                  for p in t._spec.placements]
    return reshard_to(t, t._spec.with_placements(placements))


def _saving_whole_cores(op, cores):
    """`op`'s autograd kernel given its distributed inputs with their core dims whole (see
    spmd.registry.WHOLE_FOR_AUTOGRAD): its backward then writes only into local views."""

    def kernel(*args, **kwargs):
        whole = [_cores_whole(a, c) if type(a) is DistTensor else a for a, c in zip(args, cores)]
        return op._op_dk(torch._C.DispatchKey.Autograd, *whole, *args[len(cores):], **kwargs)

    return kernel


def _kernels_over_torch() -> None:
    """torch's kernels at the autograd keys (where composites run and autograd saves inputs)
    replaced, for the ops that need it, by ones that prepare distributed arguments first: a
    composite that reads a tensor argument's memory, one that writes into views of its output,
    the ops whose backward writes into views."""
    kernels = {_SPLIT_BY_TENSOR: _split_by_tensor, _PAD_CIRCULAR: _pad_circular}
    kernels.update({op: _saving_whole_cores(op, cores) for op, cores in WHOLE_FOR_AUTOGRAD.items()})
    lib = torch.library.Library("aten", "IMPL")
    for op, kernel in kernels.items():
        name = op._schema.name.split("::")[1] + ("" if op._overloadname == "default" else "." + op._overloadname)
        for key in ("AutogradCPU", "AutogradCUDA"):
            lib.impl(name, kernel, key)
    _KERNELS_OVER_TORCH.append(lib)


on_first_dist_tensor(_kernels_over_torch)
