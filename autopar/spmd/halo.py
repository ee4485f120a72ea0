"""Ops over images with a split spatial dim: which rows each piece needs, and how its local op runs.

A rank holding rows [a, b) of an input and computing rows [c, e) of the output (both cut by the
split rule) needs the input rows that those outputs read: its own and a few of its neighbours'
(the halo).  `autopar.redistribute.halo` moves them point to point; this module says which rows and
how the local op then computes exactly its output rows:

- a sliding window (convolution, pooling, adaptive pooling whose windows tile the input) runs
  the op itself, with its own padding, stride and dilation, on a piece widened to the rows
  [origin, stop): the rows the kept outputs read come from their holders, and the rows only
  discarded outputs read are zeros, put there so that the local windows fall where the global
  ones do (`Window.piece`); the outputs are then cut to [c, e).  The backward pads the output
  gradient with zeros to the local op's output, runs the op's backward, and sends the gradient
  of each received row back to its holder, where it is summed in (`widen` / `narrow_back`);
- a 1-D map of rows (interpolation, reflect/replicate padding: output row o is a weighted sum
  of a few input rows) is applied along each split dim by gathering the rows it reads
  (`RowMap`, `map_rows`); the op then runs on the other dims with the split ones left as they
  are.  Its backward adds each output row's gradient into the rows it read and sends them back.

Everything here is a function of the global shapes and the split rule, so every rank plans
every other rank's transfers alike, and a rank with an empty output piece still sends its rows.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..redistribute.halo import fetch_rows, return_rows
from ..placement import Shard


# -- which ranks hold which rows --------------------------------------------------------------
@dataclass(frozen=True)
class SplitDim:
    """One split dim as the members of its group see it: `have[i]` the input rows and `out[i]`
    the output rows of member i (global rank `group[i]`); this rank is member `me`."""

    dim: int
    group: tuple
    me: int
    have: tuple
    out: tuple
    size: int  # of the input along `dim`


def split_dims(in_spec, out_spec, coord, dims: Sequence[int]) -> list[SplitDim]:
    """The dims among `dims` that `in_spec` splits (on mesh dims of size > 1), with the pieces
    of `in_spec` and of `out_spec` (which splits the same dim over the same mesh dims)."""
    mesh = in_spec.mesh
    rank = int(mesh.mesh[tuple(coord)])
    found = []
    for d in dims:
        mesh_dims = tuple(m for m in in_spec.sharding_mesh_dims(d) if mesh.shape[m] > 1)
        if not mesh_dims:
            continue
        group = mesh.group_of(rank, mesh_dims)
        coords = [mesh.coordinate(r) for r in group]
        found.append(SplitDim(d, group, group.index(rank), tuple(in_spec.block_box(c)[d] for c in coords),
                              tuple(out_spec.block_box(c)[d] for c in coords), in_spec.shape[d]))
    return found


def spatially_split(spec, n_spatial: int) -> bool:
    """Whether one of the trailing `n_spatial` dims of `spec` is split (a halo may be needed)."""
    first = spec.ndim - n_spatial
    return any(type(p) is Shard and p.dim >= first and k > 1 for p, k in zip(spec.placements, spec.mesh.shape))


# -- sliding windows ----------------------------------------------------------------------------
class Piece(NamedTuple):
    """The rows a rank's local op runs on along one dim: [origin, stop), of which [lo, hi) are
    the input's rows its kept outputs read (the rest zeros); its outputs start at `first`."""

    origin: int
    stop: int
    lo: int
    hi: int
    first: int


