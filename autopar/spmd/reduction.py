"""Reductions (sum, mean, max/min, arg-max/min, norms, logsumexp, any/all, var/std, prod) and scans,
and order statistics along a dim (sort, topk, kthvalue, median, mode).

A dim that is kept may be sharded freely: the output keeps the shard.  Reducing a sharded dim
leaves each rank one term of the result:
  sum, nansum, count_nonzero -> Partial(sum); amax/amin, max/min (values only) -> Partial(max/min);
  any/all -> Partial(max/min);
  mean -> Partial(avg): the plain op when the pieces are even, else a kernel that weighs the local
          sum by the global count (so uneven pieces average correctly);
  vector norms, logsumexp and values+indices (max.dim, argmax) are no reduction of per-rank terms:
          kernels all-reduce the small result over the mesh dims that shard the reduced dims and
          return Replicate there;
  var/std/prod (and var_mean/std_mean): only kept dims shard;
  aminmax -> (Partial(min), Partial(max)).
Order statistics rank their whole dim: every other dim shards.  trace sums the diagonal a piece
holds (Partial(sum)), dist is a vector norm of a - b (a kernel, Replicate).  histc over a given range sums
counts (Partial(sum)); renorm scales each slice along its dim by the slice's norm (only that dim
shards).
Linear reductions pass Partial inputs through (sum/mean: sum and avg); amax/max pass Partial(max),
amin/min pass Partial(min).  Scans (cumsum...) shard every dim but the scanned one.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import comm
from ..placement import Partial, ReduceType, Replicate, Shard, StridedShard
from ..redistribute.execute import _identity
from .registry import register, register_kernel
from .strategy import LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten

_NO_INDEX = torch.iinfo(torch.int64).max  # loses every MIN against a real index


# -- which dims an op reduces ---------------------------------------------------------------
def reduced_dims(dims, ndim: int, empty_is_all: bool = True) -> tuple[int, ...]:
    """Normalized reduced dims: None (and, for most ops, []) means every dim."""
    if isinstance(dims, int):
        dims = [dims]
    if dims is None or (empty_is_all and len(dims) == 0):
        return tuple(range(ndim))
    return tuple(sorted({d % ndim for d in dims})) if ndim else ()


def _reduced(call: OpCall, dim_at: int = 1, empty_is_all: bool = True) -> tuple[int, ...]:
    return reduced_dims(call.arg(dim_at, "dim"), len(call.inputs[0].shape), empty_is_all)


# -- strategies ---------------------------------------------------------------------------------
def _kept(call: OpCall, dims) -> list[OpStrategy]:
    """Shard a kept dim: every output keeps it (shifted left past the dropped dims unless keepdim)."""
    shape = call.inputs[0].shape
    keepdim = len(call.outputs[0].shape) == len(shape)
    n_out = len(call.outputs)
    return [
        OpStrategy((Shard(d if keepdim else d - sum(r < d for r in dims)),) * n_out, (Shard(d),))
        for d, size in enumerate(shape)
        if d not in dims and size != 1
    ]


def _on_reduced(call: OpCall, dims, output, kernel=None, even: bool = False) -> list[OpStrategy]:
    """Shard a reduced dim: every output gets `output` (a Partial, or Replicate from a kernel)."""
    shape = call.inputs[0].shape
    return [
        OpStrategy((output,) * len(call.outputs), (Shard(d),), kernel=kernel, even=((0, d),) if even else ())
        for d in dims
        if shape[d] != 1
    ]


def _through(call: OpCall, partials) -> list[OpStrategy]:
    return [OpStrategy((p,) * len(call.outputs), (p,)) for p in partials]


@register([aten.sum.default, aten.sum.dim_IntList])
def sum_rule(call: OpCall) -> list[OpStrategy]:
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, Partial("sum")) + _through(call, LINEAR_PARTIALS)


@register([aten.mean.default, aten.mean.dim])
def mean_rule(call: OpCall) -> list[OpStrategy]:
    """Even pieces: the local mean is a term of Partial(avg); uneven ones need the weighing kernel."""
    dims = _reduced(call)
    avg = Partial("avg")
    return (
        _kept(call, dims)
        + _on_reduced(call, dims, avg, even=True)
        + _on_reduced(call, dims, avg, kernel="mean_uneven")
        + _through(call, LINEAR_PARTIALS)
    )


_EXTREME = {"aten::amax": ReduceType.MAX, "aten::max": ReduceType.MAX,
            "aten::amin": ReduceType.MIN, "aten::min": ReduceType.MIN}


@register([aten.amax.default, aten.amin.default, aten.max.default, aten.min.default])
def extreme_rule(call: OpCall) -> list[OpStrategy]:
    p = Partial(_EXTREME[call.func._schema.name])
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, p, kernel="extreme") + _through(call, (p,))


@register([aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default])
def arg_extreme_rule(call: OpCall) -> list[OpStrategy]:
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, Replicate(), kernel="arg_extreme")


@register([aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype,
           aten.norm.ScalarOpt_dtype])
def vector_norm_rule(call: OpCall) -> list[OpStrategy]:
    """linalg_vector_norm and the norm overloads (p at 1, dim at 2, keepdim at 3 in both)."""
    dims = _reduced(call, dim_at=2)
    return _kept(call, dims) + _on_reduced(call, dims, Replicate(), kernel="vector_norm")


@register([aten.logsumexp.default])
def logsumexp_rule(call: OpCall) -> list[OpStrategy]:
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, Replicate(), kernel="logsumexp")


@register([aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims])
def any_all_rule(call: OpCall) -> list[OpStrategy]:
    """any = max and all = min over booleans; an empty piece gives the identity (False / True)."""
    dims = _reduced(call, empty_is_all=call.func._overloadname != "dims")  # any(x, dim=[]) keeps all
    p = Partial("max") if call.func._schema.name == "aten::any" else Partial("min")
    return _kept(call, dims) + _on_reduced(call, dims, p)


@register([aten.prod.default, aten.prod.dim_int, aten.var.correction, aten.std.correction,
           aten.var_mean.correction, aten.std_mean.correction])
def kept_only_rule(call: OpCall) -> list[OpStrategy]:
    """No Partial kind combines their per-rank terms (there is no Partial(prod); var/std need the
    global mean first): a reduced dim must be whole."""
    return _kept(call, _reduced(call))


# op -> (position of dim, its default): order statistics along one dim
_ORDER = {aten.sort.default: (1, -1), aten.sort.stable: (None, -1), aten.topk.default: (2, -1),
          aten.kthvalue.default: (2, -1), aten.median.dim: (1, None), aten.nanmedian.dim: (1, None),
          aten.mode.default: (1, -1)}


@register(list(_ORDER))
def order_rule(call: OpCall) -> list[OpStrategy]:
    """sort, topk, kthvalue, median, nanmedian, mode along `dim` rank the whole dim: every other
    dim shards (values and indices alike); the result of a median has no Partial kind."""
    at, default = _ORDER[call.func]
    dim = call.kwargs.get("dim", default) if at is None else call.arg(at, "dim", default)
    return _kept(call, reduced_dims(dim, len(call.inputs[0].shape)))


@register([aten.nansum.default])
def nansum_rule(call: OpCall) -> list[OpStrategy]:
    """A sum skipping NaNs: each piece's is a term of Partial(sum); NaNs never pass as terms."""
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, Partial("sum"))


