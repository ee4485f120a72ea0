"""to_static: the same annotated model, run as a captured program (the static mode).

The first call for a given input signature runs the step eagerly while recording the
local program it runs (`program.Recorder`); so does each call until the next optimizer
step, which must record what the first did (`program.moved_constants`); later calls replay
that program on the new batch, then run the optimizer step as usual.  The placements, the
reshards and the numbers are those of the dynamic mode by construction: the program *is*
what the dynamic mode did, minus the per-op decisions, wrappers and autograd bookkeeping.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..tensor.dtensor import DistTensor, local_piece, new_dist
from ..runtime.precision import device_type
from ..pipelining.microbatch import split_batch
from .pipeline import capture as capture_pipeline
from .pipeline import check_settings as check_pipeline
from .program import CaptureError, Program, Recorder, moved_constants
from .strategy import Strategy

_MODES = ("train", "eval", "predict")


def _signature(t: torch.Tensor):
    if type(t) is DistTensor:
        return t._spec
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _autocast_state() -> tuple:
    """Autocast changes which casts a step runs: a program is captured per autocast setting."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


class _Captured:
    """A program and how to turn its outputs back into the step's results."""

    def __init__(self, program: Program, result_specs: list, grad_specs: list, step: int):
        self.program, self.result_specs, self.grad_specs = program, result_specs, grad_specs
        self.first_step = step  # the step (optimizer step, or eval/predict call) it was first captured in
        self.confirmed = False  # captured again in a later step and found to read the same values


def _wrap(local, spec):
    return DistTensor(local, spec) if spec is not None else local