@dataclass(frozen=True)
class Window:
    """A sliding window along one dim: output row o reads input rows o*stride - padding +
    j*dilation (j < kernel); transposed, input row i adds into those output rows instead."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    transposed: bool = False

    def reads(self, c: int, e: int) -> tuple[int, int]:
        """The input rows [lo, hi) that output rows [c, e) read (before clipping to the input).

        >>> Window(3, 1, 1).reads(4, 8), Window(3, 2, 1).reads(0, 4), Window(4, 2, 1, transposed=True).reads(2, 6)
        ((3, 9), (-1, 8), (0, 4))
        """
        span = (self.kernel - 1) * self.dilation
        s, p = self.stride, self.padding
        if self.transposed:  # i*s - p + j*dilation in [c, e)
            return -((span - c - p) // s), (e - 1 + p) // s + 1
        return c * s - p, (e - 1) * s - p + span + 1

    def piece(self, c: int, e: int, size: int) -> Piece:
        """The local op's rows for output rows [c, e) of an input of `size` rows.

        The op keeps its own padding: on a piece that starts at row 0 it pads as the global op
        does, and elsewhere the zero rows before `lo` only feed outputs before `first` (the
        piece starts at a multiple of the stride, so local windows sit where global ones do).
        A transposed window also gets zero rows after `hi` until its output reaches row e.

        >>> Window(3, 2, 1).piece(2, 4, 8)
        Piece(origin=2, stop=8, lo=3, hi=8, first=1)
        """
        lo_u, hi_u = self.reads(c, e)
        lo, hi = max(lo_u, 0), min(hi_u, size)
        s, p, span = self.stride, self.padding, (self.kernel - 1) * self.dilation
        if self.transposed:
            origin = max(0, min(lo_u, c // s))
            rows = -((origin * s + 1 - e - 2 * p + span) // s) + 1  # the fewest giving output row e - 1
            stop = max(hi, origin + max(rows, 1))
            first = c - origin * s
        else:
            origin, stop = (0 if c * s <= p else (c - -(-p // s)) * s), hi
            if stop - origin <= span:  # some ops want at least a window of rows (avg_pool3d)
                if stop < size:  # zeros after: past every kept window
                    stop = origin + span + 1
                else:  # zeros before, keeping the stride's phase (the global end pads as it is)
                    origin = max(0, origin - s * -(-(span + 1 - stop + origin) // s))
            first = c - origin // s
        return Piece(origin, stop, lo, max(lo, hi), first)


def _need(sd: SplitDim, window: Window) -> list[list[tuple[int, int]]]:
    """Each member's input rows along `sd` (none for an empty output piece)."""
    need = []
    for c, e in sd.out:
        piece = window.piece(c, e, sd.size) if e > c else None
        need.append([(piece.lo, piece.hi)] if piece is not None and piece.hi > piece.lo else [])
    return need


def _pad(t: torch.Tensor, dim: int, before: int, after: int, value=0) -> torch.Tensor:
    if not before and not after:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [before, after]
    return torch.constant_pad_nd(t, pads, value)


def my_pieces(splits: Sequence[SplitDim], windows: Sequence[Window]) -> Optional[list[Piece]]:
    """This rank's pieces along each split dim, or None where its output piece is empty."""
    pieces = []
    for sd, w in zip(splits, windows):
        c, e = sd.out[sd.me]
        if e <= c:
            return None
        pieces.append(w.piece(c, e, sd.size))
    return pieces


def widen(x: torch.Tensor, splits: Sequence[SplitDim], windows: Sequence[Window], values: bool = True):
    """`x` (this rank's piece) widened to its local op's rows along each split dim, or None
    where this rank's output piece is empty (it still sends its rows).  The rows come from
    their holders (corners too: each dim's exchange carries the rows received before); with
    `values=False` nothing moves and the rows are zeros (a backward that reads only shapes)."""
    pieces = my_pieces(splits, windows)
    if values:
        for sd, w in zip(splits, windows):
            x = fetch_rows(x, sd.dim, sd.group, sd.me, sd.have, _need(sd, w))
    if pieces is None:
        return None
    if not values:
        shape = list(x.shape)
        for sd, pc in zip(splits, pieces):
            shape[sd.dim] = pc.hi - pc.lo
        x = x.new_zeros(shape)
    for sd, pc in zip(splits, pieces):
        x = _pad(x, sd.dim, pc.lo - pc.origin, pc.stop - pc.hi)
    return x


def keep(out: torch.Tensor, splits: Sequence[SplitDim], windows: Sequence[Window]) -> torch.Tensor:
    """The local op's output cut to this rank's output rows, dense in the op's memory format
    (a view of the piece is what later views of the tensor expect)."""
    whole = out
    for sd, pc in zip(splits, my_pieces(splits, windows)):
        c, e = sd.out[sd.me]
        out = out.narrow(sd.dim, pc.first, e - c)
    return out if out.shape == whole.shape else out.clone(memory_format=torch.preserve_format)


def pad_back(g: torch.Tensor, splits: Sequence[SplitDim], windows: Sequence[Window], full, value=0) -> torch.Tensor:
    """This rank's output gradient (or indices) padded with `value` to the local op's output
    shape `full`: the outputs it discarded get no gradient."""
    for sd, pc in zip(splits, my_pieces(splits, windows)):
        g = _pad(g, sd.dim, pc.first, full[sd.dim] - pc.first - g.shape[sd.dim], value)
    return g