@register([aten.count_nonzero.default, aten.count_nonzero.dim_IntList])
def count_nonzero_rule(call: OpCall) -> list[OpStrategy]:
    """Counts add up: a counted dim split leaves Partial(sum) terms (an empty piece counts 0)."""
    dims = _reduced(call)
    return _kept(call, dims) + _on_reduced(call, dims, Partial("sum"))


@register([aten.aminmax.default])
def aminmax_rule(call: OpCall) -> list[OpStrategy]:
    """(min, max): kept dims shard; a reduced one leaves (Partial(min), Partial(max)) terms, by a
    kernel where a piece may be empty (its terms: the identities)."""
    dims = reduced_dims(call.kwargs.get("dim"), len(call.inputs[0].shape))
    split = [OpStrategy((Partial("min"), Partial("max")), (Shard(d),), kernel="aminmax") for d in dims
             if call.inputs[0].shape[d] != 1]
    return _kept(call, dims) + split


@register([aten.trace.default])
def trace_rule(call: OpCall) -> list[OpStrategy]:
    """The sum of the diagonal: a piece sums the diagonal elements it holds (a kernel moves the
    diagonal by the piece's offsets), a term of Partial(sum); linear, so Partial passes."""
    shape = call.inputs[0].shape
    split = [OpStrategy((Partial("sum"),), (Shard(d),), kernel="trace_piece") for d in range(2) if shape[d] != 1]
    return split + _through(call, LINEAR_PARTIALS)