class DistModel:
    """A model run as a captured program: `dist_model(*batch)` runs one step.

    In `train()` mode a step is forward, loss, backward and the optimizer step, and returns
    the loss; `eval()` returns the loss without training; `predict()` returns the model's
    outputs.  The batch is `(inputs..., label)` when there is a loss taking two arguments,
    else all inputs (a single list/tuple argument is unpacked).  Build one with `to_static`.

    A captured step must not branch on tensor values.  Tensors it reads without computing
    them (other than parameters, buffers and the batch) are read by reference: update them in
    place.  A signature is captured again at each call until the step after its first, and a
    value read differently there (a tensor made anew, a changed Python number) is refused.
    With a `Strategy`, a train step may be one micro-batch of a merged step (gradient merge),
    the forward runs under autocast (amp), and a pipelined model runs each train step as
    micro-batches in a schedule's order (pipeline: its captured micro-batch step is cut into
    stages at the cross-mesh transfers; eval and predict run the whole batch).
    """

    def __init__(self, layer: torch.nn.Module, loader=None, loss: Optional[Callable] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, strategy: Optional[Strategy] = None):
        strategy = strategy or Strategy()
        self.layer, self.loader, self.loss_fn = layer, loader, loss
        self.optimizer = strategy.shard(layer, optimizer)
        self.merge_steps, self.amp_dtype = strategy.merge_steps(), strategy.autocast_dtype()
        self.scaler = strategy.loss_scaler(device_type(layer)) if optimizer is not None else None
        if self.scaler is not None:  # (its scale made now: the programs read it as an input)
            self.scaler.scale(torch.ones((), device=device_type(layer)))
        self.merge_avg = bool(strategy.gradient_merge.avg)
        self.pipeline = strategy.pipeline_settings(layer)
        if self.pipeline is not None:
            if self.merge_steps > 1:
                raise ValueError("Strategy.pipeline and gradient_merge both split a step into micro-batches: "
                                 "use pipeline.accumulate_steps alone")
            if self.scaler is not None:
                raise ValueError("Strategy.amp with dtype float16 scales the loss, which a pipelined to_static step "
                                 "does not do: use bfloat16")
            self._pipeline_place = check_pipeline(layer, *self.pipeline)
        self._merged: list = []  # gradients summed over the micro-batches of the current step
        self._micro = 0
        self._programs: dict = {}
        self._steps = 0  # optimizer steps taken (train), calls made (eval, predict)
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
        if self._mode == "train" and self.pipeline is not None:
            return self._pipelined(batch)
        params = list(self.layer.parameters())
        grad_holders = params + self._optimizer_only_params(params)
        inputs = params + list(self.layer.buffers()) + _leaves(batch)  # tensors nested in dicts/lists too
        if self._mode == "train" and self.scaler is not None:
            inputs.append(self.scaler._scale)  # read afresh by every replay: the scaler updates it
        key = (self._mode, self.layer.training, _autocast_state(), tuple(_signature(t) for t in inputs),
               repr(_structure(batch)))
        if self._mode == "train":
            self.optimizer.zero_grad(set_to_none=True)
        captured = self._programs.get(key)
        if captured is None or not captured.confirmed:
            result = self._capture(key, batch, inputs, grad_holders)
            if captured is not None:
                self._confirm(captured, self._programs[key])
        else:
            result = self._replay(captured, inputs, grad_holders)
        if self._mode == "train":
            if self.merge_steps > 1:
                self._merge(grad_holders)
            if self._micro == 0:
                self._step()
                self.optimizer.zero_grad(set_to_none=True)
                self._steps += 1
        else:
            self._steps += 1
        return result

    def _step(self) -> None:
        """The optimizer step (a float16 one through the loss scaler: unscale, skip on an inf)."""
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def _pipelined(self, batch: tuple):
        """One train step as micro-batches through the pipeline's stages (static/pipeline.py)."""
        m = self.pipeline[1]
        micro = split_batch(batch, m, "DistModel batch (Strategy.pipeline)")
        params = list(self.layer.parameters())
        holders = params + self._optimizer_only_params(params)
        fixed = params + list(self.layer.buffers())
        key = ("pipeline", self.layer.training, _autocast_state(),
               tuple(_signature(t) for t in fixed + _leaves(micro[0])), repr(_structure(batch)))
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = capture_pipeline(
                self._forward, micro[0], fixed + _leaves(micro[0]), holders, self.pipeline, *self._pipeline_place)
        self.optimizer.zero_grad(set_to_none=True)
        loss = program.run([[local_piece(t) for t in fixed + _leaves(mb)] for mb in micro], holders)
        self._last = program
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _merge(self, holders: list) -> None:
        """Add this micro-batch's gradients to the step's; on the last micro-batch hand the
        parameters the sum (or mean) for the optimizer."""
        grads = [p.grad for p in holders]
        if self._micro == 0:
            self._merged = [None if g is None else _owned(g) for g in grads]
        else:
            self._merged = [_add(a, g) for a, g in zip(self._merged, grads)]
        self._micro = (self._micro + 1) % self.merge_steps
        for p, g in zip(holders, self._merged):
            p.grad = None
            if self._micro == 0 and g is not None:
                if self.merge_avg:
                    local_piece(g).div_(self.merge_steps)
                p.grad = g
        if self._micro == 0:
            self._merged = []

    def _optimizer_only_params(self, params: list) -> list:
        """Tensors the optimizer steps that are not the model's (ZeRO-1/2 shards): their grads too."""
        if self.optimizer is None:
            return []
        seen = {id(p) for p in params}
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in seen]

    def _forward(self, batch):
        if self.amp_dtype is not None:
            with torch.autocast(device_type(self.layer), dtype=self.amp_dtype):
                return self._forward_as_is(batch)
        return self._forward_as_is(batch)

    def _forward_as_is(self, batch):
        if self._mode == "predict" or self.loss_fn is None:
            return self.layer(*batch)
        if len(batch) > 1 and _takes_two(self.loss_fn):
            return self.loss_fn(self.layer(*batch[:-1]), batch[-1])
        return self.loss_fn(self.layer(*batch))

    def _capture(self, key, batch, inputs, grad_holders):
        recorder = Recorder([local_piece(t) for t in inputs])
        try:
            with torch.set_grad_enabled(self._mode == "train"), recorder:
                result = self._forward(batch)
                if self._mode == "train":
                    (self.scaler.scale(result) if self.scaler is not None else result).backward()
                    sharding = getattr(self.optimizer, "_autopar_sharding", None)
                    # gradient reduction is part of the program too, unless gradients merge
                    # over micro-batches: then they add up Partial and the step reduces once
                    if sharding is not None and self.merge_steps == 1:
                        sharding.prepare_grads()
        finally:
            recorder.close()
        results = _leaves(result)
        grads = [p.grad for p in grad_holders] if self._mode == "train" else []
        outputs = [local_piece(r) for r in results] + [local_piece(g) for g in grads if g is not None]
        program = recorder.program(outputs)
        self._programs[key] = _Captured(
            program,
            [r._spec if type(r) is DistTensor else None for r in results] + [_structure(result)],
            [None if g is None else (g._spec if type(g) is DistTensor else False) for g in grads],
            self._steps,
        )
        self._last = program
        return result.detach() if isinstance(result, torch.Tensor) and self._mode == "train" else result

    def _confirm(self, first: _Captured, second: _Captured) -> None:
        """A signature is captured again at each call until the step after the one it was
        first captured in (every micro-batch of a merged step, then the next step's first):
        a value the step reads from outside its inputs that changed since the last capture (a
        tensor made anew each step or micro-batch, a Python number) would be replayed stale
        forever, so it is refused here, before the optimizer steps on it."""
        moved = moved_constants(first.program, second.program)
        if moved:
            raise CaptureError(
                "to_static: the step reads values that are not its inputs (batch, parameters, buffers) and that "
                "changed between its first two steps; the captured program would replay the first step's values. "
                "Pass such a value in the batch, or keep one tensor and update it in place. Read differently:\n  "
                + "\n  ".join(dict.fromkeys(moved)))
        second.first_step = first.first_step
        second.confirmed = self._steps > first.first_step

    def _replay(self, captured: _Captured, inputs, grad_holders):
        outs = captured.program.run([local_piece(t) for t in inputs])
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


def _owned(g: torch.Tensor) -> torch.Tensor:
    """A copy of a gradient to accumulate into (the program's outputs are not ours to add to)."""
    if type(g) is DistTensor:
        return new_dist(g._local.clone(), g._spec)
    return g.detach().clone()


def _add(acc: Optional[torch.Tensor], g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if g is None:
        return acc
    if acc is None:
        return _owned(g)
    if type(acc) is DistTensor and type(g) is DistTensor and acc._spec is g._spec:
        acc._local.add_(g._local)  # placed alike: the sum of the pieces is the piece of the sum
        return acc
    if type(acc) is not DistTensor and type(g) is not DistTensor:
        return acc.add_(g)
    return (acc + g).detach()  # placed unalike: the distributed add reshards


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
    `eval()` available; without them the model predicts.  `loader` is accepted for
    Paddle's signature; it is not read: the program is captured from the first batch itself.
    `strategy` (a `Strategy`) turns on ZeRO sharding of the optimizer, gradient merge over
    micro-batches and mixed precision (amp O1 autocast, O2 float32 master weights, float16
    loss scaling).

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
    if not isinstance(layer, torch.nn.Module):
        raise TypeError(f"to_static needs a torch.nn.Module, got {type(layer).__name__}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"to_static(strategy=...) needs an autopar.Strategy, got {type(strategy).__name__}")
    return DistModel(layer, loader, loss, optimizer, strategy)


__all__ = ["CaptureError", "DistModel", "Strategy", "to_static"]
