"""Synchronous collectives over mesh-ordered rank tuples, each logged and error-wrapped.

Inputs are this rank's local tensors; dim 0 is the exchange dim (callers move the dim
they exchange to the front).  Uneven pieces are the caller's job (pad or use all_to_all).
Every value arrives as torch computes it in one process: a complex tensor moves as its
(re, im) pairs, and a NaN survives a max/min (`_KeepNaN`).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import AllreduceOptions, AllToAllOptions, BroadcastOptions, ReduceScatterOptions

from ..placement import ReduceType
from .backend import SIMULATING, current_device, get_rank, group_for
from .exits import wait_for
from .faults import enter, fail
from .log import blocked_since, record
from .fake import filling_outputs, plausible
from .inflight import Arrival, Post
from .observers import _CAPTURES, seen_whole  # (read on every transfer)

_TORCH_OP = {
    ReduceType.SUM: tdist.ReduceOp.SUM,
    ReduceType.AVG: tdist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide
    ReduceType.MAX: tdist.ReduceOp.MAX,
    ReduceType.MIN: tdist.ReduceOp.MIN,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# dtypes gloo (and NCCL, but for its own fp8) refuse ("Invalid scalar type"): moved as their
# bytes, reduced in a wider dtype: integers (the same bits come back: integer sums wrap alike)
# and the 8-bit floats (summed in float32 and rounded once, as one fp8 addition rounds)
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64, torch.uint64: torch.int64,
          **{getattr(torch, name): torch.float32 for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                              "float8_e5m2fnuz", "float8_e8m0fnu")
             if hasattr(torch, name)}}


def _real(t: torch.Tensor) -> torch.Tensor:
    """`t` as the backend moves it: a complex tensor as a real view of its (re, im) pairs (gloo
    and NCCL know no complex dtype; torch.distributed's own API views them the same way), a
    dtype they refuse as its bytes in a trailing dim (every leading dim, the one
    gathers and all-to-alls split included, stays as it is)."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t.unsqueeze(-1).view(torch.uint8) if t.dtype in _WIDER else t


def _widened(reduce, t: torch.Tensor, *args) -> torch.Tensor:
    """`reduce(t, *args)` run on `t` in a wider dtype (see _WIDER), back in `t`'s."""
    return reduce(t.to(_WIDER[t.dtype]), *args).to(t.dtype)


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """`t` with its values in its memory, as the backend reads them: contiguous, and a lazy
    conjugate or negation (a bit only torch's kernels honour) applied.  `t` itself when it is."""
    return t.resolve_conj().resolve_neg().contiguous()


def _check_ordered(op: str, t: torch.Tensor, reduce_type: ReduceType, ranks) -> None:
    """A max/min of complex numbers is refused on every rank before anything moves, as
    torch.amax refuses it: they have no order."""
    if reduce_type in _WINNER and t.is_complex():
        raise TypeError(
            f"{op} with reduce op {reduce_type.value} over ranks {list(ranks)}: a {t.dtype} tensor of shape "
            f"{list(t.shape)} has no order (torch.amax/amin refuse complex tensors too); reduce its .abs() or .real"
        )


def reading_values(what: str) -> None:
    """A distributed tensor's values are about to be read into Python (`.tolist()`,
    `.numpy()`): an attached capture refuses, as it cannot replay a value-dependent step."""
    for capture in _CAPTURES:
        capture.value_read(what)


class Wire:
    """One blocking transfer: `run(*tensors)` moves the bytes (writing its outputs in place),
    then `logs` (op, ranks, sent, received, shape) go to comm_log, then `after(*tensors)`, if
    any, reads what arrived (a max/min's NaN check, which may move a few bytes more and logs
    them).  Kept whole so that a captured program can replay it."""

    __slots__ = ("op", "ranks", "run", "logs", "after")
    half = ""  # (whole: see `inflight` for the transfers made in two halves)

    def __init__(self, op: str, ranks, run, logs: tuple, after=None):
        self.op, self.ranks, self.run, self.logs, self.after = op, tuple(ranks), run, logs, after

    def __call__(self, *tensors) -> None:
        seq = enter(self.op, self.ranks, tensors[-1])
        start = time.perf_counter()
        try:
            if SIMULATING[0]:  # the fake group copies the input to the outputs: the transfer's bytes
                with filling_outputs():
                    self.run(*tensors)
            else:
                self.run(*tensors)
        except RuntimeError as e:
            fail(self.op, self.ranks, seq, e)
        blocked_since(start)
        if SIMULATING[0]:
            plausible(self.op, tensors, self.logs)
        for log in self.logs:
            record(*log)
        if self.after is not None:
            try:
                self.after(*tensors)
            except RuntimeError as e:
                fail(self.op, self.ranks, seq, e)


def _wire(op: str, ranks, run, tensors: tuple, sent: int = 0, received: int = 0, shape: tuple = (),
          logs: tuple | None = None, after=None) -> None:
    seen_whole(Wire(op, ranks, run, ((op, tuple(ranks), sent, received, shape),) if logs is None else logs, after),
               tensors)


def all_gather_into(t: torch.Tensor, ranks: tuple) -> torch.Tensor:
    """Every member's `t` (all the same shape) concatenated along dim 0, in mesh order."""
    if len(ranks) == 1:
        return t
    t, out, n = _all_gather_buffers(t, len(ranks))
    _wire("all_gather", ranks, lambda o, i: wait_for(group_for(ranks)._allgather_base(_real(o), _real(i)), ranks),
          (out, t), n, n, tuple(t.shape))
    return out


def _all_gather_buffers(t: torch.Tensor, k: int) -> tuple:
    """(`t` as sent, the output, the bytes each member sends)."""
    t = _sendable(t).reshape(t.shape if t.dim() else (1,))
    out = torch.empty((k * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return t, out, _nbytes(t) * (k - 1)


def all_gather(t: torch.Tensor, ranks: tuple) -> list[torch.Tensor]:
    """Every member's `t` (all the same shape), in mesh order."""
    if len(ranks) == 1:
        return [t]
    out = all_gather_into(t, ranks)
    return list(out.chunk(len(ranks))) if t.dim() > 0 else [x.reshape(()) for x in out.unbind()]


def _all_reduce_options(reduce_type: ReduceType) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = _TORCH_OP[reduce_type]
    return opts


def _all_reduce_bytes(t: torch.Tensor, k: int) -> int:
    """What each member sends (and receives) in a bandwidth-optimal all-reduce of `t`."""
    return 2 * (k - 1) * _nbytes(t) // k


def _all_reduced(out: torch.Tensor, reduce_type: ReduceType, k: int) -> torch.Tensor:
    if reduce_type is ReduceType.AVG:  # gloo has no AVG: the sum, divided here
        out.div_(k)
    return out


# gloo's all_reduce makes two exchanges (a reduce-scatter, then an all-gather) where an
# all-gather makes one; between two ranks both move the tensor's bytes once, so up to this
# size the pair gathers both terms and reduces them here: 64 B to 1 MiB measured 15-35%
# faster on this machine's gloo, larger ones slower (the local pass over twice the bytes:
# 3x at 16 MiB)
GATHERED_ALL_REDUCE_BYTES = 1 << 20
_LOCAL_REDUCE = {
    ReduceType.SUM: torch.sum, ReduceType.AVG: torch.sum, ReduceType.MAX: torch.amax, ReduceType.MIN: torch.amin,
}


_PAIR_REDUCE = {
    ReduceType.SUM: torch.add, ReduceType.AVG: torch.add, ReduceType.MAX: torch.maximum, ReduceType.MIN: torch.minimum,
}


def gathered_all_reduce(nbytes: int, group_size: int, on_host: bool) -> bool:
    """Whether an all-reduce of `nbytes` over `group_size` ranks runs as an all-gather and a
    local reduction: two ranks on host tensors (gloo), up to GATHERED_ALL_REDUCE_BYTES."""
    return on_host and group_size == 2 and nbytes <= GATHERED_ALL_REDUCE_BYTES


def all_reduce(
    t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM, inplace: bool = False
) -> torch.Tensor:
    """Reduce `t` over the members; returns the reduced tensor (a new contiguous tensor, or
    `t` itself with `inplace=True` when it is contiguous, without a lazy conjugate, and the
    caller owns it).  Every member gets the same bits."""
    _check_ordered("all_reduce", t, reduce_type, ranks)
    if t.dtype in _WIDER:
        out = _widened(all_reduce, t, ranks, reduce_type)
        return t.copy_(out) if inplace and t.is_contiguous() else out
    k = len(ranks)
    out = _sendable(t)
    if out is t and not inplace:
        out = t.clone()
    if k == 1:
        return out
    moved = _all_reduce_bytes(out, k)
    terms = _gathered_terms(out, k)
    if terms is not None:
        _wire("all_reduce", ranks, lambda g, o: wait_for(_gather_terms(ranks, g, o), ranks), (terms, out), moved, moved,
              tuple(out.shape))
        return _reduce_terms(terms, out, reduce_type, k)
    opts = _all_reduce_options(reduce_type)
    keep = _KeepNaN.needed(out, reduce_type, ranks)
    _wire("all_reduce", ranks, lambda o: wait_for(_post_all_reduce(ranks, o, opts, keep), ranks), (out,), moved, moved,
          tuple(out.shape), after=None if keep is None else keep.restore)
    return _all_reduced(out, reduce_type, k)


def _post_all_reduce(ranks: tuple, t: torch.Tensor, opts: AllreduceOptions, keep):
    """Post the backend's all-reduce of `t` in place, its NaNs first hidden from a max/min."""
    group = group_for(ranks)
    if keep is not None:
        keep.hide(t, group)
    return group.allreduce([_real(t)], opts)


# A backend's max/min meets the terms pairwise in its algorithm's order and keeps a NaN or
# drops it depending on that order (a comparison with NaN is false either way round): on 3
# ranks of gloo a NaN on rank 1 came out as a number.  torch.amax/amin always keep it.  So each rank's NaNs go in
# as the value that wins the reduction, and where the result comes out as that value (the
# same places on every member: the same bits) one all-reduce of a byte per place says which
# were NaN.  A result without that value, the usual case, moves nothing more: the check is a
# sum over the input and an amax/amin over the result, both local.
_WINNER = {ReduceType.MAX: math.inf, ReduceType.MIN: -math.inf}


class _KeepNaN:
    """The NaNs of one max/min all-reduce through the backend: `hide` them in the input before
    it is posted, `restore` them in the result."""

    __slots__ = ("reduce_type", "ranks", "nan", "group")

    def __init__(self, reduce_type: ReduceType, ranks: tuple):
        self.reduce_type, self.ranks, self.nan, self.group = reduce_type, ranks, None, None

    @staticmethod
    def needed(t: torch.Tensor, reduce_type: ReduceType, ranks: tuple):
        """A keeper where a NaN could be lost: a max/min of floats with values to read (a
        simulated rank moves none)."""
        if reduce_type in _WINNER and t.is_floating_point() and t.numel() and not SIMULATING[0]:
            return _KeepNaN(reduce_type, ranks)
        return None

    def hide(self, t: torch.Tensor, group) -> None:
        """This rank's NaNs in `t` become the winning value (in place); where they were is kept."""
        self.group, self.nan = group, None
        if torch.isnan(t.sum()):  # a NaN (or +inf and -inf) somewhere: one pass tells
            self.nan = t.isnan()
            t.masked_fill_(self.nan, _WINNER[self.reduce_type])

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """NaN back where a member had one, in the reduced `out` (in place)."""
        winner, nan, self.nan = _WINNER[self.reduce_type], self.nan, None
        if _LOCAL_REDUCE[self.reduce_type](out) != winner:
            return out
        places = (out.view(-1) == winner).nonzero().squeeze(1)
        if nan is None:
            flags = torch.zeros(places.shape, dtype=torch.uint8, device=out.device)
        else:
            flags = nan.view(-1)[places].to(torch.uint8)
        wait_for(self.group.allreduce([flags], _all_reduce_options(ReduceType.MAX)), self.ranks)
        out.view(-1)[places[flags.bool()]] = math.nan
        moved = _all_reduce_bytes(flags, len(self.ranks))
        record("all_reduce", self.ranks, moved, moved, tuple(flags.shape))
        return out


def _gathered_terms(t: torch.Tensor, k: int):
    """The buffer for every member's `t` where the all-reduce of `t` is gathered (None: the
    backend's own).  A meta tensor (a simulation on the meta device) stands for one on the
    device this rank would compute on."""
    device = current_device() if t.is_meta else t.device
    if not gathered_all_reduce(_nbytes(t), k, device.type == "cpu"):
        return None
    return torch.empty((k,) + tuple(t.shape), dtype=t.dtype, device=t.device)


def _gather_terms(ranks: tuple, terms: torch.Tensor, t: torch.Tensor):
    return group_for(ranks)._allgather_base(_real(terms.view(-1)), _real(t.view(-1)))


def _reduce_terms(terms: torch.Tensor, out: torch.Tensor, reduce_type: ReduceType, k: int) -> torch.Tensor:
    """`out` = the gathered terms reduced in mesh order: the same bits on every member (two
    terms by the binary op: a quarter of a reduction over dim 0's time on the CPU)."""
    if k == 2:
        _PAIR_REDUCE[reduce_type](terms[0], terms[1], out=out)
    else:
        _LOCAL_REDUCE[reduce_type](terms, 0, out=out)
    return _all_reduced(out, reduce_type, k)


class Pending:
    """A collective in flight (`all_reduce_start`, `reduce_scatter_start`, `all_gather_start`):
    `wait()` returns its result, logged once it has arrived (its `inflight.Arrival`, which a
    capture sees as the second half of the transfer)."""

    __slots__ = ("out", "arrival", "tensors")

    def __init__(self, out: torch.Tensor, arrival: Arrival | None = None, tensors: tuple = ()):
        self.out, self.arrival, self.tensors = out, arrival, tensors

    def wait(self) -> torch.Tensor:
        if self.arrival is not None:
            arrival, self.arrival = self.arrival, None
            seen_whole(arrival, self.tensors)
        return self.out


def _started(op: str, ranks: tuple, start, tensors: tuple, out: torch.Tensor, log: tuple, finish=None,
             moved: int = 2) -> Pending:
    """Post a collective over `tensors` (the input last; `start(*tensors)` posts it, `finish(*tensors)`
    completes `out` once it has arrived; `moved`: how many of the last tensors are the
    transfer's outputs and input) and return it in flight."""
    post = Post(op, ranks, start)
    seen_whole(post, tensors)
    return Pending(out, Arrival(post, ((op, tuple(ranks)) + log,), finish, moved), tensors)


def all_reduce_start(t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM) -> Pending:
    """Start reducing `t` (contiguous and the caller's: reduced in place) over the members and
    return at once, so that computation goes on while the bytes move."""
    _check_ordered("all_reduce", t, reduce_type, ranks)
    if len(ranks) == 1 or _sendable(t) is not t or t.dtype in _WIDER:
        return Pending(all_reduce(t, ranks, reduce_type, inplace=True))
    k = len(ranks)
    moved = _all_reduce_bytes(t, k)
    log = (moved, moved, tuple(t.shape))
    terms = _gathered_terms(t, k)
    if terms is not None:
        return _started("all_reduce", ranks, lambda terms, t: _gather_terms(ranks, terms, t), (terms, t), t, log,
                        lambda terms, t: _reduce_terms(terms, t, reduce_type, k))
    opts = _all_reduce_options(reduce_type)
    keep = _KeepNaN.needed(t, reduce_type, ranks)
    return _started("all_reduce", ranks, lambda t: _post_all_reduce(ranks, t, opts, keep), (t,), t, log,
                    keep.restore if keep is not None else lambda t: _all_reduced(t, reduce_type, k), 1)


def reduce_scatter_start(t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM) -> Pending:
    """`reduce_scatter`, started: `wait()` returns this member's piece."""
    _check_ordered("reduce_scatter", t, reduce_type, ranks)
    k = len(ranks)
    if k == 1 or reduce_type not in (ReduceType.SUM, ReduceType.AVG) or t.dtype in _WIDER:
        return Pending(reduce_scatter(t, ranks, reduce_type))
    out = _reduce_scatter_out(t, k)
    t = _sendable(t)
    moved = (k - 1) * _nbytes(out)
    log = (moved, moved, tuple(t.shape))
    if _on_host(t):
        pieces = torch.empty_like(t)
        return _started("reduce_scatter", ranks, lambda out, pieces, t: _swap_pieces(ranks, pieces, t),
                        (out, pieces, t), out, log,
                        lambda out, pieces, t: _reduce_terms(pieces.view((k,) + tuple(out.shape)), out, reduce_type, k))
    opts = _reduce_scatter_options(reduce_type)
    finish = (lambda out, t: out.div_(k)) if reduce_type is ReduceType.AVG else None
    return _started("reduce_scatter", ranks,
                    lambda out, t: group_for(ranks)._reduce_scatter_base(_real(out), _real(t), opts), (out, t), out,
                    log, finish)


def _on_host(t: torch.Tensor) -> bool:
    """`t` lives (or, a meta tensor in a simulation, stands for one) in host memory: gloo's."""
    return (current_device() if t.is_meta else t.device).type == "cpu"


def _swap_pieces(ranks: tuple, pieces: torch.Tensor, t: torch.Tensor):
    """Post the all-to-all that gives member j piece j of every member's `t`, into `pieces`."""
    return group_for(ranks).alltoall_base(_real(pieces), _real(t), [], [], AllToAllOptions())


def all_gather_start(t: torch.Tensor, ranks: tuple) -> Pending:
    """`all_gather_into`, started: `wait()` returns every member's `t` along dim 0, in mesh order."""
    if len(ranks) == 1:
        return Pending(t)
    t, out, n = _all_gather_buffers(t, len(ranks))
    return _started("all_gather", ranks, lambda out, t: group_for(ranks)._allgather_base(_real(out), _real(t)),
                    (out, t), out, (n, n, tuple(t.shape)))


def _reduce_scatter_options(reduce_type: ReduceType) -> ReduceScatterOptions:
    opts = ReduceScatterOptions()
    opts.reduceOp = _TORCH_OP[reduce_type]
    return opts


def _reduce_scatter_out(t: torch.Tensor, k: int) -> torch.Tensor:
    if t.shape[0] % k:
        raise ValueError(f"reduce_scatter needs dim 0 ({t.shape[0]}) divisible by {k}")
    return torch.empty((t.shape[0] // k,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)


def reduce_scatter(t: torch.Tensor, ranks: tuple, reduce_type: ReduceType = ReduceType.SUM) -> torch.Tensor:
    """Reduce `t` over the members and return piece i (dim 0 cut in k equal pieces) to member i."""
    _check_ordered("reduce_scatter", t, reduce_type, ranks)
    k = len(ranks)
    if k == 1:
        return t.clone()
    if t.dtype in _WIDER:
        return _widened(reduce_scatter, t, ranks, reduce_type)
    out = _reduce_scatter_out(t, k)
    t = _sendable(t)
    moved = (k - 1) * _nbytes(out)
    if reduce_type in (ReduceType.SUM, ReduceType.AVG) and not _on_host(t):
        opts = _reduce_scatter_options(reduce_type)
        _wire("reduce_scatter", ranks,
              lambda o, i: wait_for(group_for(ranks)._reduce_scatter_base(_real(o), _real(i), opts), ranks),
              (out, t), moved, moved, tuple(t.shape))
        return _all_reduced(out, reduce_type, k)
    # gloo's reduce_scatter copies its input and all-reduces the whole of it (twice a
    # reduce-scatter's bytes), and only sums: on the host, and for max/min anywhere, the
    # pieces go by an all-to-all and are reduced here, which moves each piece once (2 ranks:
    # 1.6-2x faster than gloo's for 1-12 MB on this machine, the same bits) and keeps a NaN,
    # as torch.amax does
    pieces = torch.empty_like(t)
    _wire("reduce_scatter", ranks, lambda o, i: wait_for(_swap_pieces(ranks, o, i), ranks), (pieces, t), moved, moved,
          tuple(t.shape))
    return _reduce_terms(pieces.view((k,) + tuple(out.shape)), out, reduce_type, k)


def all_to_all(t: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], ranks: tuple) -> torch.Tensor:
    """Send rows [sum(send_rows[:j]), ...) of `t` to member j; receive recv_rows[j] rows from j."""
    if len(ranks) == 1:
        return t
    me = ranks.index(get_rank())
    t = _sendable(t)
    out = torch.empty((sum(recv_rows),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    recv, send = list(recv_rows), list(send_rows)
    row = _row_bytes(t)
    _wire("all_to_all", ranks,
          lambda o, i: wait_for(group_for(ranks).alltoall_base(_real(o), _real(i), recv, send, AllToAllOptions()),
                               ranks),
          (out, t),
          row * (sum(send_rows) - send_rows[me]), row * (sum(recv_rows) - recv_rows[me]), tuple(t.shape))
    return out


def _row_bytes(t: torch.Tensor) -> int:
    n = t.element_size()
    for s in t.shape[1:]:
        n *= s
    return n


def broadcast(t: torch.Tensor, src: int, ranks: tuple) -> torch.Tensor:
    """`t` from global rank `src` to every member (in place on the receivers)."""
    if len(ranks) == 1:
        return t
    t = _sendable(t)
    opts = BroadcastOptions()
    opts.rootRank = ranks.index(src)
    me = get_rank()
    _wire("broadcast", ranks, lambda x: wait_for(group_for(ranks).broadcast([_real(x)], opts), ranks), (t,),
          _nbytes(t) * (len(ranks) - 1) if me == src else 0, 0 if me == src else _nbytes(t), tuple(t.shape))
    return t


def send_recv(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Post all sends (tensor, dst) and receives (buffer, src) at once and wait for them."""
    if not sends and not recvs:
        return
    tensors = tuple(_sendable(t) for t, _ in sends) + tuple(buf for buf, _ in recvs)
    dsts, srcs = [p for _, p in sends], [p for _, p in recvs]

    def run(*ts):
        ops = [tdist.P2POp(tdist.isend, _real(t), p) for t, p in zip(ts, dsts)]
        ops += [tdist.P2POp(tdist.irecv, _real(b), p) for b, p in zip(ts[len(dsts):], srcs)]
        for work in tdist.batch_isend_irecv(ops):
            work.wait()  # (unsliced: a timed gloo send or receive wait closes the pair, see `exits`)

    me = get_rank()
    logs = tuple(("send", (me, p), _nbytes(t), 0, tuple(t.shape)) for t, p in zip(tensors, dsts))
    logs += tuple(("recv", (p, me), 0, _nbytes(b), tuple(b.shape)) for b, p in zip(tensors[len(dsts):], srcs))
    _wire("send/recv", [me] + sorted(set(dsts) | set(srcs)), run, tensors, logs=logs)
