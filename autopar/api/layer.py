"""shard_layer: turn a Module's parameters into distributed tensors and hook its I/O."""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, Optional

import torch

from ..runtime import local_region
from ..checkpoint import pretrained
from ..tensor.dtensor import DistTensor
from ..mesh import ProcessMesh
from ..placement import Replicate
from ..tensor.convert import GradToPlacement
from .tensors import shard_tensor


def replicate_params(module: torch.nn.Module, mesh: ProcessMesh) -> None:
    """Make every still-plain parameter and buffer of `module` (not its children) Replicate on `mesh`."""
    for name, p in list(module._parameters.items()):
        if p is not None and not isinstance(p, DistTensor):
            module._parameters[name] = shard_tensor(p, mesh, [Replicate()] * mesh.ndim)
    for name, b in list(module._buffers.items()):
        if b is not None and not isinstance(b, DistTensor):
            module._buffers[name] = shard_tensor(b, mesh, [Replicate()] * mesh.ndim)


def convert_in_place(old: torch.Tensor, new: torch.Tensor, name: str) -> None:
    """Give the Parameter `old` the contents of `new` (class, data, attributes) and keep the
    Python object: the model, an optimizer built before the model was converted, and any
    reference a user holds all see the distributed parameter (`torch.utils.swap_tensors`)."""
    try:
        torch.utils.swap_tensors(old, new)
    except RuntimeError as err:
        raise RuntimeError(
            f"cannot convert parameter '{name}' (shape {list(old.shape)}) in place: {err}. Convert the model "
            f"before running it: a live autograd graph (or a weak reference) holds the parameter"
        ) from err
    # the swap moves the gradient hooks with the tensor but leaves each object its hook dicts:
    # install the Parameter's own hooks (a user's, registered before) on it again
    old._backward_hooks = old._backward_hooks
    old._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    hooks = old._backward_hooks or {}
    if isinstance(old, DistTensor) and old.requires_grad and not any(type(h) is GradToPlacement for h in hooks.values()):
        old.register_hook(GradToPlacement(old))  # (the one `new` had is bound to the object it left)


@contextlib.contextmanager
def weak_refs_released(model: torch.nn.Module) -> Iterator[None]:
    """nn.RNN, LSTM and GRU keep weak references to their parameters (for cuDNN's flat
    weights) and `swap_tensors` refuses a tensor that has any: drop them while the parameters
    are converted, then point them at the same (now distributed) Parameter objects again."""
    rnns = [m for m in model.modules() if isinstance(m, torch.nn.RNNBase)]
    for m in rnns:
        m._flat_weight_refs = []
    try:
        yield
    finally:
        for m in rnns:
            m._flat_weight_refs = [weakref.ref(w) if w is not None else None for w in m._flat_weights]


_MODELS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def register_model(model: torch.nn.Module) -> None:
    """Note a model converted by `shard_layer` or `parallelize`: ZeRO-3 finds in it the layers
    that hold the parameters it shards; an HF model's save_pretrained writes the full weights."""
    _MODELS.add(model)
    pretrained.install(model)


def models() -> list:
    """The converted models that are still alive."""
    return list(_MODELS)


def shard_layer(
    layer: torch.nn.Module,
    process_mesh: ProcessMesh,
    shard_fn: Optional[Callable] = None,
    input_fn: Optional[Callable] = None,
    output_fn: Optional[Callable] = None,
) -> torch.nn.Module:
    """Convert `layer`'s parameters to distributed tensors on `process_mesh`, in place.

    `shard_fn(name, sublayer, mesh)` is called for every sublayer (the root has name "")
    and may replace its parameters with `shard_tensor(...)`; whatever it leaves plain is
    replicated.  `input_fn(inputs, mesh)` / `output_fn(outputs, mesh)` run before / after
    `layer.forward` and may reshard or mark what goes in and out.  A sublayer whose forward
    turns out not to communicate runs as plain PyTorch on the local pieces (`local_region`).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["x"])
    >>> def col(name, sub, mesh):
    ...     if isinstance(sub, torch.nn.Linear):
    ...         sub.weight = dist.shard_tensor(sub.weight, mesh, [dist.Shard(0)])
    >>> model = dist.shard_layer(torch.nn.Linear(4, 6), mesh, col)
    >>> model.weight.placements, model.bias.placements
    ([Shard(0)], [Replicate()])
    """
    if not isinstance(layer, torch.nn.Module):
        raise TypeError(f"shard_layer needs a torch.nn.Module, got {type(layer).__name__}")
    if not isinstance(process_mesh, ProcessMesh):
        raise TypeError(f"shard_layer needs a ProcessMesh, got {type(process_mesh).__name__}")
    before = [(f"{mod}.{name}".lstrip("."), sub, name, p) for mod, sub in layer.named_modules()
              for name, p in sub._parameters.items() if p is not None]
    for name, sub in layer.named_modules():
        if shard_fn is not None:
            shard_fn(name, sub, process_mesh)
        replicate_params(sub, process_mesh)
    converted: dict = {}  # id(new Parameter) -> the original object now holding it (tied weights)
    with weak_refs_released(layer):
        for qualname, sub, name, p in before:
            new = sub._parameters.get(name)
            if new is None or new is p:
                continue
            if id(new) not in converted:
                convert_in_place(p, new, qualname)
                converted[id(new)] = (p, new)  # (new kept alive: its id stays unique)
            sub._parameters[name] = converted[id(new)][0]
    register_model(layer)
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda _m, inputs: input_fn(inputs, process_mesh))
    if output_fn is not None:
        layer.register_forward_hook(lambda _m, _inputs, outputs: output_fn(outputs, process_mesh))
    local_region.install(layer)
    return layer
