"""Tensor manipulation: cat/stack, split/unbind/slice/select (and their backwards), index_select,
gather/scatter, advanced indexing, tril/triu, roll/flip, repeat.

These ops move, cut or pick elements without combining them, so a dim they leave alone keeps
its shards and every Partial kind passes through (zero fill included: max/min of zeros is 0).
A dim they cut, pick from or move along must be whole on every rank; the exceptions are an
index tensor sharded along its own dims (each rank picks its share of the output) and the
accumulating ops (index_add, scatter_add, index_put with accumulate) where each rank adds its
share into a Partial(sum) self (Replicate -> Partial is free: the terms are the value and zeros).
"""
from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate, Shard, StridedShard
from .pointwise import shard_strategies
from .registry import register, register_kernel
from .strategy import ALL_PARTIALS, EXTREME_PARTIALS, LINEAR_PARTIALS, OpCall, OpStrategy

aten = torch.ops.aten


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def with_arg(args, kwargs, index: int, name: str, value):
    """args/kwargs with the positional-or-keyword argument (index, name) set to `value`."""
    if index < len(args):
        args = list(args)
        args[index] = value
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def _moved(dim_map: dict, n_in: int, n_out: int, kinds=ALL_PARTIALS, extra: tuple = ()) -> list[OpStrategy]:
    """The first `n_in` inputs sharded on d give every output sharded on dim_map[d]; Partial kinds
    pass.  `extra` are the placements of the remaining (index) inputs."""
    strategies = [OpStrategy((Shard(o),) * n_out, (Shard(i),) * n_in + extra) for i, o in dim_map.items()]
    return strategies + [OpStrategy((p,) * n_out, (p,) * n_in + extra) for p in kinds]


def _uncut(src: tuple, dst: tuple) -> dict:
    """Same-rank ops: the dims whose size the op keeps (a slice taking the whole dim keeps it)."""
    return {d: d for d in range(len(src)) if src[d] == dst[d]}


# -- joining and cutting ---------------------------------------------------------------------------
@register([aten.cat.default])
def cat_rule(call: OpCall) -> list[OpStrategy]:
    """Shard any dim but the cat dim (a cut cat dim would interleave the pieces).  Legacy empty
    1-D inputs, which cat skips, stay Replicate."""
    out = call.outputs[0].shape
    dim = _dim(call.arg(1, "dim", 0), len(out))
    full = [len(m.shape) == len(out) for m in call.inputs]
    strategies = [
        OpStrategy((Shard(d),), tuple(Shard(d) if f else Replicate() for f in full))
        for d in range(len(out))
        if d != dim
    ]
    if all(full) and len(call.inputs) > 1 and len({m.shape[dim] for m in call.inputs}) == 1:
        # equal pieces split alike on the cat dim: rank i's parts, side by side, are its share of
        # every block (a fused q/k/v's gradient, back from the split into q, k, v)
        strategies.append(OpStrategy((StridedShard(dim, len(call.inputs)),), (Shard(dim),) * len(call.inputs)))
    return strategies + [OpStrategy((p,), (p,) * len(call.inputs)) for p in ALL_PARTIALS]


@register([aten.stack.default])
def stack_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.outputs[0].shape)
    dim = _dim(call.arg(1, "dim", 0), nd)
    return _moved({d: d + (d >= dim) for d in range(nd - 1)}, len(call.inputs), 1)


def split_sizes_local(args, kwargs, out_shapes):
    """A split of a dim this rank holds a share of takes the local piece sizes."""
    dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), len(out_shapes[0]))
    sizes = [s[dim] for s in out_shapes]
    return with_arg(args, kwargs, 1, "split_size" if isinstance(args[1], int) else "split_sizes",
                    sizes[0] if isinstance(args[1], int) else sizes)


@register([aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default],
          local_args=split_sizes_local)
