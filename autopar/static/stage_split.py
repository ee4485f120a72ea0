"""The static pipeline pass: a captured micro-batch step cut into stages at its cross-mesh transfers.

The program of one micro-batch's train step on this rank (forward, loss, backward: the
ops of the stages this rank holds, and a point-to-point transfer wherever a tensor crossed
meshes) is cut into *parts*: the forward of each stage the rank holds (a virtual pipeline
holds several: they follow one another in the program, each starting where an activation
arrives and ending where one leaves) and the backward of each, in reverse order; with a
zero-bubble schedule each backward is cut again into the ops its input gradient needs (I)
and the rest (W, the weights' gradients), by data flow over the program's slots.

Every cross-mesh transfer becomes a *message* on a channel named after its ranks and its
position in the step (the n-th transfer from rank a to rank b: both ranks recorded the same
sequence, since the capture ran them in lockstep), so a schedule can reorder micro-batches
freely and post receives ahead.  A part takes all its messages first (in a part every
receive comes before every send: a send ends a part) and returns the tensors it sends.

Pure functions of the program: nothing here communicates.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .program import Codegen, Entry, Slot


class Message(NamedTuple):
    """One tensor crossing meshes per micro-batch: to or from `peer` on `channel`."""

    peer: int
    channel: str
    shape: tuple
    dtype: torch.dtype


class Take(NamedTuple):
    """Where a received tensor (the part's `n`-th) is copied into the step's buffer `slot`."""

    slot: int
    n: int


class Give(NamedTuple):
    """Where the tensor in `slot` leaves as the part's `n`-th message (copied first when the
    step writes into it later: a send is only posted, the bytes leave after)."""

    slot: int
    n: int
    copy: bool


class Part:
    """Steps (entries, Takes, Gives) that run as one schedule action, with their messages."""

    def __init__(self, kind: str, chunk: int, entries: list, receives: list, sends: list):
        self.kind, self.chunk, self.entries = kind, chunk, entries  # Entry, Take and Give steps
        self.receives, self.sends = receives, sends  # [(buffer or tensor slot, Message)]
        self.touched: set = set()
        self.run = None  # compiled: run(env, received tensors) -> tensors to send

    def __repr__(self) -> str:
        return f"Part({self.kind}{self.chunk}: {len(self.entries)} ops, {len(self.receives)} in, {len(self.sends)} out)"


class StagedProgram:
    """The parts of a micro-batch step: `parts[(kind, chunk)]` for kinds F, B (or I and W)."""

    def __init__(self, parts: dict, chunks: int, n_inputs: int, n_slots: int, outputs: list, final_part: list):
        self.parts, self.chunks, self.n_inputs, self.n_slots = parts, chunks, n_inputs, n_slots
        self.outputs = outputs  # the step's outputs (loss, gradients): slots or constants
        self.final_part = final_part  # per output: the (kind, chunk) after which it holds its value

    def __str__(self) -> str:
        lines = []
        for key, part in self.parts.items():
            ins = ", ".join(f"{m.channel} from {m.peer} {list(m.shape)}" for _, m in part.receives)
            outs = ", ".join(f"{m.channel} to {m.peer} {list(m.shape)}" for _, m in part.sends)
            lines.append(f"{key[0]}{key[1]}: {len(part.entries)} ops; takes [{ins}]; gives [{outs}]")
        return "\n".join(lines)


class SplitError(ValueError):
    """The captured step cannot be cut into the stages the strategy asks for."""


def _slots(v) -> list:
    if type(v) is Slot:
        return [v.i]
    if isinstance(v, (list, tuple)):
        return [i for x in v for i in _slots(x)]
    return []


def _p2p(e: Entry, stage_ranks: frozenset) -> Optional[list]:
    """For a transfer between stages: per argument ('send' or 'recv', peer); else None (a
    transfer among the ranks of one stage runs in its part, as any collective)."""
    if not e.wire or e.fn.op != "send/recv":
        return None
    me_first = [(log[0], log[1][1] if log[0] == "send" else log[1][0]) for log in e.fn.logs]
    if all(peer in stage_ranks for _, peer in me_first):
        return None
    return me_first


def _messages(entries: list, me: int, meta: Sequence, stage_ranks: frozenset) -> dict:
    """{id(entry): [(slot, 'send'|'recv', Message)]} for every transfer, channels numbered
    per (sender, receiver) in program order."""
    count: dict = {}
    out: dict = {}
    for e in entries:
        sides = _p2p(e, stage_ranks)
        if sides is None:
            continue
        found = []
        for arg, (side, peer) in zip(e.args, sides):
            src, dst = (me, peer) if side == "send" else (peer, me)
            n = count[(src, dst)] = count.get((src, dst), -1) + 1
            shape, dtype = meta[arg.i]
            found.append((arg.i, side, Message(peer, f"pp{src}>{dst}#{n}", tuple(shape), dtype)))
        if len({side for _, side, _ in found}) > 1:
            raise SplitError(f"a cross-mesh transfer on rank {me} both sends and receives ({e}): pipeline stages "
                             f"must be on disjoint meshes")
        out[id(e)] = found
    return out


def _segments(entries: list, messages: dict) -> list[list]:
    """Cut after every send; a piece without a receive belongs to the piece before it
    (a stage's second output, or what the program does after a stage's last send)."""
    pieces: list = [[]]
    for e in entries:
        pieces[-1].append(e)
        if id(e) in messages and messages[id(e)][0][1] == "send":
            pieces.append([])
    merged: list = [pieces[0]]
    for piece in pieces[1:]:
        if any(id(e) in messages and messages[id(e)][0][1] == "recv" for e in piece):
            merged.append(piece)
        else:
            merged[-1].extend(piece)
    return merged


def _part(kind: str, chunk: int, entries: list, messages: dict, copied: set) -> Part:
    receives, sends, steps = [], [], []
    for e in entries:
        for slot, side, message in messages.get(id(e), ()):
            if side == "send":
                steps.append(Give(slot, len(sends), (id(e), slot) in copied))
                sends.append((slot, message))
            else:
                steps.append(Take(slot, len(receives)))
                receives.append((slot, message))
        if id(e) not in messages:
            steps.append(e)
    return Part(kind, chunk, steps, receives, sends)


def _written_after_send(entries: list, messages: dict, n_slots: int) -> set:
    """(entry id, slot) of the sends whose tensor a later entry writes into."""
    groups = _Groups(n_slots)
    effects = [_effects(e) if id(e) not in messages else ([], [], []) for e in entries]
    for _, _, aliases in effects:
        for a, b in aliases:
            groups.union(a, b)
    written_later: set = set()
    found = set()
    for e, (_, writes, _) in zip(reversed(entries), reversed(effects)):
        for slot, side, _ in messages.get(id(e), ()):
            if side == "send" and groups.find(slot) in written_later:
                found.add((id(e), slot))
        written_later |= {groups.find(w) for w in writes}
    return found


# -- data flow (zero bubble) ----------------------------------------------------------------
class _Groups:
    """Slots that share storage (a view and its base) are one group: a write to one is a write to all."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _effects(e) -> tuple[list, list, list]:
    """(slots read, slots written, (output slot, aliased argument slot) pairs) of a step."""
    if type(e) is Take:
        return [e.slot], [e.slot], []
    if type(e) is Give:
        return [e.slot], [], []
    reads = _slots((e.args, list(e.kwargs.values())))
    outs = [o.i for o in e.outs if o is not None]
    if e.wire:
        return reads, reads, []
    schema = e.fn._schema
    writes, aliases = [], []
    by_set: dict = {}
    values = list(e.args) + [e.kwargs.get(a.name) for a in schema.arguments[len(e.args):]]
    for arg, value in zip(schema.arguments, values):
        info = arg.alias_info
        if info is None:
            continue
        slots = _slots(value)
        if info.is_write:
            writes += slots
        for name in info.before_set:
            by_set.setdefault(name, []).extend(slots)
    for ret, out in zip(schema.returns, e.outs):
        if ret.alias_info is not None and out is not None:
            for name in ret.alias_info.before_set:
                aliases += [(out.i, s) for s in by_set.get(name, [])]
    return reads, writes + outs, aliases


