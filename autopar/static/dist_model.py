"""to_static: the same annotated model, run as a captured program (the static mode).

The first call for a given input signature runs the step eagerly while recording the
local program it runs (`program.Recorder`); later calls replay that program on the new
batch, then run the optimizer step as usual.  The placements, the reshards and the
numbers are those of the dynamic mode by construction: the program *is* what the dynamic
mode did, minus the per-op decisions, wrappers and autograd bookkeeping.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..dtensor import DistTensor
from .program import CaptureError, Program, Recorder

_MODES = ("train", "eval", "predict")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local if type(t) is DistTensor else t


def _signature(t: torch.Tensor):
    if type(t) is DistTensor:
        return t._spec
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _autocast_state() -> tuple:
    """Autocast changes which casts a step runs: a program is captured per autocast setting."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


class _Captured:
    """A program and how to turn its outputs back into the step's results."""

    def __init__(self, program: Program, result_specs: list, grad_specs: list):
        self.program, self.result_specs, self.grad_specs = program, result_specs, grad_specs


def _wrap(local, spec):
    return DistTensor(local, spec) if spec is not None else local


class DistModel:
    """A model run as a captured program: `dist_model(*batch)` runs one step.

    In `train()` mode a step is forward, loss, backward and the optimizer step, and returns
    the loss; `eval()` returns the loss without training; `predict()` returns the model's
    outputs.  The batch is `(inputs..., label)` when there is a loss taking two arguments,
    else all inputs (a single list/tuple argument is unpacked).  Build one with `to_static`.

    A captured step must not branch on tensor values, and tensors it reads without
    computing them (other than parameters, buffers and the batch) are taken as constants.
    """

    def __init__(self, layer: torch.nn.Module, loader=None, loss: Optional[Callable] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None):
        self.layer, self.loader, self.loss_fn, self.optimizer = layer, loader, loss, optimizer
        self._programs: dict = {}
        self._last: Optional[Program] = None
        self._mode = "train" if loss is not None and optimizer is not None else ("eval" if loss is not None else "predict")

    # -- modes --------------------------------------------------------------------------
    def train(self) -> "DistModel":
        if self.loss_fn is None or self.optimizer is None:
            raise ValueError("DistModel.train() needs the loss and the optimizer given to to_static")
        self._mode = "train"
        self.layer.train()
        return self

    def eval(self) -> "DistModel":
        if self.loss_fn is None:
            raise ValueError("DistModel.eval() computes the loss: give to_static a loss")
        self._mode = "eval"
        self.layer.eval()
        return self

    def predict(self) -> "DistModel":
        self._mode = "predict"
        self.layer.eval()
        return self

    # -- one step -----------------------------------------------------------------------
    def __call__(self, *batch) -> Any:
        if len(batch) == 1 and isinstance(batch[0], (list, tuple)):
            batch = tuple(batch[0])
        params = list(self.layer.parameters())
        grad_holders = params + self._optimizer_only_params(params)
        inputs = params + list(self.layer.buffers()) + _leaves(batch)  # tensors nested in dicts/lists too
        key = (self._mode, self.layer.training, _autocast_state(), tuple(_signature(t) for t in inputs),
               repr(_structure(batch)))
        if self._mode == "train":
            self.optimizer.zero_grad(set_to_none=True)
        captured = self._programs.get(key)
        if captured is None:
            result = self._capture(key, batch, inputs, grad_holders)
        else:
            result = self._replay(captured, inputs, grad_holders)
        if self._mode == "train":
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return result

    def _optimizer_only_params(self, params: list) -> list:
        """Tensors the optimizer steps that are not the model's (ZeRO-1/2 shards): their grads too."""
        if self.optimizer is None:
            return []
        seen = {id(p) for p in params}
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in seen]

    def _forward(self, batch):
        if self._mode == "predict" or self.loss_fn is None:
            return self.layer(*batch)
        if len(batch) > 1 and _takes_two(self.loss_fn):
            return self.loss_fn(self.layer(*batch[:-1]), batch[-1])
        return self.loss_fn(self.layer(*batch))

    def _capture(self, key, batch, inputs, grad_holders):
        recorder = Recorder([_local(t) for t in inputs])
        try:
            with torch.set_grad_enabled(self._mode == "train"), recorder:
                result = self._forward(batch)
                if self._mode == "train":
                    result.backward()
                    sharding = getattr(self.optimizer, "_autopar_sharding", None)
                    if sharding is not None:  # gradient reduction is part of the program too
                        sharding.prepare_grads()
        finally:
            recorder.close()
        results = _leaves(result)
        grads = [p.grad for p in grad_holders] if self._mode == "train" else []
        outputs = [_local(r) for r in results] + [_local(g) for g in grads if g is not None]
        program = recorder.program(outputs)
        self._programs[key] = _Captured(
            program,
            [r._spec if type(r) is DistTensor else None for r in results] + [_structure(result)],
            [None if g is None else (g._spec if type(g) is DistTensor else False) for g in grads],
        )
        self._last = program
        return result.detach() if isinstance(result, torch.Tensor) and self._mode == "train" else result

    def _replay(self, captured: _Captured, inputs, grad_holders):
        outs = captured.program.run([_local(t) for t in inputs])
        *specs, structure = captured.result_specs
        results = [_wrap(o, s) for o, s in zip(outs, specs)]
        rest = iter(outs[len(specs):])
        for p, g in zip(grad_holders, captured.grad_specs):
            if g is not None:
                p.grad = _wrap(next(rest), g or None)
        self._last = captured.program
        return _rebuild(structure, iter(results))

    # -- what it runs ---------------------------------------------------------------------
    def dist_main_program(self) -> str:
        """The captured program of the last step, one local op or transfer per line (transfers
        with their ranks and bytes)."""
        if self._last is None:
            raise RuntimeError("dist_main_program: run a step first (the program is captured on the first call)")
        return str(self._last)

    def state_dict(self, *args, **kwargs):
        return self.layer.state_dict(*args, **kwargs)


