"""Step an elementwise optimizer on the local pieces, without the distributed op dispatch.

Adam, AdamW, SGD, RMSprop and the like update every element from the same element of the
parameter, its gradient and its states.  When a group's gradients and states are placed
exactly like their parameters (which `shard_optimizer` arranges before every step), the step
on the local pieces *is* the step on the global tensors, so the torch optimizer can run on
plain tensors, as fast as on one device, instead of sending every foreach op through the
dispatch (a decision lookup and a wrapper per op and group).  Under ZeRO-1/2 the piece a
parameter is stepped at is this rank's shard of it (a view into its local piece), with its
gradient and states placed like that shard; under a mixed-precision policy it is the
float32 master copy of that piece (`ZeroParam.step_piece`), its gradient cast up.  `swap`
puts the local pieces into the optimizer for one step; `restore` puts the parameters back
and wraps the states the step created as distributed tensors placed like the pieces.  The
local step runs with the group's own `foreach` choice (`shard_optimizer` turns foreach on
only for steps through the dispatch), so torch picks its implementation from the local
tensors as on one device: its for-loop on CPU is faster than foreach for large tensors,
foreach on GPUs.  A group that does not qualify (a Partial gradient left, a state placed
differently, an optimizer that reduces over a tensor) steps through the dispatch as before.
After a group's first local step its pieces and states move into flat buffers, and later
steps run on chunks of them (`flat_step.py`) while the group holds as flattened.
"""
from __future__ import annotations

import torch

from ...tensor.dtensor import DistTensor, local_piece
from ...spec import DistSpec
from .flat_step import FlatGroup, same_values

ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
    torch.optim.Rprop,
)


def _placed_like(t, spec: DistSpec) -> bool:
    return type(t) is DistTensor and t._spec.same_pieces(spec)


def _stand_in(p, piece, grad, state: dict):
    """What the step on local pieces uses for `p` stepped at `piece` (spec, local tensor; None
    for a plain parameter): the local tensor (p itself when plain), or None when the piece,
    the gradient and the tensor states are not distributed alike."""
    if piece is None:
        plain = type(grad) is not DistTensor and not any(type(v) is DistTensor for v in state.values())
        return p if plain else None
    spec, local = piece
    if not spec.same_pieces(spec.without_partial()) or (grad is not None and not _placed_like(grad, spec)):
        return None
    for v in state.values():
        if type(v) is DistTensor:
            if not _placed_like(v, spec):
                return None
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            return None
    return local


_NO_STATE: dict = {}


class _Pair:
    """A parameter's distributed states and the local stand-in dict the step updates: kept
    from step to step while the step updates the states in place (every step after the
    first), so a swap neither re-checks their placements nor rebuilds the dict."""

    __slots__ = ("piece", "state", "values", "local", "local_values")

    def __init__(self, piece: tuple, state: dict, local: dict):
        self.piece, self.state, self.values = piece, state, tuple(state.values())
        self.local, self.local_values = local, tuple(local.values())

    def holds(self, piece: tuple, state: dict) -> bool:
        return (
            self.state is state and self.piece[0] is piece[0] and self.piece[1] is piece[1]
            and same_values(state, self.values)
        )