def split_input_and_weight(steps: list, n_slots: int) -> tuple[list, list]:
    """A backward part's steps as (I, W): I is its messages and what its Gives (the input
    gradient sent back) need, W the rest (the weights' gradients); running I then W, each
    in program order, computes what running all in order does.

    >>> import torch
    >>> from autopar.static.program import Entry, Slot
    >>> mm, t = torch.ops.aten.mm.default, torch.ops.aten.t.default
    >>> # x = %0, w = %1, g = %2: dx = g @ w.t() is sent back, dw = x.t() @ g stays
    >>> steps = [Entry(t, None, (Slot(1),), {}, (Slot(3),), False),
    ...          Entry(t, None, (Slot(0),), {}, (Slot(5),), False),
    ...          Entry(mm, None, (Slot(5), Slot(2)), {}, (Slot(6),), False),
    ...          Entry(mm, None, (Slot(2), Slot(3)), {}, (Slot(4),), False), Give(4, 0, False)]
    >>> i, w = split_input_and_weight(steps, 7)
    >>> [str(getattr(x, "fn", x)) for x in i], [str(x.fn) for x in w]
    (['aten.t.default', 'aten.mm.default', 'Give(slot=4, n=0, copy=False)'], ['aten.t.default', 'aten.mm.default'])
    """
    groups = _Groups(n_slots)
    effects = [_effects(e) for e in steps]
    for _, _, aliases in effects:
        for a, b in aliases:
            groups.union(a, b)
    reads = [{groups.find(s) for s in r} for r, _, _ in effects]
    writes = [{groups.find(s) for s in w} for _, w, _ in effects]
    keep = [type(e) in (Give, Take) for e in steps]  # messages move with I (W runs later, on what I received)
    needed = set().union(*(reads[n] for n, k in enumerate(keep) if k))
    changed = True
    while changed:  # to a fixed point: writers of what I reads, earlier readers of what I overwrites
        changed = False
        for n in range(len(steps) - 1, -1, -1):
            if not keep[n] and writes[n] & needed:
                keep[n], changed = True, True
                needed |= reads[n]
        later_writes: set = set()
        for n in range(len(steps) - 1, -1, -1):
            if keep[n]:
                later_writes |= writes[n]
            elif reads[n] & later_writes:
                keep[n], changed = True, True
                needed |= reads[n]
    return [e for e, k in zip(steps, keep) if k], [e for e, k in zip(steps, keep) if not k]