def narrow_back(grad: Optional[torch.Tensor], x: torch.Tensor, splits: Sequence[SplitDim], windows: Sequence[Window]):
    """The gradient of this rank's input piece `x` from the gradient `grad` of its
    widened rows (None where its output piece is empty): each received row's gradient goes back
    to its holder and is summed in there."""
    pieces = my_pieces(splits, windows)
    if grad is None:
        shape = list(x.shape)
        for sd, w in zip(splits, windows):
            shape[sd.dim] = 0 if pieces is None else sum(t - s for s, t in _need(sd, w)[sd.me])
        grad = x.new_zeros(shape)
    else:
        for sd, pc in zip(splits, pieces):
            grad = grad.narrow(sd.dim, pc.lo - pc.origin, pc.hi - pc.lo)
    for sd, w in reversed(list(zip(splits, windows))):
        grad = return_rows(grad, sd.dim, sd.group, sd.me, sd.have, _need(sd, w))
    return grad


def local_grid(index: torch.Tensor, splits: Sequence[SplitDim], windows: Sequence[Window], local_shape,
               global_shape, to_global: bool) -> torch.Tensor:
    """Max pooling's indices (flat positions in a plane of the trailing spatial dims) moved
    between this rank's widened plane (`local_shape`) and the global one."""
    n = len(local_shape)
    origins = [0] * n
    first_dim = index.dim() - n
    for sd, pc in zip(splits, my_pieces(splits, windows)):
        origins[sd.dim - first_dim] = pc.origin
    src, dst, sign = (local_shape, global_shape, 1) if to_global else (global_shape, local_shape, -1)
    coords, rest = [], index
    for size in reversed(src):
        coords.append(rest % size)
        rest = rest.div(size, rounding_mode="floor")
    out = torch.zeros_like(index)
    for j, (size, coord) in enumerate(zip(dst, reversed(coords))):
        out = out * size + coord + sign * origins[j]
    return out


# -- 1-D maps of rows ----------------------------------------------------------------------------
@dataclass(eq=False, frozen=True)
class RowMap:
    """Output row o along one dim is the sum over t of weight[t, o] * input row index[t, o]
    (weight None: a copy of row index[0, o]).  Built once per op setting and cached."""

    index: torch.Tensor  # (taps, output rows) int64, on the CPU
    weight: Optional[torch.Tensor] = None


def _quiet():
    """Planning reads index tables into Python: done outside any capture (a captured step
    replays the tables, not how they were made)."""
    return _disable_current_modes()


@functools.lru_cache(maxsize=512)
def _map_plan(row_map: RowMap, have: tuple, out: tuple) -> tuple[list, list]:
    """(the rows each member reads, as ranges; each member's taps as positions in its
    received rows)."""
    with _quiet():
        need, local = [], []
        for c, e in out:
            taps = row_map.index[:, c:e]
            rows = torch.unique(taps[taps >= 0]).tolist()
            runs = []
            for r in rows:
                if runs and runs[-1][1] == r:
                    runs[-1][1] = r + 1
                else:
                    runs.append([r, r + 1])
            lookup = torch.full((max(rows[-1] + 1, 1) if rows else 1,), -1, dtype=torch.long)
            offset = 0
            for s, t in runs:
                lookup[s:t] = torch.arange(offset, offset + t - s)
                offset += t - s
            need.append([tuple(r) for r in runs])
            local.append(lookup[taps.clamp_min(0)])
        return need, local


def _broadcast(w: torch.Tensor, t: torch.Tensor, dim: int) -> torch.Tensor:
    return w.reshape((-1,) + (1,) * (t.dim() - 1 - dim))


def map_rows(x: torch.Tensor, sd: SplitDim, row_map: RowMap) -> torch.Tensor:
    """This rank's output rows of `row_map` along `sd`, from its input piece `x` and the rows
    it reads from its peers."""
    need, local = _map_plan(row_map, sd.have, sd.out)
    rows = fetch_rows(x, sd.dim, sd.group, sd.me, sd.have, need)
    taps = local[sd.me].to(x.device)
    if row_map.weight is None:
        return rows.index_select(sd.dim, taps[0])
    c, e = sd.out[sd.me]
    weight = row_map.weight[:, c:e].to(x.device, x.dtype)
    out = rows.index_select(sd.dim, taps[0]) * _broadcast(weight[0], rows, sd.dim)
    for t in range(1, taps.shape[0]):
        out = out + rows.index_select(sd.dim, taps[t]) * _broadcast(weight[t], rows, sd.dim)
    return out