def split_rule(call: OpCall) -> list[OpStrategy]:
    """Pieces along one dim: the other dims keep their shards.  A dim read as blocks split
    alike (StridedShard: a fused q/k/v or gate/up projection split column-wise) is cut
    locally where the pieces are whole blocks: each piece keeps its blocks' shares."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(2, "dim", 0), nd)
    strategies = _moved({d: d for d in range(nd) if d != dim}, 1, len(call.outputs))
    sizes = [m.shape[dim] for m in call.outputs]
    block = math.gcd(*sizes)
    if len(sizes) > 1 and block:
        pieces = tuple(Shard(dim) if n == block else StridedShard(dim, n // block) for n in sizes)
        strategies.append(OpStrategy(pieces, (StridedShard(dim, sum(sizes) // block),)))
    return strategies


@register([aten.slice.Tensor])
def slice_rule(call: OpCall) -> list[OpStrategy]:
    """The other dims, and the sliced one when the slice takes it whole, keep their shards; the
    local start/end are then still right (a whole dim, or an end clamped to the piece)."""
    return _moved(_uncut(call.inputs[0].shape, call.outputs[0].shape), 1, 1)


@register([aten.narrow_copy.default])
def narrow_copy_rule(call: OpCall) -> list[OpStrategy]:
    """As slice, but its length would not clamp to a piece: the narrowed dim stays whole."""
    dim = _dim(call.arg(1, "dim"), len(call.inputs[0].shape))
    return _moved({d: d for d in _uncut(call.inputs[0].shape, call.outputs[0].shape) if d != dim}, 1, 1)


@register([aten.unbind.int, aten.select.int, aten.unbind_copy.int])
def pick_rule(call: OpCall) -> list[OpStrategy]:
    """Drop one dim (kept whole); the dims after it shift down."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim", 0), nd)
    return _moved({d: d - (d > dim) for d in range(nd) if d != dim}, 1, len(call.outputs))


def _input_sizes_local(args, kwargs, out_shapes):
    """The backward ops take the global input size; the local op needs this rank's."""
    return with_arg(args, kwargs, 1, "input_sizes", list(out_shapes[0]))


@register([aten.slice_backward.default], local_args=_input_sizes_local)
def slice_backward_rule(call: OpCall) -> list[OpStrategy]:
    return _moved(_uncut(call.inputs[0].shape, call.outputs[0].shape), 1, 1)


@register([aten.select_backward.default], local_args=_input_sizes_local)
def select_backward_rule(call: OpCall) -> list[OpStrategy]:
    nd = len(call.outputs[0].shape)
    dim = _dim(call.arg(2, "dim"), nd)
    return _moved({d: d + (d >= dim) for d in range(nd - 1)}, 1, 1)


# -- picking along a dim by an index tensor ----------------------------------------------------------
def _same_size_dims(call: OpCall, dim: int, operands: tuple) -> list[int]:
    """Dims other than `dim` where the given inputs all have the output's size (an empty index
    may have another rank than self: no dim lines up then)."""
    out = call.outputs[0].shape
    if any(len(call.inputs[i].shape) != len(out) for i in operands):
        return []
    return [d for d in range(len(out)) if d != dim and all(call.inputs[i].shape[d] == out[d] for i in operands)]


@register([aten.index_select.default])
def index_select_rule(call: OpCall) -> list[OpStrategy]:
    """Self sharded off `dim` (index Replicate), or a 1-D index sharded: output sharded on `dim`."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim"), nd)
    strategies = _moved({d: d for d in range(nd) if d != dim}, 1, 1, extra=(Replicate(),))
    if nd and len(call.inputs[1].shape) == 1:
        strategies.append(OpStrategy((Shard(dim),), (Replicate(), Shard(0))))
    return strategies


@register([aten.index_add.default, aten.index_add_.default])
def index_add_rule(call: OpCall) -> list[OpStrategy]:
    """self.index_add(dim, index, source): off-`dim` shards on self and source; a sharded index
    (source sharded like it) adds each rank's share into Partial(sum); linear in (self, source)."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim"), nd)
    strategies = [
        OpStrategy((Shard(d),), (Shard(d), Replicate(), Shard(d))) for d in _same_size_dims(call, dim, (0, 2))
    ]
    if nd and len(call.inputs[1].shape) == 1:
        strategies.append(OpStrategy((Partial(),), (Partial(), Shard(0), Shard(dim))))
    return strategies + [OpStrategy((p,), (p, Replicate(), p)) for p in LINEAR_PARTIALS]