@register_kernel("trace_piece")
def trace_piece_kernel(func, args, kwargs, in_specs, out_specs, coord):
    (r0, _), (c0, _) = in_specs[0].local_box(coord)
    return torch.diagonal(args[0], r0 - c0).sum()


@register([aten.dist.default])
def dist_rule(call: OpCall) -> list[OpStrategy]:
    """||a - b||_p over every element: a and b of one shape split alike, the kernel all-reduces
    the shares of the norm (as vector_norm's)."""
    a, b = call.inputs[0].shape, call.inputs[1].shape
    if a != b:
        return []
    return [OpStrategy((Replicate(),), (Shard(d), Shard(d)), kernel="dist") for d, n in enumerate(a) if n != 1]


@register_kernel("dist")
def dist_kernel(func, args, kwargs, in_specs, out_specs, coord):
    spec, ord = in_specs[0], _get(args, kwargs, 2, "p", 2)
    dims = tuple(range(spec.ndim))
    terms = _norm_terms((args[0] - args[1]).abs().to(out_specs[0].meta.dtype), ord, dims)
    total = comm.all_reduce(terms, shard_group(spec, dims, coord), _norm_combine(ord))
    return _norm_root(total, ord).reshape(())


@register([aten.histc.default])
def histc_rule(call: OpCall) -> list[OpStrategy]:
    """Counts over a given range add up: any split leaves Partial(sum) terms.  Without a range
    (min == max) each piece would take its own: then whole."""
    if call.arg(2, "min", 0) == call.arg(3, "max", 0):
        return []
    return [OpStrategy((Partial("sum"),), (Shard(d),)) for d, n in enumerate(call.inputs[0].shape) if n != 1]


@register([aten.renorm.default])
def renorm_rule(call: OpCall) -> list[OpStrategy]:
    """Each slice along `dim` is scaled by its own norm over the other dims: only `dim` shards."""
    shape = call.inputs[0].shape
    dim = call.arg(2, "dim") % len(shape)
    return [OpStrategy((Shard(dim),), (Shard(dim),))] if shape[dim] != 1 else []


@register([aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
           aten.cummin.default])
def scan_rule(call: OpCall) -> list[OpStrategy]:
    """A scan needs its whole dim; cumsum is linear and passes Partial(sum/avg) through."""
    strategies = _kept(call, _reduced(call))
    if call.func is aten.cumsum.default:
        strategies += _through(call, LINEAR_PARTIALS)
    return strategies


@register([aten._foreach_norm.Scalar])
def foreach_norm_rule(call: OpCall) -> list[OpStrategy]:
    """One group of same-spec tensors (dispatch splits the list): sharded norms all-reduce together."""
    n_in, n_out = len(call.inputs), len(call.outputs)
    nd = min(len(m.shape) for m in call.inputs)
    return [
        OpStrategy((Replicate(),) * n_out, (Shard(d),) * n_in, kernel="foreach_norm")
        for d in range(nd)
        if all(m.shape[d] != 1 for m in call.inputs)
    ]


# -- kernels ------------------------------------------------------------------------------------
def _get(args, kwargs, index: int, name: str, default=None):
    return args[index] if index < len(args) else kwargs.get(name, default)


def shard_group(spec, dims, coord) -> tuple[int, ...]:
    """The ranks that hold the other pieces of the reduced dims: one group across every mesh dim
    sharding one of `dims`, plainly or strided (my coordinate on the other mesh dims), in mesh order."""
    index = tuple(
        slice(None) if type(p) in (Shard, StridedShard) and p.dim in dims else c
        for p, c in zip(spec.placements, coord)
    )
    return tuple(int(r) for r in np.asarray(spec.mesh.mesh[index]).reshape(-1))