def map_rows_backward(g: torch.Tensor, sd: SplitDim, row_map: RowMap) -> torch.Tensor:
    """The adjoint of `map_rows`: the gradient of this rank's input piece."""
    need, local = _map_plan(row_map, sd.have, sd.out)
    taps = local[sd.me].to(g.device)
    shape = list(g.shape)
    shape[sd.dim] = sum(t - s for s, t in need[sd.me])
    grad = g.new_zeros(shape)
    c, e = sd.out[sd.me]
    for t in range(taps.shape[0]):
        term = g if row_map.weight is None else g * _broadcast(row_map.weight[t, c:e].to(g.device, g.dtype), g, sd.dim)
        grad.index_add_(sd.dim, taps[t], term)
    return return_rows(grad, sd.dim, sd.group, sd.me, sd.have, need)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=256)
def interpolation_map(mode: str, in_size: int, out_size: int, align_corners: bool, scale: Optional[float],
                      dtype: torch.dtype) -> RowMap:
    """torch's linear or cubic interpolation along one dim, as taps: the source position of
    output row o is (in_size - 1) / (out_size - 1) * o with align_corners, else
    s * (o + 0.5) - 0.5 with s = 1 / scale (or in_size / out_size), clamped at 0 for linear;
    linear reads its floor and the next row, cubic four rows around it (clamped to the input)
    with Keys' coefficients (A = -0.75), all in the op's compute precision."""
    with _quiet():
        dt = _opmath(dtype)
        if align_corners:
            s = torch.tensor(in_size - 1, dtype=dt) / (out_size - 1) if out_size > 1 else torch.tensor(0, dtype=dt)
            real = s * torch.arange(out_size, dtype=dt)
        else:
            if scale is not None and scale > 0:
                s = torch.tensor(1.0 / scale, dtype=dt)
            else:
                s = torch.tensor(in_size, dtype=dt) / out_size
            real = s * (torch.arange(out_size, dtype=dt) + 0.5) - 0.5
            if mode == "linear":
                real = real.clamp_min(0)
        index = real.floor().long().clamp_max(in_size - 1)
        lam = (real - index).clamp(0, 1)
        if mode == "linear":
            nxt = index + (index < in_size - 1).long()
            return RowMap(torch.stack([index, nxt]), torch.stack([1 - lam, lam]))
        a = -0.75

        def near(t):  # |t| <= 1
            return ((a + 2) * t - (a + 3)) * t * t + 1

        def far(t):  # 1 < |t| < 2
            return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a

        weight = torch.stack([far(lam + 1), near(lam), near(1 - lam), far(2 - lam)])
        index = torch.stack([(index - 1 + j).clamp(0, in_size - 1) for j in range(4)])
        return RowMap(index, weight)


@functools.lru_cache(maxsize=256)
def probed_map(func, n_spatial: int, j: int, in_size: int, out_size: int, scale: Optional[float],
               device_type: str) -> RowMap:
    """The source row of each output row of a copying op (nearest, nearest-exact interpolation)
    along spatial dim j, read off the op itself run on the row numbers: exactly the op's own
    index arithmetic, whatever the backend computes it with."""
    with _quiet():
        device = "cpu" if device_type == "meta" else device_type
        shape, sizes, scales = [1, 1] + [1] * n_spatial, [1] * n_spatial, [None] * n_spatial
        shape[2 + j], sizes[j], scales[j] = in_size, out_size, scale
        probe = torch.arange(in_size, dtype=torch.float64, device=device).reshape(shape)
        rows = func(probe, sizes, *scales).reshape(1, out_size).long().cpu()
        return RowMap(rows)


@functools.lru_cache(maxsize=256)
def padding_map(mode: str, size: int, before: int, after: int) -> RowMap:
    """Reflect or replicate padding along one dim: output row o copies input row o - before,
    reflected about (or clamped to) the first and last rows."""
    with _quiet():
        rows = torch.arange(-before, size + after)
        if mode == "reflect":
            rows = rows.abs()
            rows = torch.where(rows >= size, 2 * (size - 1) - rows, rows)
        else:
            rows = rows.clamp(0, size - 1)
        return RowMap(rows.reshape(1, -1))