@register([aten.index_copy.default, aten.index_copy_.default, aten.index_fill.int_Tensor, aten.index_fill_.int_Tensor,
           aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar, aten.index_reduce.default,
           aten.index_reduce_.default])
def index_write_rule(call: OpCall) -> list[OpStrategy]:
    """self.index_copy/fill/reduce(dim, index, source or value): rows along `dim` are written, so
    the other dims shard on self and source alike (index and a 0-d fill value whole)."""
    shape = call.inputs[0].shape
    dim = _dim(call.arg(1, "dim"), len(shape))
    rest = call.inputs[2:]
    return [
        OpStrategy((Shard(d),), (Shard(d), Replicate()) + tuple(
            Shard(d) if len(m.shape) == len(shape) and m.shape[d] == n else Replicate() for m in rest))
        for d, n in enumerate(shape)
        if d != dim and n != 1
    ]


@register([aten.take.default])
def take_rule(call: OpCall) -> list[OpStrategy]:
    """self.take(index) picks by flat position: self whole, the index (and the output) split."""
    return [OpStrategy((Shard(d),), (Replicate(), Shard(d))) for d, n in enumerate(call.inputs[1].shape) if n != 1]


@register([aten.put.default, aten.put_.default])
def put_rule(call: OpCall) -> list[OpStrategy]:
    """self.put(index, source, accumulate) writes at flat positions: self whole.  Accumulating
    (take's backward), index and source split alike add each rank's share into Partial(sum)."""
    strategies = [OpStrategy((p,), (p, Replicate(), p)) for p in LINEAR_PARTIALS]
    if call.arg(3, "accumulate", False) and call.inputs[1].shape == call.inputs[2].shape:
        strategies += [OpStrategy((Partial(),), (Partial(), Shard(d), Shard(d)))
                       for d, n in enumerate(call.inputs[1].shape) if n != 1]
    return strategies


@register([aten.bucketize.Tensor, aten.searchsorted.Tensor])
def bucketize_rule(call: OpCall) -> list[OpStrategy]:
    """Each element looked up in the boundaries (whole): its dims shard.  searchsorted with one
    sorted row per leading index splits those leading dims of both alike."""
    bucketize = call.func is aten.bucketize.Tensor
    values = call.inputs[0 if bucketize else 1].shape
    seq = call.inputs[1 if bucketize else 0].shape
    per_row = not bucketize and len(seq) > 1
    strategies = []
    for d, n in enumerate(values):
        if n == 1 or (per_row and d == len(values) - 1):
            continue
        ins = [Shard(d) if per_row else Replicate()] * len(call.inputs)
        ins[0 if bucketize else 1] = Shard(d)
        strategies.append(OpStrategy((Shard(d),), tuple(ins)))
    return strategies