# -- the pass -------------------------------------------------------------------------------
def split_stages(entries: list, backward: set, n_inputs: int, n_slots: int, outputs: list, meta: Sequence,
                 me: int, stage_ranks: frozenset, zero_bubble: bool) -> StagedProgram:
    """Cut a captured micro-batch step (its entries, `backward`: ids of the backward's
    entries, `meta`: (shape, dtype) per slot) into parts; see the module doc."""
    messages = _messages(entries, me, meta, stage_ranks)
    copied = _written_after_send(entries, messages, n_slots)
    forward = _segments([e for e in entries if id(e) not in backward], messages)
    backward_segments = _segments([e for e in entries if id(e) in backward], messages)
    chunks = len(forward)
    if len(backward_segments) != chunks:
        raise SplitError(
            f"rank {me}'s step runs {chunks} stage(s) forward but {len(backward_segments)} backward: its "
            f"cross-mesh transfers do not follow a pipeline (a tensor sent to a later stage than the next?)"
        )
    parts: dict = {}
    for c, segment in enumerate(forward):
        parts[("F", c)] = _part("F", c, segment, messages, copied)
    for n, segment in enumerate(backward_segments):
        c = chunks - 1 - n
        whole = _part("B", c, segment, messages, copied)
        if not zero_bubble:
            parts[("B", c)] = whole
            continue
        first, rest = split_input_and_weight(whole.entries, n_slots)
        parts[("I", c)] = Part("I", c, first, whole.receives, whole.sends)
        parts[("W", c)] = Part("W", c, rest, [], [])
    final = _final_parts(parts, outputs, n_slots)
    for part in parts.values():
        part.touched = {s for e in part.entries for s in _effects(e)[0] + _effects(e)[1]}
        part.run = _compile(part)
    return StagedProgram(parts, chunks, n_inputs, n_slots, outputs, final)


def _final_parts(parts: dict, outputs: list, n_slots: int) -> list:
    """Per output slot: the part whose run leaves it final (the last that writes its storage)."""
    groups = _Groups(n_slots)
    last: dict = {}
    order = [key for key in parts if key[0] == "F"] + [key for key in parts if key[0] != "F"]
    for key in order:
        for e in parts[key].entries:
            _, writes, aliases = _effects(e)
            for a, b in aliases:
                groups.union(a, b)
            for s in writes:
                last[groups.find(s)] = key
    return [last.get(groups.find(o.i)) if type(o) is Slot else None for o in outputs]


def _compile(part: Part):
    """The part as one straight-line function `run(e, r)` over the micro-batch's slot list `e`
    and the received tensors `r`, returning the tensors it sends."""
    gen = Codegen(lambda i: f"e[{i}]")
    lines = ["def run(e, r, c):", "    out = []"]
    for step in part.entries:
        if type(step) is Take:
            lines.append(f"    e[{step.slot}].copy_(r[{step.n}])")
        elif type(step) is Give:
            lines.append(f"    out.append(e[{step.slot}]{'.clone()' if step.copy else ''})")
        else:
            lines.append(gen.line(step))
    lines.append("    return out")
    return gen.function(lines, f"<autopar pipeline part {part.kind}{part.chunk}>")


__all__ = ["Give", "Message", "Part", "SplitError", "StagedProgram", "Take", "split_input_and_weight", "split_stages"]
