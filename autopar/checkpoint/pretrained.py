"""HuggingFace `save_pretrained` on a converted model: the full weights, written once.

HF's `save_pretrained` reads `model.state_dict()` and hands its tensors to safetensors,
which reads their storage; a DistTensor has no storage of its own (it stands for a global
tensor, this rank holds a piece), so the write fails.  A converted model that has HF's
`save_pretrained(save_directory, ..., state_dict=None, is_main_process=True)` gets an
instance method in its place that gathers the full state dict on every rank (collective
over the job, like every value read), lets rank 0 write it through HF's own code and
returns on every rank once the files are complete (or raises rank 0's error everywhere).
"""
from __future__ import annotations

import inspect
import types

import torch

from ..tensor.convert import full_value
from ..tensor.dtensor import DistTensor
from . import sync
from .errors import CheckpointError, Problems


def full_state_dict(model: torch.nn.Module) -> dict:
    """`model.state_dict()` with every DistTensor replaced by its dense global value
    (collective over the job).  Tied parameters stay one tensor, so HF still finds them tied."""
    return _dense(model.state_dict(keep_vars=True))


def _dense(state_dict: dict) -> dict:
    """`state_dict` with DistTensors gathered (each object once) and tensors detached."""
    dense: dict[int, object] = {}
    out = {}
    for name, value in state_dict.items():
        if id(value) not in dense:
            if isinstance(value, DistTensor):
                dense[id(value)] = full_value(value.detach())
            else:
                dense[id(value)] = value.detach() if isinstance(value, torch.Tensor) else value
        out[name] = dense[id(value)]
    return out


def save_pretrained(model, save_directory, *args, state_dict=None, is_main_process=None, **kwargs):
    """HF's save_pretrained of the full weights (of `state_dict` if given, as HF's Trainer
    gives it, gathered too): call it on every rank."""
    state_dict = full_state_dict(model) if state_dict is None else _dense(state_dict)
    rank, _ = sync.world()
    problems, error = Problems(), None
    try:
        type(model).save_pretrained(model, save_directory, *args, state_dict=state_dict,
                                    is_main_process=rank == 0 if is_main_process is None else is_main_process,
                                    **kwargs)
    except Exception as e:  # agreed on below: every rank raises it, none waits for rank 0
        problems.add(f"{type(e).__name__}: {e}")
        error = e
    try:
        sync.agree(problems, f"save_pretrained({str(save_directory)!r})", "the directory may be incomplete")
    except CheckpointError as agreed:
        raise agreed from error


def install(model: torch.nn.Module) -> None:
    """Give `model` the collective save_pretrained if its class has HF's (by signature)."""
    method = getattr(type(model), "save_pretrained", None)
    if method is None or not {"state_dict", "is_main_process"} <= set(inspect.signature(method).parameters):
        return
    model.save_pretrained = types.MethodType(save_pretrained, model)