@register([aten.gather.default])
def gather_rule(call: OpCall) -> list[OpStrategy]:
    """Shard a dim other than `dim` where self and index agree, or the index along `dim` itself
    (self Replicate): each rank gathers its rows of the output."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim"), nd)
    strategies = [OpStrategy((Shard(d),), (Shard(d), Shard(d))) for d in _same_size_dims(call, dim, (0, 1))]
    if nd:
        strategies.append(OpStrategy((Shard(dim),), (Replicate(), Shard(dim))))
    return strategies + [OpStrategy((p,), (p, Replicate())) for p in ALL_PARTIALS]


@register([aten.scatter.src, aten.scatter_.src, aten.scatter.value, aten.scatter_.value,
           aten.scatter.reduce, aten.scatter_.reduce, aten.scatter.value_reduce, aten.scatter_.value_reduce,
           aten.scatter_reduce.two, aten.scatter_reduce_.two])
def scatter_rule(call: OpCall) -> list[OpStrategy]:
    """Shard a dim other than `dim` where all operands agree.  scatter.src is linear in
    (self, src); scatter.value writes the same value on every rank, right only for max/min."""
    n = len(call.inputs)
    dim = _dim(call.arg(1, "dim"), len(call.inputs[0].shape))
    strategies = [OpStrategy((Shard(d),), (Shard(d),) * n) for d in _same_size_dims(call, dim, range(n))]
    kinds = {"src": ALL_PARTIALS, "value": EXTREME_PARTIALS}.get(call.func._overloadname, ())
    return strategies + [OpStrategy((p,), (p, Replicate()) + (p,) * (n - 2)) for p in kinds]


@register([aten.scatter_add.default, aten.scatter_add_.default])
def scatter_add_rule(call: OpCall) -> list[OpStrategy]:
    """As scatter, plus index and src sharded along `dim` (same size) adding into Partial(sum)."""
    nd = len(call.inputs[0].shape)
    dim = _dim(call.arg(1, "dim"), nd)
    index, src = call.inputs[1].shape, call.inputs[2].shape
    strategies = [OpStrategy((Shard(d),), (Shard(d),) * 3) for d in _same_size_dims(call, dim, (0, 1, 2))]
    if nd and index[dim] == src[dim]:
        strategies.append(OpStrategy((Partial(),), (Partial(), Shard(dim), Shard(dim))))
    return strategies + [OpStrategy((p,), (p, Replicate(), p)) for p in LINEAR_PARTIALS]


# -- advanced indexing ----------------------------------------------------------------------------
class _Indexing:
    """Layout of self[indices] (indices: index metas or None, as aten.index takes them).

    The indexed dims are replaced by the broadcast index dims: in place when the indexed dims
    are adjacent, else at the front.  `kept` maps each non-indexed self dim to its result dim;
    `start` is the result dim of the first broadcast index dim.
    """

    def __init__(self, self_shape: tuple, indices: list):
        self.tensors = [m for m in indices if m is not None]
        pos = [p for p, m in enumerate(indices) if m is not None]
        self.b_ndim = max(len(m.shape) for m in self.tensors)
        rest = [d for d in range(len(self_shape)) if d not in pos]
        adjacent = pos == list(range(pos[0], pos[-1] + 1))
        self.start = pos[0] if adjacent else 0
        self.kept = {d: (d if d < self.start else d - len(pos) + self.b_ndim) if adjacent else self.b_ndim + i
                     for i, d in enumerate(rest)}
        shape = [0] * (len(rest) + self.b_ndim)
        for d, r in self.kept.items():
            shape[r] = self_shape[d]
        for b in range(self.b_ndim):
            shape[self.start + b] = max(self._aligned(m, b)[1] for m in self.tensors)
        self.result_shape = tuple(shape)

    def _aligned(self, m, b: int) -> tuple[int, int]:
        """(dim of index tensor m aligned with broadcast dim b or -1, its size or 1)."""
        bb = b - (self.b_ndim - len(m.shape))
        return (bb, m.shape[bb]) if bb >= 0 else (-1, 1)

    def index_shards(self, b: int) -> tuple:
        """Index tensors sharded on broadcast dim b (broadcast size-1 dims stay Replicate)."""
        size = self.result_shape[self.start + b]
        aligned = [self._aligned(m, b) for m in self.tensors]
        return tuple(Shard(bb) if size != 1 and n == size else Replicate() for bb, n in aligned)

    def values_placement(self, values_shape: tuple, r: int):
        """index_put's values broadcast against self[indices]: Shard on their dim aligned with r."""
        v = r - (len(self.result_shape) - len(values_shape))
        if v >= 0 and values_shape[v] == self.result_shape[r] != 1:
            return Shard(v)
        return Replicate()


def _indexing(call: OpCall) -> _Indexing | None:
    """None for boolean masks (they stand for several dims) and for no index at all."""
    indices = list(call.arg(1, "indices"))
    tensors = [m for m in indices if m is not None]
    if not tensors or any(m.dtype in (torch.bool, torch.uint8) for m in tensors):
        return None
    return _Indexing(call.inputs[0].shape, indices)


