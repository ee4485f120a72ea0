"""An elementwise optimizer's step on flat buffers: each op once per chunk, not once per parameter.

The local step (`local_step.py`) runs the torch optimizer on the local pieces: one kernel
call per op and parameter, a few microseconds of host time each, hundreds per step for a
model of many small tensors (DDP's optimizer pays the same).  An elementwise update reads
only the same elements of the gradient and states and a few scalars, so it may as well run
on flat buffers holding a whole group (Megatron's contiguous-buffer optimizer).  After a
group's first step, once its states exist, the local pieces of its parameters and their
tensor states move into flat buffers, each piece a view of its buffer: the same DistTensor
objects and state dicts, so the model, a state dict, a checkpoint and a captured program
read them as before.  Each later step hands the optimizer chunks of the buffers as its
parameters, with the matching chunks of the gradients and one step count per chunk, written
back to every parameter's after the step.  The same kernels on the same elements with the
same scalars: the numbers are the per-parameter step's, bit for bit.

The buffers are laid out as the gradient buckets are (last parameter first,
`grad_reduce.py`): the gradients lie in the buckets' buffers in this order, and each chunk
takes its gradient as a view of the buffer holding it, nothing copied (DDP's
`gradient_as_bucket_view`, seen from the step); a chunk across two buckets' buffers, or
gradients lying elsewhere, are copied for that chunk only.  On the CPU a chunk holds at most CPU_CHUNK elements, so that the step's
temporaries (one chunk's size each) stay in the cache.  Measured in one process (AdamW, one
thread): the tiny GPT of BENCHMARKS 4 (37 parameters, 0.1 M elements) steps in 0.74 ms
against torch's 1.22 per parameter; the 3.7 M GPT (69 parameters), bound by memory, in 15.4
against 14.0 (at `179657f`, its gradients from two buckets then gathered into one buffer,
1.5 ms of it).

A group qualifies when every parameter is distributed and stepped whole from a contiguous
local piece of its own (no ZeRO-1/2 shard, no float32 master, no piece aliasing another
tensor), all of one dtype and device and not all empty (a rank outside the mesh), and its
states are tensors: placed like the piece, or scalars equal across the group (the step
count).  A step on which that no longer holds (a parameter without a gradient, a piece or
state replaced) runs per parameter.
"""
from __future__ import annotations

from operator import attrgetter, is_
from typing import Optional

import torch

from ...tensor.dtensor import DistTensor
from ...tensor.grad_landing import follows

CPU_CHUNK = 1 << 16
_GRAD, _LOCAL, _SPEC, _DTYPE = (attrgetter(a) for a in ("grad", "_local", "_spec", "dtype"))
_ONLY_DIST = frozenset({DistTensor})


def same_values(d: dict, values: tuple) -> bool:
    """`d` still holds exactly these objects."""
    return len(d) == len(values) and all(map(is_, d.values(), values))