class LocalStep:
    """Swaps an optimizer's distributed parameters for their local pieces around a step; each
    parameter's `ZeroParam` says where it is stepped (`piece()`: (spec, local tensor), None for
    a plain one) and keeps its `_Pair` from the last step that updated its states in place."""

    def __init__(self, optimizer: torch.optim.Optimizer, dispatch_foreach: tuple = ()):
        self.optimizer = optimizer
        self.dispatch_foreach = dispatch_foreach  # groups whose foreach is on for dispatched steps only
        # (group, its params, their ZeroParams, pieces, stand-ins, _Pair or states before the step, foreach forced);
        # a flat step's: (group, its params, their ZeroParams, None, chunks, its FlatGroup, foreach forced)
        self.swapped: list = []
        self.flat: dict = {}  # id(param group) -> its FlatGroup
        self.tried: set = set()  # groups flattened once already (or found not to qualify)
        self.ours: set = set()  # the storages of the flat parameter buffers (their views may move again)

    def forget(self) -> None:
        """States were replaced (a state dict loaded): flatten the groups again after their next step."""
        self.flat, self.tried = {}, set()

    def _swap_flat(self, group: dict, zero_params: list) -> bool:
        """Step `group` on its flat chunks, when it holds as flattened."""
        flat = self.flat.get(id(group))
        if flat is None:
            return False
        chunks = flat.stand_ins(zero_params, self.optimizer.state)
        if chunks is None:
            del self.flat[id(group)]
            return False
        for chunk, st in zip(chunks, flat.chunk_states):
            self.optimizer.state[chunk] = st
        self._put(group, zero_params, None, chunks, flat)
        return True

    def _put(self, group: dict, zero_params: list, pieces, stand_ins: list, states) -> None:
        """The group's parameters replaced by `stand_ins` for the step (foreach as the user left it)."""
        params = group["params"]
        group["params"] = stand_ins
        forced = any(g is group for g in self.dispatch_foreach)
        if forced:
            group["foreach"] = None
        self.swapped.append((group, params, zero_params, pieces, stand_ins, states, forced))

    def swap(self, groups: list) -> None:
        """Step the local pieces of `groups`, (param group, its ZeroParams) pairs, where they
        qualify (after `restore` of any swap a step that raised left behind)."""
        if not isinstance(self.optimizer, ELEMENTWISE):
            return
        state = self.optimizer.state
        for group, zero_params in groups:
            if self._swap_flat(group, zero_params):
                continue
            pairs = [zp.pair for zp in zero_params]  # (a pair holds for one step: restore keeps it)
            for zp in zero_params:
                zp.pair = None
            pieces, stand_ins, states = [], [], []
            for zp, pair in zip(zero_params, pairs):
                p = zp.param
                grad, st, piece = p.grad, state.get(p, _NO_STATE), zp.step_piece()
                if pair is not None and piece is not None and pair.holds(piece, st):
                    local = piece[1] if grad is None or _placed_like(grad, piece[0]) else None
                    st = pair
                else:
                    local = _stand_in(p, piece, grad, st)
                if local is None:
                    break
                pieces.append(piece)
                stand_ins.append(local)
                states.append(st)
            else:
                for zp, local, st in zip(zero_params, stand_ins, states):
                    p = zp.param
                    if local is p:
                        continue
                    local.grad = None if p.grad is None else p.grad._local.to(local.dtype)  # (a master's: float32)
                    if type(st) is _Pair:
                        state[local] = st.local
                    elif st is not _NO_STATE:
                        state[local] = {k: local_piece(v) for k, v in st.items()}
                self._put(group, zero_params, pieces, stand_ins, states)

    def restore(self, stepped: bool = True) -> None:
        """Put the parameters back after the step (`stepped`: it ran; else it raised or never
        ran, and a flat group, whose chunks' step counts are then unknown, steps per parameter
        from now on)."""
        state = self.optimizer.state
        for group, params, zero_params, pieces, stand_ins, states, forced in self.swapped:
            group["params"] = params
            if forced:
                group["foreach"] = True
            if pieces is None:  # a flat step
                for chunk in stand_ins:
                    state.pop(chunk, None)
                if stepped:
                    states.after_step()
                else:
                    self.flat.pop(id(group), None)
                continue
            for zp, piece, local, old in zip(zero_params, pieces, stand_ins, states):
                p = zp.param
                if local is p:
                    continue
                local.grad = None
                new = state.pop(local, None)
                if new is None:
                    continue
                if type(old) is _Pair:
                    if new is old.local and same_values(new, old.local_values):
                        zp.pair = old
                        continue
                    old = old.state
                if _updated_in_place(old, new):
                    zp.pair = _Pair(piece, old, new)
                else:
                    state[p] = {k: _as_state(v, piece, old.get(k)) for k, v in new.items()}
            if stepped and id(group) not in self.tried:
                self.tried.add(id(group))
                flat = FlatGroup.build(zero_params, state, self.ours)
                if flat is not None:
                    self.flat[id(group)] = flat
                    self.ours.add(flat.buffer.untyped_storage().data_ptr())
        self.swapped = []


def _updated_in_place(old: dict, new: dict) -> bool:
    """The step wrote only into the states it was given (every step after the first)."""
    return len(old) == len(new) and all(
        v is new.get(k) or (type(v) is DistTensor and v._local is new.get(k)) for k, v in old.items()
    )


def _as_state(value, piece: tuple, old):
    """A state the local step wrote: the existing distributed state when it updated that one
    in place, a new one placed like the piece when it made a tensor of the piece's shape."""
    if type(old) is DistTensor and old._local is value:
        return old
    spec, local = piece
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        meta = spec.meta
        if value.dtype != meta.dtype:
            meta = type(meta).contiguous(meta.shape, value.dtype)
        return DistTensor(value, DistSpec(spec.mesh, spec.placements, meta))
    return value
