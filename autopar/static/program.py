"""Capture a step as a flat program of local ops and transfers; replay it without dispatch.

While a `Recorder` is active, every aten op that runs on plain (local) tensors is recorded:
the local ops that `dispatch` runs for a distributed op, the copies and buffers of a
reshard, the autograd engine's backward ops, the random draws.  Each transfer in `comm`
is recorded whole (a `Wire`: post, wait, log).  Ops on distributed tensors themselves are
not recorded: they pass to `DistTensor.__torch_dispatch__` with the recorder still active,
so what they do locally is.  The result is a `Program`: entries over numbered slots, the
step's inputs first.

Replaying runs the entries in order on fresh inputs: the same local ops on the same
shapes, the same transfers in the same order, so every rank computes the same numbers as
the eager step, without the wrapper tensors, the decision lookups or the autograd graph.
Random ops draw again.  Tensors the step reads but did not compute and that are not
inputs (a module's constant) are kept by reference.  What cannot be captured raises
`CaptureError`: a step that reads the value of a tensor that depends on its inputs or on a
random draw into Python (`.item()`, `if t > 0`), or a collective outside autopar's comm
layer.  A value computed in the step from shapes and constants alone (HF's check of its
position ids, made by `arange`, for packed sequences) is the same on every replay of the
program's input signature: it is read at capture and its Python branch is kept.
"""
from __future__ import annotations

import contextlib
import difflib
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.observers import capturing
from ..tensor.dispatch import VALUE_READ_OPS, written_tensors
from ..tensor.dtensor import DistTensor
from ..tensor.op_call import fast_op

aten = torch.ops.aten


class CaptureError(RuntimeError):
    """The step does something a captured program cannot replay."""