def _takes_two(fn: Callable) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _leaves(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _leaves(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _leaves(o)]
    return []


def _structure(out):
    """`out` with its tensors replaced by None (to rebuild replayed results in the same shape)."""
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, (list, tuple)):
        return type(out)(_structure(o) for o in out)
    if isinstance(out, dict):
        return {k: _structure(v) for k, v in out.items()}
    return out


def _rebuild(structure, it):
    if structure is None:
        return next(it)
    if isinstance(structure, (list, tuple)):
        return type(structure)(_rebuild(s, it) for s in structure)
    if isinstance(structure, dict):
        return {k: _rebuild(v, it) for k, v in structure.items()}
    return structure


def to_static(layer: torch.nn.Module, loader=None, loss: Optional[Callable] = None,
              optimizer: Optional[torch.optim.Optimizer] = None, strategy=None) -> DistModel:
    """Run `layer` (annotated as for the dynamic mode) as a captured program.

    `loss(outputs[, label])` and `optimizer` (a `shard_optimizer`) make `train()` and
    `eval()` available; without them the model predicts.  `loader` is accepted for the
    seed's signature; it is not read: the program is captured from the first batch itself.
    `strategy` must be None (there are no compiler passes to configure yet).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> layer = dist.shard_layer(torch.nn.Linear(4, 2), mesh)
    >>> opt = dist.shard_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    >>> model = dist.to_static(layer, None, lambda out: out.pow(2).mean(), opt)
    >>> x = dist.shard_tensor(torch.ones(8, 4), mesh, [dist.Shard(0)])
    >>> first, second = float(model(x)), float(model(x))  # captured, then replayed
    >>> second < first
    True
    """
    if strategy is not None:
        raise NotImplementedError(
            "to_static(strategy=...): no compiler passes exist yet; the captured program is the dynamic mode's "
            "own (same placements and communication). Pass strategy=None."
        )
    if not isinstance(layer, torch.nn.Module):
        raise TypeError(f"to_static needs a torch.nn.Module, got {type(layer).__name__}")
    return DistModel(layer, loader, loss, optimizer)


__all__ = ["CaptureError", "DistModel", "to_static"]
