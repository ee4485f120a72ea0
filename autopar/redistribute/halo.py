"""Halo exchange: move the rows of a split dim that each rank's op needs from the ranks holding them.

A dim of a tensor is cut into contiguous pieces, `have[i]` = [start, stop) held by member i of
`group`; member i needs the rows `need[i]` (a sorted list of disjoint [start, stop) ranges,
usually one range: its own piece widened by a kernel's window).  `fetch_rows` gives each member
its needed rows, in order, receiving from every member that holds some of them what it holds
(one message per sender, point to point: `comm.send_recv`, so `comm_log` shows each `send` and
`recv` with its bytes, and a captured program replays them); `return_rows` is its adjoint: the
gradient of each received row goes back to the member that sent it and is summed into its piece.
Every member computes the same plan from the same ranges, so a message of no elements is
skipped by both ends.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import comm

Ranges = Sequence[tuple[int, int]]


def parts(have: Ranges, need: Ranges) -> list[tuple[int, int, int]]:
    """(owner, start, stop) of each held part of the rows in `need`, in row order.

    >>> parts([(0, 4), (4, 7)], [(2, 6)])
    [(0, 2, 4), (1, 4, 6)]
    """
    found = []
    for lo, hi in need:
        for j, (a, b) in enumerate(have):
            s, t = max(lo, a), min(hi, b)
            if s < t:
                found.append((j, s, t))
    return found


def transfers(have: Ranges, need: Sequence[Ranges], me: int) -> tuple[dict, dict]:
    """The rows member `me` sends ({peer: [(start, stop), ...]}) and receives ({peer: [...]}).

    >>> transfers([(0, 4), (4, 7)], [[(0, 5)], [(3, 7)]], 0)
    ({1: [(3, 4)]}, {1: [(4, 5)]})
    """
    sends: dict = {}
    for j, rows in enumerate(need):
        if j != me:
            for owner, s, t in parts(have, rows):
                if owner == me:
                    sends.setdefault(j, []).append((s, t))
    recvs: dict = {}
    for owner, s, t in parts(have, need[me]):
        if owner != me:
            recvs.setdefault(owner, []).append((s, t))
    return sends, recvs


def _rows(t: torch.Tensor, dim: int, ranges: Ranges, origin: int) -> torch.Tensor:
    """The rows `ranges` of `t`, whose first row is row `origin`, as one tensor."""
    pieces = [t.narrow(dim, s - origin, e - s) for s, e in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _buffer(like: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = n
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _count(ranges: Ranges) -> int:
    return sum(e - s for s, e in ranges)


def _send_recv(sends: list, recvs: list) -> None:
    """Post every non-empty message (both ends agree on which are empty: same shapes)."""
    comm.send_recv([(t, p) for t, p in sends if t.numel()], [(b, p) for b, p in recvs if b.numel()])


def fetch_rows(local: torch.Tensor, dim: int, group: Sequence[int], me: int, have: Ranges,
               need: Sequence[Ranges]) -> torch.Tensor:
    """The rows `need[me]` concatenated in order, from this member's piece `local` (rows
    `have[me]`) and its peers' pieces (collective over `group`)."""
    origin = have[me][0]
    sends, recvs = transfers(have, need, me)
    out_msgs = [(_rows(local, dim, rows, origin).contiguous(), group[j]) for j, rows in sends.items()]
    bufs = {j: _buffer(local, dim, _count(rows)) for j, rows in recvs.items()}
    _send_recv(out_msgs, [(b, group[j]) for j, b in bufs.items()])
    pieces, used = [], {j: 0 for j in bufs}
    for owner, s, t in parts(have, need[me]):
        if owner == me:
            pieces.append(local.narrow(dim, s - origin, t - s))
        else:
            pieces.append(bufs[owner].narrow(dim, used[owner], t - s))
            used[owner] += t - s
    if not pieces:
        return _buffer(local, dim, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def return_rows(grad: torch.Tensor, dim: int, group: Sequence[int], me: int, have: Ranges,
                need: Sequence[Ranges]) -> torch.Tensor:
    """The adjoint of `fetch_rows`: `grad` holds the gradient of the rows `need[me]`; each
    part goes back to its owner, and this member's piece (rows `have[me]`) gets the sum of
    its own part and the parts its peers send back (collective over `group`)."""
    a, b = have[me]
    mine = parts(have, need[me])
    back: dict = {}
    offset = 0
    own = []
    for owner, s, t in mine:
        piece = grad.narrow(dim, offset, t - s)
        offset += t - s
        if owner == me:
            own.append((s, piece))
        else:
            back.setdefault(owner, []).append(piece)
    out_msgs = [(p[0] if len(p) == 1 else torch.cat(p, dim), group[j]) for j, p in back.items()]
    sends, _ = transfers(have, need, me)  # what this member sent is what comes back
    bufs = {j: _buffer(grad, dim, _count(rows)) for j, rows in sends.items()}
    _send_recv([(t.contiguous(), p) for t, p in out_msgs], [(buf, group[j]) for j, buf in bufs.items()])
    out = torch.zeros(_buffer(grad, dim, b - a).shape, dtype=grad.dtype, device=grad.device)
    for s, piece in own:
        out.narrow(dim, s - a, piece.shape[dim]).add_(piece)
    for j, rows in sends.items():
        used = 0
        for s, t in rows:
            out.narrow(dim, s - a, t - s).add_(bufs[j].narrow(dim, used, t - s))
            used += t - s
    return out