class Slot:
    """A program value: input i, or the output of an entry."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"%{self.i}"


class Entry:
    """One recorded op (an OpOverload) or transfer (a Wire) with its arguments over slots."""

    __slots__ = ("fn", "call", "args", "kwargs", "outs", "frees", "wire", "seq")

    def __init__(self, fn, call, args: tuple, kwargs: dict, outs: tuple, wire: bool, seq: bool = False):
        self.fn, self.call, self.args, self.kwargs = fn, call, args, kwargs
        self.outs, self.wire, self.seq = outs, wire, seq
        self.frees: tuple = ()

    def __str__(self) -> str:
        args = ", ".join(_show(a) for a in self.args)
        if self.kwargs:
            args += ", " + ", ".join(f"{k}={_show(v)}" for k, v in self.kwargs.items())
        if self.wire:
            w = self.fn
            sent = sum(log[2] for log in w.logs)
            return f"{w.half}{w.op}({args}) ranks={list(w.ranks)}" + (f" sent={sent} B" if w.logs else "")
        outs = ", ".join(repr(o) if o is not None else "_" for o in self.outs)
        return f"{outs or '_'} = {self.fn}({args})"


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, torch.Tensor):
        return f"const{tuple(v.shape)}"
    return repr(v)


class Codegen:
    """Python source for recorded entries: `slot(i)` spells slot i's variable, every other
    value becomes a constant `c[n]`; `function` compiles the lines of `def f(..., c)`."""

    def __init__(self, slot: Callable[[int], str]):
        self.slot, self.consts = slot, []

    def ref(self, v) -> str:
        self.consts.append(v)
        return f"c[{len(self.consts) - 1}]"

    def expr(self, v) -> str:
        if type(v) is Slot:
            return self.slot(v.i)
        if type(v) is list:
            return "[" + ", ".join(self.expr(x) for x in v) + "]"
        if type(v) is tuple:
            return "(" + "".join(self.expr(x) + ", " for x in v) + ")"
        return self.ref(v)

    def line(self, e: Entry) -> str:
        """`e` as one statement: its call, its outputs assigned."""
        args = ", ".join([self.expr(a) for a in e.args] + [f"{k}={self.expr(v)}" for k, v in e.kwargs.items()])
        call = f"{self.ref(e.call)}({args})"
        if e.wire or not any(o is not None for o in e.outs):
            return f"    {call}"
        targets = [self.slot(o.i) if o is not None else "_" for o in e.outs]
        return f"    {''.join(t + ', ' for t in targets) if e.seq else targets[0]} = {call}"

    def function(self, lines: list, filename: str):
        """Compile `lines` (a `def` taking the constants last) into a function of the other arguments."""
        scope: dict = {}
        exec(compile("\n".join(lines), filename, "exec"), scope)
        fn, consts = next(v for k, v in scope.items() if k != "__builtins__"), self.consts
        return lambda *args: fn(*args, consts)


class Program:
    """A replayable step: `run(inputs)` returns the values of the `outputs` slots.

    The entries compile to one straight-line Python function (a local variable per slot,
    `del` after a value's last use), so a replayed op costs a call and nothing else.
    Pure aliases (`detach`: autograd's saved tensors) are folded into their source."""

    def __init__(self, entries: list[Entry], n_inputs: int, n_slots: int, outputs: Sequence[Any],
                 written: frozenset = frozenset()):
        self.n_inputs, self.n_slots = n_inputs, n_slots
        # the memory the step writes in place (`_storage`s): its own scratch, even where it is
        # held as a constant (a gradient buffer written through a view of it)
        self.written = written
        self.entries, self.outputs = _fold_aliases(entries, list(outputs))
        self._plan_frees()
        self._replay = self._compile()

    def _plan_frees(self) -> None:
        """Drop each computed value right after its last use (the eager step frees as it goes)."""
        keep = {o.i for o in self.outputs if type(o) is Slot}
        last: dict[int, int] = {}
        for n, e in enumerate(self.entries):
            for s in _slots_in((e.args, list(e.kwargs.values()))):
                last[s] = n
            for o in e.outs:
                if o is not None:
                    last.setdefault(o.i, n)
        frees: dict[int, list] = {}
        for s, n in last.items():
            if s >= self.n_inputs and s not in keep:
                frees.setdefault(n, []).append(s)
        for n, e in enumerate(self.entries):
            e.frees = tuple(sorted(frees.get(n, ())))

    def _compile(self):
        gen = Codegen(lambda i: f"s{i}")
        names = [f"s{i}" for i in range(self.n_inputs)]
        lines = ["def replay(inputs, c):", f"    {''.join(n + ', ' for n in names)}= inputs" if names else "    pass"]
        for e in self.entries:
            lines.append(gen.line(e))
            if e.frees:
                lines.append("    del " + ", ".join(f"s{i}" for i in e.frees))
        lines.append("    return [" + ", ".join(gen.expr(o) for o in self.outputs) + "]")
        return gen.function(lines, "<autopar static program>")

    def run(self, inputs: Sequence[torch.Tensor]) -> list:
        # (the ops are called through torch's Python bindings: a user's torch-function mode must not see them)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return self._replay(list(inputs))

    def __str__(self) -> str:
        halves = [e.fn for e in self.entries if e.wire]
        wires = self.wires()
        kinds: dict = {}
        for w in wires:
            kinds[w.op] = kinds.get(w.op, 0) + 1
        sent = sum(log[2] for w in halves for log in w.logs)
        head = (f"{len(self.entries) - len(halves)} local ops, {len(wires)} transfers "
                f"({', '.join(f'{k} x{n}' for k, n in kinds.items()) or 'none'}), {sent} B sent by this rank; "
                + (f"inputs %0..%{self.n_inputs - 1}" if self.n_inputs else "no inputs"))
        lines = [head] + [str(e) for e in self.entries]
        lines.append("outputs " + ", ".join(repr(o) if type(o) is Slot else "const" for o in self.outputs))
        return "\n".join(lines)

    def wires(self) -> list:
        """The transfers, in order (one that overlaps what follows by its post)."""
        return [e.fn for e in self.entries if e.wire and e.fn.half != "arrive "]


def moved_constants(first: Program, second: Program) -> list[str]:
    """What two captures of the same step read from outside their inputs with different
    values: a tensor constant (one made anew for each step, not updated in place), a Python
    number.  The captures are compared op by op where they ran the same ops (a first step
    may differ in the library's own work: the gradient buckets are laid out at its end)."""
    moved: list[str] = []

    def compare(a, b, op: str) -> None:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a is not b and _storage(a) not in first.written and _storage(b) not in second.written \
                    and not a.is_meta and not (
                    a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):  # (meta: no values)
                moved.append(f"{op} read a tensor {tuple(a.shape)} {a.dtype} that is not the one it read before, "
                             f"with other values")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            for x, y in zip(a, b):
                compare(x, y, op)
        elif isinstance(a, _NUMBER) and isinstance(b, _NUMBER) and a != b and a == a:
            moved.append(f"{op} read the Python number {a!r}, then {b!r}")

    ops = [_op_key(e) for e in first.entries], [_op_key(e) for e in second.entries]
    for i, j, n in difflib.SequenceMatcher(None, *ops, autojunk=False).get_matching_blocks():
        for e, f, op in zip(first.entries[i:i + n], second.entries[j:j + n], ops[0][i:i + n]):
            compare([*e.args, *e.kwargs.values()], [*f.args, *f.kwargs.values()], op)
    return moved


_NUMBER = (int, float, complex)


def _op_key(e: Entry) -> str:
    return f"{e.fn.half}{e.fn.op} over ranks {list(e.fn.ranks)}" if e.wire else str(e.fn)


_ALIASES = {aten.detach.default, aten.alias.default}


def _fold_aliases(entries: list[Entry], outputs: list):
    """Drop `detach`/`alias` entries: later uses read their source instead (without autograd
    an alias is its source: same storage, same sizes)."""
    source: dict[int, Any] = {}

    def sub(v):
        if type(v) is Slot:
            return source.get(v.i, v)
        if type(v) in (list, tuple):
            return type(v)(sub(x) for x in v)
        return v

    kept = []
    for e in entries:
        e.args, e.kwargs = sub(e.args), {k: sub(v) for k, v in e.kwargs.items()}
        if not e.wire and e.fn in _ALIASES and len(e.outs) == 1 and e.outs[0] is not None:
            source[e.outs[0].i] = e.args[0]
            continue
        kept.append(e)
    return kept, [sub(o) for o in outputs]


def _slots_in(v):
    if type(v) is Slot:
        yield v.i
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _slots_in(x)


def _storage(t: torch.Tensor):
    """The identity of `t`'s memory (views share it); None for a layout without storage."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class Recorder(TorchDispatchMode):
    """Active during an eager step: records the local program it runs (see the module doc)."""

    records_local_ops = True

    def __init__(self, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.entries: list[Entry] = []
        self.slot_of: dict[int, int] = {}
        self.alive: list = []  # every recorded tensor stays alive, so ids are never reused
        self.n_slots = 0
        self.in_wire = 0
        self.attached = None  # the capture's scope, while attached
        # storages the step computed from no input and no random draw: their values are the
        # same on every replay of the program's signature, so Python may read them
        self.fixed: set = set()
        self.written: set = set()  # storages an op or a transfer wrote in place
        for t in inputs:
            self._new_slot(t)
        self.n_inputs = self.n_slots

    def _new_slot(self, t: torch.Tensor) -> Slot:
        i = self.n_slots
        self.n_slots += 1
        self.slot_of[id(t)] = i
        self.alive.append(t)
        return Slot(i)

    def slot(self, t) -> Any:
        """The slot holding `t`, or `t` itself (a constant) when the step did not compute it."""
        i = self.slot_of.get(id(t))
        return Slot(i) if i is not None else t

    def _template(self, v):
        if isinstance(v, torch.Tensor):
            return self.slot(v)
        if isinstance(v, (list, tuple)):
            return type(v)(self._template(x) for x in v)
        return v

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_wire:  # the transfer's own ops: recorded whole by `wire`; they write received values
            out = func(*args, **kwargs)
            self._note_written(func, args, kwargs, out, fixed=False)
            return out
        if any(issubclass(t, DistTensor) for t in types):
            with self:  # its local work is what gets recorded
                return DistTensor.__torch_dispatch__(func, types, args, kwargs)
        if func.namespace == "c10d":
            raise CaptureError(f"to_static: {func} runs outside autopar's comm layer; it cannot be replayed")
        operands = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in VALUE_READ_OPS:
            if all(_storage(t) in self.fixed for t in operands):
                return func(*args, **kwargs)  # fixed by the signature: the Python reading it runs once
            self.value_read(str(func))
        t_args, t_kwargs = self._template(list(args)), {k: self._template(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        flat = out if isinstance(out, (list, tuple)) else (out,)
        if any(isinstance(o, torch.Tensor) and o.is_meta for o in flat):
            return out  # shape inference while planning a distributed op: not part of the step
        self._note_written(func, args, kwargs, flat, fixed=torch.Tag.nondeterministic_seeded not in func.tags
                           and all(_storage(t) in self.fixed for t in operands))
        outs = tuple(
            (Slot(self.slot_of[id(o)]) if id(o) in self.slot_of else self._new_slot(o))
            if isinstance(o, torch.Tensor) else None
            for o in flat
        )
        call = fast_op(func, args, kwargs)  # the C++ op by its quickest route
        self.entries.append(Entry(func, call, tuple(t_args), t_kwargs, outs, wire=False, seq=flat is out))
        return out

    def _note_written(self, func, args, kwargs, out, fixed: bool) -> None:
        """What the op wrote is fixed when it drew nothing random and read only fixed values."""
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        in_place = written_tensors(func, args, kwargs)
        self.written.update(_storage(t) for t in in_place)
        for t in [*outs, *in_place]:
            key = _storage(t)
            if fixed and key is not None:
                self.fixed.add(key)
            else:
                self.fixed.discard(key)

    def value_read(self, what: str) -> None:
        raise CaptureError(
            f"to_static: the step reads a tensor's value into Python ({what}); a captured step must not "
            f"depend on the values of its inputs or of random draws (no .item(), .tolist(), `if tensor:`) "
            f"between its first op and the loss"
        )

    # -- transfers (a comm.observers.TransferCapture, attached from the first entry to close())
    def enter_wire(self) -> None:
        self.in_wire += 1

    def exit_wire(self) -> None:
        self.in_wire -= 1

    def wire(self, wire, tensors) -> None:
        for t in tensors:  # a transfer's buffers hold what other ranks sent
            self.fixed.discard(_storage(t))
            self.written.add(_storage(t))
        if not self.in_wire:
            self.entries.append(Entry(wire, wire, tuple(self.slot(t) for t in tensors), {}, (), wire=True))

    def __enter__(self):
        if self.attached is None:  # re-entered for every distributed op
            self.attached = contextlib.ExitStack()
            self.attached.enter_context(capturing(self))
        return super().__enter__()

    def program(self, outputs: Sequence) -> Program:
        return Program(self.entries, self.n_inputs, self.n_slots, [self.slot(o) for o in outputs],
                       frozenset(self.written) - {None})

    def close(self) -> None:
        if self.attached is not None:
            self.attached.close()
            self.attached = None