def _squeeze(t: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return t if keepdim or not dims else t.squeeze(tuple(dims))


def _extreme_or(t: torch.Tensor, dims, rt: ReduceType, fill) -> torch.Tensor:
    """amax/amin over `dims` (kept), or `fill` where a piece is empty along them."""
    if any(t.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(t.shape)]
        return t.new_full(shape, fill)
    fn = torch.amax if rt is ReduceType.MAX else torch.amin
    return fn(t, dims, keepdim=True)


@register_kernel("mean_uneven")
def mean_uneven_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Term = local sum * k / global count (k: ranks holding pieces of the reduced dims), so the
    average of the terms over any mix of sharding mesh dims is sum / count."""
    spec = in_specs[0]
    dims = reduced_dims(_get(args, kwargs, 1, "dim"), spec.ndim)
    keepdim = _get(args, kwargs, 2, "keepdim", False)
    count = math.prod(spec.shape[d] for d in dims)
    k = len(shard_group(spec, dims, coord))
    total = torch.sum(args[0], list(dims), keepdim=keepdim, dtype=out_specs[0].meta.dtype)
    return total.div_(count / k)


@register_kernel("extreme")
def extreme_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """amax/amin/max/min whose local piece may be empty along a reduced dim (more ranks than rows):
    an empty piece's term is the reduction's identity."""
    x = args[0]
    dims = reduced_dims(_get(args, kwargs, 1, "dim"), x.dim())
    if all(x.shape[d] for d in dims):
        return func(*args, **kwargs)
    return x.new_full(out_specs[0].local_shape(coord), _identity(x.dtype, _EXTREME[func._schema.name]))


@register_kernel("arg_extreme")
def arg_extreme_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """max.dim/min.dim/argmax/argmin over sharded dims: each rank finds its local extreme and its
    global index; an all-reduce of the values picks the extreme, a MIN all-reduce of the indices
    holding it picks the first one, as torch does.  NaNs are not ranked across pieces."""
    x, spec = args[0], in_specs[0]
    name = func._schema.name
    rt = ReduceType.MAX if name in ("aten::max", "aten::argmax") else ReduceType.MIN
    dim = _get(args, kwargs, 1, "dim")
    dims = reduced_dims(dim, x.dim())
    box = spec.local_box(coord)
    if dim is None:
        values, index = _flat_extreme(x, spec.shape, box, rt)
    else:
        values, index = _local_extreme(x, dims[0], rt, box[dims[0]][0])
    group = shard_group(spec, dims, coord)
    best = comm.all_reduce(values, group, rt)
    index = comm.all_reduce(torch.where(values == best, index, _NO_INDEX), group, ReduceType.MIN)
    shape = out_specs[0].local_shape(coord)
    if name in ("aten::argmax", "aten::argmin"):
        return index.reshape(shape)
    return best.reshape(shape), index.reshape(shape)


def _local_extreme(x: torch.Tensor, d: int, rt: ReduceType, offset: int):
    """(values, global indices) of the extreme along d, kept; an empty piece gives the identity."""
    if x.shape[d] == 0:
        shape = [1 if i == d else s for i, s in enumerate(x.shape)]
        return (x.new_full(shape, _identity(x.dtype, rt)),
                torch.full(shape, _NO_INDEX, dtype=torch.int64, device=x.device))
    values, index = (torch.max if rt is ReduceType.MAX else torch.min)(x, d, keepdim=True)
    return values, index + offset


def _flat_extreme(x: torch.Tensor, shape, box, rt: ReduceType):
    """(value, index into the global tensor's flat order) of this piece's extreme, as 0-d tensors."""
    if x.numel() == 0:
        return (x.new_full((), _identity(x.dtype, rt)),
                torch.tensor(_NO_INDEX, dtype=torch.int64, device=x.device))
    flat = x.reshape(-1)
    local = flat.argmax() if rt is ReduceType.MAX else flat.argmin()
    coords = torch.unravel_index(local, x.shape)
    index = sum((c + a) * math.prod(shape[d + 1:]) for d, (c, (a, _)) in enumerate(zip(coords, box)))
    return flat[local], index


def _norm_combine(ord) -> ReduceType:
    """How the shares of an `ord`-norm combine across pieces."""
    return {math.inf: ReduceType.MAX, -math.inf: ReduceType.MIN}.get(ord, ReduceType.SUM)


def _modulus(x: torch.Tensor, dtype, out_dtype) -> torch.Tensor:
    """|x| as a norm's kernel takes it: in the `dtype` asked for, as torch does (the modulus of a
    complex64 value rounds otherwise than its complex128 one, and renorm's gradient compares |x|
    with the norm bit for bit)."""
    if dtype is not None and dtype.is_complex == x.is_complex():
        x = x.to(dtype)
    return x.abs().to(out_dtype)


def _norm_terms(a: torch.Tensor, ord, dims) -> torch.Tensor:
    """This piece's share of the `ord`-norm of |x| = `a` over `dims` (kept)."""
    if ord == math.inf:
        return _extreme_or(a, dims, ReduceType.MAX, 0)
    if ord == -math.inf:
        return _extreme_or(a, dims, ReduceType.MIN, math.inf)
    if ord == 0:
        return (a != 0).sum(dims, keepdim=True, dtype=a.dtype)
    return a.pow(ord).sum(dims, keepdim=True)


def _norm_root(t: torch.Tensor, ord) -> torch.Tensor:
    return t if ord in (0, math.inf, -math.inf) else t.pow(1.0 / ord)


@register_kernel("aminmax")
def aminmax_kernel(func, args, kwargs, in_specs, out_specs, coord):
    x = args[0]
    dims = reduced_dims(kwargs.get("dim"), x.dim())
    if all(x.shape[d] for d in dims):
        return func(*args, **kwargs)
    return tuple(x.new_full(s.local_shape(coord), _identity(x.dtype, rt))
                 for s, rt in zip(out_specs, (ReduceType.MIN, ReduceType.MAX)))


@register_kernel("vector_norm")
def vector_norm_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """The root is not linear: all-reduce the shares of sum |x|^p (or max/min |x|), then take it.
    norm's p may be None (2)."""
    x, spec = args[0], in_specs[0]
    ord = _get(args, kwargs, 1, "ord", 2)
    ord = 2 if ord is None else ord
    dims = reduced_dims(_get(args, kwargs, 2, "dim"), x.dim())
    keepdim = _get(args, kwargs, 3, "keepdim", False)
    terms = _norm_terms(_modulus(x, kwargs.get("dtype"), out_specs[0].meta.dtype), ord, dims)
    total = comm.all_reduce(terms, shard_group(spec, dims, coord), _norm_combine(ord))
    return _squeeze(_norm_root(total, ord), dims, keepdim)


@register_kernel("foreach_norm")
def foreach_norm_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Every tensor's share in one vector, one all-reduce for the whole group."""
    xs = args[0]
    ord = _get(args, kwargs, 1, "ord", 2)
    wide = _get(args, kwargs, 2, "dtype")
    terms = [_norm_terms(_modulus(x, wide, out.meta.dtype), ord, tuple(range(x.dim()))).reshape(())
             for x, out in zip(xs, out_specs)]
    spec = in_specs[0]
    group = shard_group(spec, range(spec.ndim), coord)
    total = comm.all_reduce(torch.stack(terms), group, _norm_combine(ord))
    return list(_norm_root(total, ord).unbind())


@register_kernel("logsumexp")
def logsumexp_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """log sum exp(x - m) + m with m the all-reduced max (two small all-reduces); of the real
    part for complex x, as torch takes it (complex values have no max)."""
    spec = in_specs[0]
    x = args[0].to(out_specs[0].meta.dtype)
    dims = reduced_dims(_get(args, kwargs, 1, "dim"), x.dim())
    keepdim = _get(args, kwargs, 2, "keepdim", False)
    group = shard_group(spec, dims, coord)
    real = x.real if x.is_complex() else x
    m = comm.all_reduce(_extreme_or(real, dims, ReduceType.MAX, -math.inf), group, ReduceType.MAX)
    m = m.masked_fill(m.isinf(), 0)  # all -inf (or an inf) rows: as torch, shift by 0
    s = comm.all_reduce((x - m).exp().sum(dims, keepdim=True), group, ReduceType.SUM)
    return _squeeze(s.log().add_(m), dims, keepdim)