def _owns_storage(t: torch.Tensor) -> bool:
    """`t` is the whole of its storage: moving it elsewhere leaves no alias behind."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class FlatGroup:
    """One param group's parameters and tensor states in flat buffers (see the module doc).
    `zero_params`: the group's ZeroParams list it was built for; members are in layout order."""

    def __init__(self, zero_params: list, members: list, states: list, tensor_keys: tuple, scalar_keys: tuple,
                 buffer: torch.Tensor, state_buffers: dict):
        self.zero_params, self.members, self.states = zero_params, members, states
        self.values = [tuple(st.values()) for st in states]
        self.tensor_keys, self.scalar_keys = tensor_keys, scalar_keys
        self.buffer = buffer
        self.sizes = [zp.param._local.numel() for zp in members]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(members))]
        self.params = [zp.param for zp in members]
        self.pieces = [p._local for p in self.params]
        self.dtypes = frozenset({buffer.dtype})
        self.state_tensors = [st[k] for st in states for k in tensor_keys]  # (tensor states, member by member)
        self.state_pieces = [t._local for t in self.state_tensors]
        numel = buffer.numel()
        limit = CPU_CHUNK if buffer.device.type == "cpu" else numel
        self.bounds = [(a, min(a + limit, numel)) for a in range(0, numel, limit)]
        self.chunks = [buffer[a:b] for a, b in self.bounds]
        first = states[0]
        self.chunk_states = [
            {k: (state_buffers[k][a:b] if k in tensor_keys else first[k].clone()) for k in first}
            for a, b in self.bounds
        ]
        self.scalars = {k: [st[k] for st in states] for k in scalar_keys}
        self.versions = self._versions()

    @staticmethod
    def build(zero_params: list, state: dict, ours: set) -> Optional["FlatGroup"]:
        """The group flattened, or None when it does not qualify; `ours`: the storages
        (data pointers) of earlier flat buffers, whose views may move again."""
        members = list(reversed(zero_params))  # the gradient buckets' order
        if len(members) < 2:
            return None
        pieces = []
        for zp in members:
            p = zp.param
            if zp.master is not None or zp.steps_a_shard or type(p) is not DistTensor or not p._local.is_contiguous():
                return None
            pieces.append(p._local)
        dtype, device = pieces[0].dtype, pieces[0].device
        if (
            not sum(t.numel() for t in pieces)
            or any(t.dtype != dtype or t.device != device for t in pieces)
            or not all(_owns_storage(t) or t.untyped_storage().data_ptr() in ours for t in pieces)
        ):
            return None
        states = [state.get(zp.param) for zp in members]
        if any(not st or list(st) != list(states[0]) for st in states):
            return None
        tensor_keys, scalar_keys = [], []
        for k in states[0]:
            values = [st[k] for st in states]
            if all(type(v) is DistTensor and v._spec.same_pieces(zp.param._spec) and v._local.is_contiguous()
                   and v._local.shape == t.shape and v.dtype == values[0].dtype
                   for v, zp, t in zip(values, members, pieces)):
                tensor_keys.append(k)
            elif all(type(v) is torch.Tensor and v.dim() == 0 for v in values) and bool(
                torch.stack(values).eq(values[0]).all()
            ):
                scalar_keys.append(k)
            else:
                return None
        with torch.no_grad():
            buffer = _gather(pieces)
            state_buffers = {k: _gather([st[k]._local for st in states]) for k in tensor_keys}
            for zp, view in zip(members, _views(buffer, pieces)):
                zp.param._local = view
                zp.pair = None  # (the local step's pair held the old piece)
            for k in tensor_keys:
                for st, view in zip(states, _views(state_buffers[k], pieces)):
                    st[k]._local = view
        return FlatGroup(zero_params, members, states, tuple(tensor_keys), tuple(scalar_keys), buffer, state_buffers)

    def _versions(self) -> tuple:
        return tuple(t._version for k in self.scalar_keys for t in self.scalars[k])

    def stand_ins(self, zero_params: list, state: dict) -> Optional[list]:
        """The chunks to step this time, their gradients set, or None when the group no longer
        holds as flattened (then it steps per parameter).  Every member is checked each step,
        in C-level passes over the group (`map`), not a Python loop per parameter."""
        if zero_params is not self.zero_params or self._versions() != self.versions:
            return None
        params = self.params
        grads = list(map(_GRAD, params))
        if not (
            all(map(is_, map(_LOCAL, params), self.pieces))
            and all(map(is_, map(state.get, params), self.states))
            and all(map(same_values, self.states, self.values))
            and all(map(is_, map(_LOCAL, self.state_tensors), self.state_pieces))
            and set(map(type, grads)) == _ONLY_DIST
        ):
            return None
        locals_ = list(map(_LOCAL, grads))
        if set(map(_DTYPE, locals_)) != self.dtypes or not (
            all(map(is_, map(_SPEC, grads), map(_SPEC, params)))
            or all(g._spec.same_pieces(p._spec) for g, p in zip(grads, params))
        ):
            return None
        runs = _runs(locals_, self.offsets)
        for chunk, bounds in zip(self.chunks, self.bounds):
            chunk.grad = _within(runs, *bounds)
        return self.chunks

    def after_step(self) -> None:
        """The chunks' gradients dropped; their scalar states (the step count, the same in
        every chunk) written back to every parameter's."""
        for chunk in self.chunks:
            chunk.grad = None
        with torch.no_grad():
            for k in self.scalar_keys:
                members = self.scalars[k]
                torch._foreach_copy_(members, [self.chunk_states[0][k]] * len(members))
        self.versions = self._versions()


def _runs(grads: list, offsets: list) -> list:
    """The gradients as runs lying one after another in memory, in the layout's order (a
    reduction bucket's buffer holds one run): (layout start, layout end, the run as one flat
    tensor; a gradient that is not contiguous is a run of its own, flattened)."""
    runs, start = [], 0
    for i in range(1, len(grads) + 1):
        prev = grads[i - 1]
        if i < len(grads) and follows(prev, grads[i]):
            continue
        first, end = grads[start], offsets[i - 1] + prev.numel()
        if i - start == 1:
            flat = first.reshape(-1)
        else:
            flat = first.as_strided((end - offsets[start],), (1,), first.storage_offset())
        runs.append((offsets[start], end, flat))
        start = i
    return runs


def _within(runs: list, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of the layout: a view of the run holding them all, else copied from the
    runs they straddle (a chunk across two buckets' buffers)."""
    pieces = []
    for start, end, flat in runs:
        if end <= a or start >= b:
            continue
        if start <= a and b <= end:
            return flat[a - start:b - start]
        pieces.append(flat[max(a, start) - start:min(b, end) - start])
    return torch.cat(pieces)


def _gather(pieces: list) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in pieces])


def _views(buffer: torch.Tensor, pieces: list) -> list:
    """Views of `buffer`, one per piece in order, shaped like it."""
    out, start = [], 0
    for t in pieces:
        n = t.numel()
        out.append(buffer[start:start + n].view(t.shape))
        start += n
    return out