@register([aten.index.Tensor, aten._unsafe_index.Tensor])
def index_rule(call: OpCall) -> list[OpStrategy]:
    """self[indices]: non-indexed dims keep their shards (indices Replicate); or self Replicate
    and the index tensors sharded on a broadcast dim, each rank picking its share."""
    lay = _indexing(call)
    if lay is None:
        return []
    strategies = _moved(lay.kept, 1, 1, extra=(Replicate(),) * len(lay.tensors))
    for b in range(lay.b_ndim):
        idx = lay.index_shards(b)
        if any(type(p) is Shard for p in idx):
            strategies.append(OpStrategy((Shard(lay.start + b),), (Replicate(),) + idx))
    return strategies


@register([aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
           aten._unsafe_index_put.default])
def index_put_rule(call: OpCall) -> list[OpStrategy]:
    """self[indices] = values (or += with accumulate: the backward of indexing).

    Non-indexed dims keep their shards on self and values.  With accumulate, index tensors
    sharded on a broadcast dim (values following) add each rank's share into Partial(sum).
    Linear in (self, values): Partial sum/avg with accumulate, every kind without.
    """
    values = call.inputs[-1].shape
    accumulate = call.arg(3, "accumulate", False)
    n_idx = len(call.inputs) - 2
    kinds = LINEAR_PARTIALS if accumulate else ALL_PARTIALS
    partials = [OpStrategy((p,), (p,) + (Replicate(),) * n_idx + (p,)) for p in kinds]
    lay = _indexing(call)
    if lay is None:
        return partials
    strategies = [
        OpStrategy((Shard(d),), (Shard(d),) + (Replicate(),) * n_idx + (lay.values_placement(values, r),))
        for d, r in lay.kept.items()
    ]
    if accumulate:
        for b in range(lay.b_ndim):
            idx = lay.index_shards(b)
            if any(type(p) is Shard for p in idx):
                v = lay.values_placement(values, lay.start + b)
                strategies.append(OpStrategy((Partial(),), (Partial(),) + idx + (v,)))
    return strategies + partials


# -- masks and permutations ------------------------------------------------------------------------
@register([aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default])
def tri_rule(call: OpCall) -> list[OpStrategy]:
    """Leading dims shard freely; the two matrix dims shard with a kernel that moves the diagonal
    by the piece's offsets."""
    nd = len(call.inputs[0].shape)
    strategies = [
        OpStrategy(s.outputs, s.inputs, kernel="tri_offset" if s.outputs[0].dim >= nd - 2 else None)
        for s in shard_strategies(call)
    ]
    return strategies + [OpStrategy((p,), (p,)) for p in ALL_PARTIALS]


@register_kernel("tri_offset")
def tri_offset_kernel(func, args, kwargs, in_specs, out_specs, coord):
    """Element (i, j) of a piece at rows lo.. and columns clo.. is global (i + lo, j + clo)."""
    box = in_specs[0].local_box(coord)
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    args, kwargs = with_arg(args, kwargs, 1, "diagonal", diagonal + box[-2][0] - box[-1][0])
    return func(*args, **kwargs)


@register([aten.roll.default, aten.flip.default])
def roll_flip_rule(call: OpCall) -> list[OpStrategy]:
    """Dims not rolled or flipped keep their shards; roll without dims flattens (Replicate)."""
    nd = len(call.inputs[0].shape)
    is_roll = call.func._schema.name == "aten::roll"
    dims = call.arg(2, "dims", ()) if is_roll else call.arg(1, "dims")
    moved = set(range(nd)) if is_roll and not dims else {_dim(d, nd) for d in dims}
    return [s for s in shard_strategies(call) if s.outputs[0].dim not in moved] + [
        OpStrategy((p,), (p,)) for p in ALL_PARTIALS
    ]


@register([aten.repeat.default])
def repeat_rule(call: OpCall) -> list[OpStrategy]:
    """Dims repeated once keep their shards (repeats align from the right)."""
    src = call.inputs[0].shape
    repeats = list(call.arg(1, "repeats"))
    off = len(repeats) - len(src)
    return _moved({d: d + off for d in range(len(src)) if repeats[d + off] == 1}, 1, 1)
