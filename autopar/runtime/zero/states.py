"""Optimizer states placed where their parameters are stepped.

A sharded optimizer places its states itself (`OptimizerSharding.place_states`, at its start
and after each `load_state_dict`).  A torch optimizer never given to `shard_optimizer` still
steps distributed parameters, op by op through the dispatch; a global step pre-hook places
its states like their parameters (at its first step and after each `load_state_dict`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...redistribute import piece_of_full
from ...spec import DistSpec, TensorMeta
from ...tensor.convert import reshard_to
from ...tensor.dtensor import DistTensor, new_dist, on_first_dist_tensor


def place_states(optimizer: torch.optim.Optimizer, step_specs: Iterable[tuple]) -> None:
    """Put every tensor state where its parameter is stepped, given (parameter, step spec or
    None for whole) pairs: states made for another placement (an optimizer that stepped
    before the model was converted; a checkpoint of a differently parallelized model,
    `opt.load_state_dict`) are resharded, plain ones cut."""
    for p, spec in step_specs:
        state = optimizer.state.get(p)
        if spec is None or not state:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == spec.shape:
                state[key] = placed(value, spec)


def placed(value: torch.Tensor, spec: DistSpec) -> DistTensor:
    """`value` (a distributed tensor, or a plain one holding the global value) placed like
    `spec`, in its own dtype."""
    target = DistSpec(spec.mesh, spec.placements, TensorMeta.contiguous(spec.shape, value.dtype))
    if type(value) is not DistTensor:
        return new_dist(piece_of_full(value.detach(), target), target)
    if value._spec.same_pieces(target):
        return value
    return reshard_to(value.detach(), DistSpec(target.mesh, target.placements, value._spec.meta))


def _own_placements(optimizer: torch.optim.Optimizer) -> Iterable[tuple]:
    return ((p, p._spec if type(p) is DistTensor else None) for group in optimizer.param_groups for p in group["params"])


def _place_states_of_plain_optimizers(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """A global step pre-hook: an optimizer over distributed parameters that was never given
    to shard_optimizer steps through the op dispatch, and its states must be placed like
    their parameters too (loaded from a differently parallelized model's checkpoint, they
    come on the saved mesh).  Done at its first step and after each `load_state_dict`; an
    optimizer with no distributed parameter at its first step is left alone from then on."""
    if getattr(optimizer, "_autopar_sharding", None) is not None or getattr(optimizer, "_autopar_placed", False):
        return
    optimizer._autopar_placed = True
    if any(type(p) is DistTensor for group in optimizer.param_groups for p in group["params"]):
        place_states(optimizer, _own_placements(optimizer))
        optimizer.register_load_state_dict_post_hook(_place_loaded_states)


def _place_loaded_states(optimizer: torch.optim.Optimizer) -> None:
    """(Given to shard_optimizer since, the optimizer places its states itself.)"""
    if getattr(optimizer, "_autopar_sharding", None) is None:
        place_states(optimizer, _own_placements(optimizer))


# (a global hook on torch's optimizers: set once distributed parameters can exist, not on import)
on_first_dist_tensor(lambda: register_optimizer_step_pre_hook(_place_states_of_plain_optimizers))
