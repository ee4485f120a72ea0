"""Local regions: a module whose forward never communicates runs as plain PyTorch.

In data parallel (and in many tensor-parallel sub-layers) every op of a module runs on
the local pieces as they are: no input moves, no collective, no special kernel.  Sending
each of those ops through the distributed dispatch (a Python call per op, forward and
backward) is pure overhead.  So the first call of a module with given input specs is
*verified*: it runs through the dispatch as usual while every dispatched op is watched,
then once more on the bare local pieces (no grad, same random state); if no op moved an
input, drew random numbers or ran a special kernel, and the two runs agree bit for bit,
the module is a local region for those specs.  Later calls unwrap the inputs and
parameters to their local pieces, run the module's own forward on them (torch's C++
autograd records it, as on one device) and wrap the outputs with the verified specs.

The backward needs no verification: per mesh dim, the gradient of a region's value has
the dual placement of the value (Shard(d) -> Shard(d), Replicate -> Partial(sum),
Partial(sum) -> Replicate), because the local ops compute, on every rank, the local part
of the global function.  A mesh dim on which everything is Replicate computes the same on
every rank and keeps gradients Replicate.  Gradients reaching the region's outputs are
resharded to the dual of the output placements once, at the boundary.

A region holds while the module keeps the verified parameters (same objects, same specs)
and settings (its plain attributes); a change makes the next call verify again.  State
outside the module tree that the forward branches on (a global flag) is not seen.

Saved-tensor hooks (non-reentrant activation checkpointing installs them) run code again
later, in backward, outside the region: a checkpointed function recomputed there would see
the distributed parameters with the local pieces the region had handed it, and the
recomputed tensors must match the saved ones in number and shape.  So a module called
while such hooks are active always goes op by op (its forward and its recomputation then
take the same path), and a module whose forward installs them is not a region.  Nor is a
module whose forward dispatches ops from inside an autograd Function's forward (reentrant
checkpointing runs the function there and again in that Function's backward).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..tensor import dispatch, grad_landing
from ..tensor.convert import GradToPlacement
from ..tensor.observers import watching
from ..comm import collectives
from ..comm.backend import CommError
from ..comm.fake import same_values
from ..comm.observers import CaptureBase, active_captures, capture_running, capturing
from ..tensor.dtensor import DistTensor, local_piece, new_dist
from . import grad_reduce
from .grad_reduce import BackwardReduction, BucketPlan
from ..placement import Partial, ReduceType, Replicate, Shard
from ..redistribute import piece_of_replicated, redistribute_local
from ..spec import DistSpec, TensorMeta
from ..spmd.registry import DRAWS_RANDOM, KERNEL_PLAIN_WHEN, MODULE_RULES

MIN_OPS = 8  # below this many ops the boundary costs more than the dispatch it saves

# region calls run so far in this process, forward and backward (`calls`)
_STATE = {"enabled": True, "inside": 0, "forward": 0, "backward": 0}


def calls() -> tuple[int, int]:
    """How many region calls have run their forward and their backward in this process: a
    step's recording (`planner.predict`) prices each call's boundary, which dispatches no op."""
    return _STATE["forward"], _STATE["backward"]


@contextlib.contextmanager
def local_regions(enabled: bool):
    """Turn local regions on or off (on by default), e.g. to compare with the op-by-op path.

    >>> import autopar as dist
    >>> with dist.local_regions(False):
    ...     pass
    """
    before = _STATE["enabled"]
    _STATE["enabled"] = enabled
    try:
        yield
    finally:
        _STATE["enabled"] = before


def install(module: torch.nn.Module) -> None:
    """Let `module` and every sublayer run as local regions where verification allows.  A
    parameter held in more than one place (tied, or a layer used twice) is marked `IN_PARTS`:
    a region delivers one part of its gradient, the rest comes later."""
    for sub in module.modules():
        if not isinstance(sub.__dict__.get("forward"), RegionForward):
            sub.forward = RegionForward(sub)
    seen: set = set()
    for _, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            p.__dict__[grad_landing.IN_PARTS] = True
        seen.add(id(p))


class RegionForward:
    """Stands in for `module.forward`: runs it as a verified local region, or as is."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.inner = module.__dict__.get("forward") or type(module).forward.__get__(module)
        self.__wrapped__ = self.inner  # inspect.signature(module.forward) still sees the forward's
        self.regions: dict = {}

    def __call__(self, *args, **kwargs):
        if (
            _STATE["inside"]
            or not _STATE["enabled"]
            or (capture_running() and not self._vouched(args, kwargs))
            or _saved_tensor_hooks()
        ):
            return self.inner(*args, **kwargs)
        key = _call_key(self.module, args, kwargs)
        if key is None:
            return self.inner(*args, **kwargs)
        region = self.regions.get(key, _UNSEEN)
        if region is None or _users_module_hooks(self.module):  # (a refused module needs no look for hooks)
            return self.inner(*args, **kwargs)
        if region is not _UNSEEN and not region.still_valid():
            region = _UNSEEN  # a parameter or a setting changed since: verify again
        if region is _UNSEEN:
            self.regions[key] = None  # re-entrant calls during verification go op by op
            out, self.regions[key] = _verify(self.module, self.inner, args, kwargs)
            return out
        return region.run(self.inner, args, kwargs)

    def _vouched(self, args, kwargs) -> bool:
        """While an ancestor is verified (its watches are the only captures), a module that a
        module rule vouches for still runs as its region: the ancestor's verdict then rests on
        the ops around it.  So it does while `to_static` records the step (a capture that
        records local ops): the program holds the region's local ops, not the op-by-op
        dispatch's transfers (a MoE block's routing of a token-split batch)."""
        return all(type(c) is _Watch or c.records_local_ops for c in active_captures()) and (
            _declared_out_specs(self.module, args, kwargs) is not None)

    def __getstate__(self):
        return {"module": self.module}  # verified regions are not carried over: a copy verifies its own

    def __setstate__(self, state):
        self.__init__(state["module"])


_UNSEEN = object()
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, f"_global{name}") for name in _HOOKS)


def _users_module_hooks(module: torch.nn.Module) -> bool:
    """A module hook of the user's on a sublayer, or a global one: inside a region it would run
    on the local pieces, where a hook that reads or changes values (or registers gradient
    hooks) sees what one process's would not, and after verification, or in backward, nothing
    checks it; such a call goes op by op.  Hooks on the module itself run outside its region;
    autopar's own (placement plans, ZeRO-3's gathers) are known to verification."""
    return any(_GLOBAL_HOOKS) or _hooked_below(module)


def _hooked_below(module: torch.nn.Module) -> bool:
    for sub in module._modules.values():  # (a plain walk: `modules()` costs twice as much)
        if sub is None:
            continue
        attrs = sub.__dict__
        for name in _HOOKS:
            hooks = attrs.get(name)
            if hooks and not all(_ours(h) for h in hooks.values()):
                return True
        if sub._modules and _hooked_below(sub):
            return True
    return False


def _ours(hook) -> bool:
    """A hook defined in autopar's code (a function, a method or a partial of one)."""
    return (getattr(getattr(hook, "func", hook), "__module__", None) or "").startswith("autopar.")
# a saved-tensor pack function with this attribute set only observes (`simulate`'s memory
# accounting): the hooks are taken for absent, a region runs as without them
OBSERVES_ONLY = "observes_only"


def _saved_tensor_hooks():
    """The innermost active saved-tensor hooks (activation checkpointing's), or None when
    there are none or they only observe (`simulate`'s memory accounting)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if hooks is None or getattr(hooks[0], OBSERVES_ONLY, False) else hooks


def _arguments(args, kwargs) -> list:
    """A call's arguments, the items of a tuple or list argument in its place (HF's decoder
    layers take their rotary embeddings as a (cos, sin) pair): what a region unwraps."""
    flat = []
    for a in (*args, *kwargs.values()):
        if type(a) is tuple or type(a) is list:
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def _map_arguments(args, kwargs, fn) -> tuple[list, dict]:
    """(args, kwargs) with `fn` applied to each value `_arguments` lists, in its place."""
    def one(a):
        return type(a)(map(fn, a)) if type(a) is tuple or type(a) is list else fn(a)

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}


def _batch_split(dist_in: list) -> Optional[tuple]:
    """(mesh, global batch size, placements) of the first distributed input that splits its
    leading (batch) dim, the placements cutting dim 0 alone as it does; None without one."""
    for t in dist_in:
        spec = t._spec
        if any(type(p) is Shard and p.dim == 0 and k > 1 for p, k in zip(spec.placements, spec.mesh.shape)):
            return spec.mesh, spec.meta.shape[0], tuple(
                p if type(p) is Shard and p.dim == 0 else Replicate() for p in spec.placements)
    return None


def _batch_cut(dist_in: list):
    """How a region hands out its plain tensor arguments: a plain tensor is a global value,
    which the op-by-op dispatch cuts where it meets a split one.  Where a distributed input
    splits its leading (batch) dim, a plain argument as long in its leading dim is cut the
    same way (HF's causal mask, [batch, 1, seq, seq], beside hidden states split over dp);
    verification confirms the guess bit for bit.  Returns the cut (a function of a plain
    tensor), or None when no input splits its batch dim."""
    split = _batch_split(dist_in)
    if split is None:
        return None
    mesh, batch, placements = split
    rank = dispatch._rank()

    def cut(a):
        if not _batch_long(a, batch):
            return a
        return piece_of_replicated(a, DistSpec(mesh, placements, TensorMeta.of(a)), rank)

    return cut


def _batch_long(a, batch: int) -> bool:
    """Whether `a` is a plain tensor as long as the batch in its leading dim (`_batch_cut`)."""
    return type(a) is torch.Tensor and a.dim() > 0 and a.shape[0] == batch


def _call_key(module, args, kwargs) -> Optional[tuple]:
    """What a verified region depends on, or None when the call cannot be a region (no
    distributed input, or an argument that is not a tensor, a hashable value or a tuple or
    list of those)."""
    key: list = [module.training, torch.is_grad_enabled()]
    for device in ("cpu", "cuda"):  # autocast decides the outputs' dtypes
        if torch.is_autocast_enabled(device):
            key.append((device, torch.get_autocast_dtype(device)))
    key.append(tuple(len(a) if type(a) is tuple or type(a) is list else -1 for a in (*args, *kwargs.values())))
    found = False
    for a in _arguments(args, kwargs):
        if type(a) is DistTensor:
            found = True
            key.append(a._spec)
        elif isinstance(a, torch.Tensor):
            if a.requires_grad:
                return None  # a plain leaf used with distributed tensors gets its grad densified
            key.append((a.shape, a.dtype))
        elif isinstance(a, (int, float, bool, str, type(None))):
            key.append(a)
        else:
            return None
    if not found:
        return None
    if kwargs:
        key.append(tuple(kwargs))
    return tuple(key)


# -- verification ---------------------------------------------------------------------------
class _Watch(CaptureBase):
    """Sees every dispatched op and every transfer of a module's first call (as an op watcher
    and a transfer capture): is each op local as it is, and does nothing move?"""

    def __init__(self, mesh, protected: list, frame, cuttable=frozenset(), split=None):
        # the storages of the inputs, parameters and buffers: a write into one (also through
        # an alias such as `.data`) is a side effect the region must not repeat
        self.mesh, self.ops, self.local = mesh, 0, True
        # plain tensor arguments a region cuts along the batch (`_batch_cut`), by id: an op
        # may cut them so; and the batch size and its placements (`_batch_split`)
        self.cuttable = cuttable
        self.batch, self.batch_placements = (None, None) if split is None else split[1:]
        self.frame = frame  # the verification's own frame: the module's forward runs below it
        self.protected = {dispatch.storage_key(local_piece(t)) for t in protected}

    def enter_wire(self) -> None:  # an explicit reshard in the forward
        self.local = False

    def value_read(self, what) -> None:
        self.local = False

    def see(self, func, dec, flat) -> None:
        self.ops += 1
        if not self.local:
            return
        if (
            _saved_tensor_hooks() is not None  # the forward checkpoints: recomputed outside the region
            or self._inside_function()
            or dec is None or dec.route != "rule" or not dec.on_mesh or dec.mesh != self.mesh or func in DRAWS_RANDOM
            or (dec.kernel is not None and not KERNEL_PLAIN_WHEN.get(dec.kernel, _never)(func, dec.in_specs, dec.coord))
        ):
            self.local = False
            return
        for t, spec in zip(flat, dec.in_specs):
            if type(t) is DistTensor:
                if t._spec is not spec and not self._cut_alike(t, spec):
                    self.local = False
            elif t.requires_grad or not (spec.is_replicated() or self._cut_alike(t, spec)):
                self.local = False
        for i in dec.mutated:
            t = flat[i]
            if dispatch.storage_key(local_piece(t)) in self.protected:
                self.local = False

    def _cut_alike(self, t: torch.Tensor, spec: DistSpec) -> bool:
        """Whether the op cuts `t` along the batch as the region's own run would have it: a
        plain argument the region cuts (`_batch_cut`), or a tensor the forward made (not an
        input, parameter or buffer, nor a view of one), plain or replicated, whose rows are
        all alike (HF's causal mask, BERT's token type embeddings of an expanded buffer: made
        from the batch size, which the region's run takes from the local batch, they are the
        cut of the global value)."""
        if tuple(spec.placements) != self.batch_placements:
            return False
        if type(t) is not DistTensor and id(t) in self.cuttable:
            return True
        piece = local_piece(t)
        return (
            (type(t) is not DistTensor or t._spec.is_replicated())
            and dispatch.storage_key(piece) not in self.protected
            and _batch_long(piece, self.batch) and _rows_alike(piece)
        )

    def _inside_function(self) -> bool:
        """Whether the op runs inside an autograd Function's forward called by the module."""
        f = sys._getframe(2)
        while f is not None and f is not self.frame:
            if f.f_code is _FUNCTION_APPLY:
                return True
            f = f.f_back
        return False


_FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__


def _rows_alike(t: torch.Tensor) -> bool:
    """Every row of `t` (along dim 0) holds the same values: an expanded row, or equal ones
    (compared once, at verification; on meta, as a trial is, taken to hold)."""
    return t.stride(0) == 0 or same_values(t, t[:1].expand_as(t))


def _never(*_) -> bool:
    return False


class _Refuse(CaptureBase):
    """A transfer capture that stops a trial run before it communicates or reads a value."""

    def enter_wire(self):
        raise _TrialFailed("communicates")

    def value_read(self, what):
        raise _TrialFailed(what)


class _TrialFailed(RuntimeError):
    pass


# What a forward raises on the bare local pieces where it ran on the distributed tensors:
# torch's checks of the sizes, now the pieces' (a view to the global head count), and the
# forward's own assertions on them; and the guard's refusal (_TrialFailed).
_PIECE_ERRORS = (RuntimeError, IndexError, ValueError, AssertionError)


def _refuses_pieces(err: Exception) -> bool:
    """Whether the trial's `err` says the forward needs the distributed tensors: one of
    _PIECE_ERRORS, or a plain piece asked for what only a distributed tensor has
    (`x.placements`).  Out of memory, a failed transfer and any other error (a bug) are
    raised: they are not the module's answer."""
    if isinstance(err, (torch.OutOfMemoryError, CommError)):
        return False
    if isinstance(err, AttributeError):
        piece = err.obj
        return isinstance(piece, torch.Tensor) and type(piece) is not DistTensor and hasattr(DistTensor, err.name or "")
    return True


def _settings(module) -> list:
    """Every plain setting of the module and its sublayers (`p` of a dropout, a flag...), each
    sublayer's own `forward` and each sublayer itself (a replaced one runs code, and holds
    parameters, the region never verified): the forward may branch on them, so a region holds
    only while they keep their values."""
    out = []
    for sub in module.modules():
        out += [(sub.__dict__, k, v) for k, v in sub.__dict__.items()
                if (isinstance(v, (bool, int, float, str, type(None))) and not k.startswith("_")) or k == "forward"]
        out += [(sub._modules, k, v) for k, v in sub._modules.items()]
    return out


def _tensors(module) -> tuple[list, list]:
    """Every (holder dict, name, tensor, is a buffer) slot of the parameters and buffers of the
    module and its sublayers, and the distinct parameters."""
    slots, params = [], {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                slots.append((sub._parameters, name, p, False))
                params[id(p)] = p
        for name, b in sub._buffers.items():
            if b is not None:
                slots.append((sub._buffers, name, b, True))
    return slots, list(params.values())


def _verify(module, inner, args, kwargs):
    """First call for these input specs: run it op by op while watching; return (output, Region or None)."""
    flat_in = [a for a in _arguments(args, kwargs) if isinstance(a, torch.Tensor)]
    slots, params = _tensors(module)
    mesh = next(t._spec.mesh for t in flat_in if type(t) is DistTensor)
    suitable = (
        dispatch._rank() in mesh
        and all(t._spec.mesh == mesh for t in flat_in if type(t) is DistTensor)
        and all(type(t) is DistTensor and t._spec.mesh == mesh for _, _, t, _ in slots if t.is_floating_point())
        and all(type(t) is DistTensor for t in params)
    )
    if not suitable:
        return inner(*args, **kwargs), None
    settings = _settings(module)
    declared = _declared_out_specs(module, args, kwargs)
    if declared is not None:  # a module rule vouches for it: no verification
        region = Region.build(mesh, settings, args, kwargs, slots, params, _flat_outputs(declared)[0])
        if region is not None:
            return region.run(inner, args, kwargs), region
    split = _batch_split([t for t in flat_in if type(t) is DistTensor])
    cuttable = frozenset() if split is None else frozenset(id(t) for t in flat_in if _batch_long(t, split[1]))
    watch = _Watch(mesh, flat_in + [t for _, _, t, _ in slots], sys._getframe(), cuttable, split)
    with watching(watch), capturing(watch):  # (sublayers meanwhile run op by op, unverified)
        out = inner(*args, **kwargs)
    if watch.ops < MIN_OPS or [(k, v) for _, k, v in _settings(module)] != [(k, v) for _, k, v in settings]:
        return out, None  # (a forward that changes its settings would verify again every call)
    # the trial runs after the real call: a write the call made (a running statistic, its
    # input) can only make the trial disagree, which refuses the region
    trial = _trial(module, inner, slots, settings, args, kwargs) if watch.local else None
    # every rank of the mesh must reach the same verdict (the trial compares this rank's data)
    verdict = torch.tensor([int(watch.local and _agrees(out, trial))], device="cpu")  # (a value, also under meta)
    if not collectives.all_reduce(verdict, tuple(mesh.process_ids), ReduceType.MIN).item():
        return out, None
    return out, Region.build(mesh, settings, args, kwargs, slots, params, [o._spec for o in _flat_outputs(out)[0]])


def _declared_out_specs(module, args, kwargs):
    """The output specs a module rule (`spmd.registry.MODULE_RULES`) gives this call, or None."""
    for cls in type(module).__mro__:
        rule = MODULE_RULES.get(cls)
        if rule is not None:
            specs = [_spec_of(a) if isinstance(a, torch.Tensor) else a for a in args]
            return rule(module, specs, kwargs, [_spec_of(p) for p in module.parameters()])
    return None


def _spec_of(t: torch.Tensor):
    return t._spec if type(t) is DistTensor else None


def _flat_outputs(out) -> tuple[list, Any]:
    """A forward's outputs (or their specs) as a list and the structure that holds them: None
    for one tensor, else torch's pytree of a tuple, a list or any container it knows (HF's
    ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out], None
    return tree_flatten(out)


def _rebuilt(outs: list, structure):
    return outs[0] if structure is None else tree_unflatten(outs, structure)


def _agrees(out, trial: Optional[tuple]) -> bool:
    """Distributed outputs only, held alike and equal to the trial's bit for bit."""
    if trial is None:
        return False
    outs, structure = _flat_outputs(out)
    trial_outs, trial_structure = trial
    return structure == trial_structure and len(outs) == len(trial_outs) > 0 and all(
        type(o) is DistTensor and isinstance(t, torch.Tensor) and type(t) is not DistTensor
        and t.dtype == o._local.dtype and t.shape == o._local.shape and same_values(t, o._local)
        for o, t in zip(outs, trial_outs)
    )


def _trial(module, inner, slots, settings, args, kwargs) -> Optional[tuple]:
    """The module run once more on the bare local pieces (no grad, random state restored):
    its outputs as `_flat_outputs` gives them.

    A forward may write what it is given (running statistics, a counter, its input): the trial
    gets copies of the inputs and buffers and the settings are put back after it, so nothing
    happens twice.  It runs only after a call that wrote none of its inputs, parameters or
    buffers (the watch checks their storages).  Parameters are not copied (a whole model's
    worth of memory): a trial that writes one anyway (a data-dependent write) is an error, as
    the write cannot be undone."""
    # the arguments as `Region.run` hands them out (a plain tensor cut along the batch), copied;
    # the buffers' local pieces, copied
    cut = _batch_cut([a for a in _arguments(args, kwargs) if type(a) is DistTensor]) or (lambda a: a)

    def copy(v):
        if not isinstance(v, torch.Tensor):
            return v
        return (local_piece(v) if type(v) is DistTensor else cut(v)).clone()

    largs, lkwargs = _map_arguments(args, kwargs, copy)
    params = [local_piece(t) for _, _, t, buffer in slots if not buffer]
    versions = [t._version for t in params]
    saved = _swap(slots, [local_piece(t).clone() if buffer else local_piece(t) for _, _, t, buffer in slots])
    _STATE["inside"] += 1
    try:
        with capturing(_Refuse()), torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = inner(*largs, **lkwargs)
    except (*_PIECE_ERRORS, AttributeError) as err:
        if not _refuses_pieces(err):
            raise
        return None  # the forward cannot run on the bare pieces: the module is not a region
    finally:
        _STATE["inside"] -= 1
        _swap(slots, saved)
        for where, name, value in settings:
            where[name] = value
    if any(t._version != v for t, v in zip(params, versions)):
        raise RuntimeError(
            f"autopar local regions: {type(module).__name__}.forward writes a parameter in place; such a module "
            f"cannot be verified as a local region. Run it within autopar.local_regions(False)."
        )
    return _flat_outputs(out)


def _swap(slots, values) -> list:
    old = []
    for (where, name, *_), v in zip(slots, values):
        old.append(where[name])
        where[name] = v
    return old


# -- the region -------------------------------------------------------------------------------
def _dual(placements, mesh_shape, all_replicate) -> tuple:
    """Per mesh dim, the placement of the gradient of a value placed `placements`."""
    out = []
    for p, size, rep in zip(placements, mesh_shape, all_replicate):
        if size == 1 or rep:
            out.append(p if size == 1 else Replicate())
        elif type(p) is Replicate:
            out.append(Partial())
        elif type(p) is Partial:
            out.append(Replicate())
        else:
            out.append(p)
    return tuple(out)


def _grad_spec(spec: DistSpec, placements) -> DistSpec:
    return DistSpec(spec.mesh, placements, TensorMeta.contiguous(spec.shape, spec.meta.dtype))


class Region:
    """A verified local region: the specs to wrap outputs with and to place gradients at."""

    def __init__(self, settings, slots, params, in_grad_specs, param_grad_specs, out_specs, out_grad_specs,
                 plain_inputs):
        self.settings, self.slots, self.params = settings, slots, params
        self.slot_specs = [t._spec if type(t) is DistTensor else None for _, _, t, _ in slots]
        self.in_grad_specs, self.param_grad_specs = in_grad_specs, param_grad_specs
        self.grad_specs = in_grad_specs + param_grad_specs
        self.out_specs, self.out_grad_specs = out_specs, out_grad_specs
        self.buckets: Optional[BucketPlan] = None  # parameter gradients all-reduced during backward
        self.plain_inputs = plain_inputs  # whether any argument is a plain tensor (`_batch_cut`)
        self.buckets_generation = -1

    @staticmethod
    def build(mesh, settings, args, kwargs, slots, params, outs: list) -> Optional["Region"]:
        """`outs`: the outputs' specs, in `_flat_outputs`' order."""
        flat = _arguments(args, kwargs)
        inputs = [a for a in flat if type(a) is DistTensor]
        specs = [t._spec for t in inputs] + [p._spec for p in params] + outs
        if any(type(p) is Partial and p.reduce_type is not ReduceType.SUM for s in specs for p in s.placements):
            return None  # only sums have a linear adjoint
        all_rep = [all(type(s.placements[k]) is Replicate for s in specs) for k in range(mesh.ndim)]
        for o in outs:
            if o.meta.dtype.is_floating_point:
                for k, p in enumerate(o.placements):
                    if type(p) is Replicate and mesh.shape[k] > 1 and not all_rep[k]:
                        return None  # its gradient would mix Replicate and Partial on that dim
        shape = mesh.shape
        return Region(
            settings, slots, params,
            [_grad_spec(t._spec, _dual(t._spec.placements, shape, all_rep)) for t in inputs],
            [_grad_spec(p._spec, _dual(p._spec.placements, shape, all_rep)) for p in params],
            outs,
            [_grad_spec(o, _dual(o.placements, shape, all_rep)) for o in outs],
            any(type(a) is torch.Tensor for a in flat),
        )

    def still_valid(self) -> bool:
        """The module still holds the verified parameters and buffers, placed as verified,
        and its settings have the verified values."""
        for (where, name, t, _), spec in zip(self.slots, self.slot_specs):
            if where.get(name) is not t or (spec is not None and t._spec is not spec):
                return False
        for where, name, v in self.settings:
            w = where.get(name)
            if w is not v and w != v:
                return False
        return True

    def run(self, inner, args, kwargs):
        _STATE["forward"] += 1
        dist_in = [a for a in _arguments(args, kwargs) if type(a) is DistTensor]
        grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in dist_in) or any(p.requires_grad for p in self.params)
        )
        if grad:
            call = _Backward(self, self._backward_reduction())
            locals_ = _Enter.apply(call, *dist_in, *self.params)
            if call.reduction is not None and call.reduction.plan.overlap:
                locals_, n = list(locals_), len(dist_in)
                for i in call.reduction.plan.placed:
                    locals_[n + i] = call.reduction.watch(i, locals_[n + i])
        else:
            locals_ = [t._local for t in dist_in] + [p._local for p in self.params]
        by_id = {id(t): loc for t, loc in zip(dist_in, locals_)}
        by_id.update({id(p): loc for p, loc in zip(self.params, locals_[len(dist_in):])})
        cut = _batch_cut(dist_in) if self.plain_inputs else None
        largs, lkwargs = _map_arguments(
            args, kwargs, lambda a: by_id[id(a)] if type(a) is DistTensor else cut(a) if cut is not None else a)
        saved = _swap(self.slots, [by_id.get(id(t), local_piece(t)) for _, _, t, _ in self.slots])
        _STATE["inside"] += 1
        try:
            out = inner(*largs, **lkwargs)
        finally:
            _STATE["inside"] -= 1
            _swap(self.slots, saved)
        outs, structure = _flat_outputs(out)
        if len(outs) != len(self.out_specs):
            raise RuntimeError(
                f"autopar local regions: {getattr(inner, '__qualname__', inner)} returned {len(outs)} tensors "
                f"where its verified call returned {len(self.out_specs)} for the same inputs; run it within "
                f"autopar.local_regions(False)."
            )
        if grad:
            wrapped = _Exit.apply(call, *outs)
        else:
            wrapped = [new_dist(o, s) for o, s in zip(outs, self.out_specs)]
        return _rebuilt(list(wrapped), structure)

    def _backward_reduction(self) -> Optional[BackwardReduction]:
        if self.buckets_generation != grad_reduce.generation():  # a shard_optimizer since
            self.buckets = BucketPlan.build(self.params, self.param_grad_specs)
            self.buckets_generation = grad_reduce.generation()
        return self.buckets.reduction(self.params, self.param_grad_specs) if self.buckets is not None else None


class _Backward:
    """One call's backward through the region: its gradient reduction, and the addresses of
    the gradients already handed out.  Autograd hands one tensor to every operand of an
    add (`x + b1 + b2`); torch's AccumulateGrad copies a gradient that is referenced
    elsewhere before keeping it as `.grad`, but sees only our fresh wrappers, so the
    boundary copies a repeated local piece itself: accumulating into one parameter's
    gradient must not change another's."""

    __slots__ = ("region", "reduction", "handed_out")

    def __init__(self, region: "Region", reduction: Optional[BackwardReduction]):
        self.region, self.reduction, self.handed_out = region, reduction, set()

    def own(self, g: torch.Tensor) -> torch.Tensor:
        """`g` contiguous, and a copy when a gradient handed out before starts at its address."""
        g = g.contiguous()
        start = dispatch.storage_key(g, start=True)
        if start in self.handed_out:
            return g.clone()
        self.handed_out.add(start)
        return g


class _Enter(torch.autograd.Function):
    """Distributed inputs and parameters -> their local pieces; gradients come back dual-placed
    (or, for parameters whose gradients a BackwardReduction all-reduced, placed like them)."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call = call
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, not zeros
        out = [t._local.detach() for t in tensors]
        ctx.mark_non_differentiable(*[o for o in out if not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        _STATE["backward"] += 1
        call = ctx.call
        region = call.region
        n = len(region.in_grad_specs)
        # all-reduced parameter gradients are pieces of fresh flat buckets: never shared
        reduced = call.reduction.finish(grads[n:]) if call.reduction is not None else {}
        out = [
            None if g is None else new_dist(call.own(g), spec) for g, spec in zip(grads[:n], region.in_grad_specs)
        ]
        param_grads = [None if j in reduced else g for j, g in enumerate(grads[n:])]
        # first gradients written where their pre-step bucket reduces them (create_graph keeps
        # torch's accumulation)
        landed = grad_landing.land(region.params, [g if p.grad is None else None for p, g in zip(region.params, param_grads)]) \
            if not torch.is_grad_enabled() else [None] * len(param_grads)
        for j, (g, slot, spec) in enumerate(zip(param_grads, landed, region.param_grad_specs)):
            if j in reduced:
                out.append(reduced[j])
            else:
                out.append(None if g is None else new_dist(call.own(g) if slot is None else slot, spec))
        call.handed_out.clear()  # (a second backward through the graph starts afresh)
        if not torch.is_grad_enabled():
            out[n:] = _deliver(region.params, out[n:], ctx.next_functions[n:])
            grad_landing.start_complete()  # (buckets whose last gradients were delivered here)
        return (None, *out)


def _deliver(params: list, grads: list, edges: tuple) -> list:
    """Set first gradients as `.grad` here, where torch's AccumulateGrad would (a `detach`
    through the dispatch per parameter, about 3 us each) -- only where that is all it would
    do: a leaf whose accumulation this backward runs (not `autograd.grad`, not left out of
    `inputs=`), with no gradient yet, no tensor or post-accumulate hooks and the layout its
    gradient gets.  Hooks registered on the accumulator node itself are not seen: a
    parameter that needs them must have a tensor hook too.  Returns what is left for
    autograd to accumulate."""
    for j, (p, g, (node, _)) in enumerate(zip(params, grads, edges)):
        if (
            g is None or type(node) is not _ACCUMULATE_GRAD or node.variable is not p or p.grad is not None
            or p._post_accumulate_grad_hooks is not None or _user_hooks(p._backward_hooks)
            or (g._spec is not p._spec and g._spec.meta.stride != p._spec.meta.stride)
        ):
            continue
        try:
            if not torch._C._will_engine_execute_node(node):
                continue
        except RuntimeError:  # autograd.grad(): gradients are captured, none accumulated
            break
        p.grad = g
        grads[j] = None
    return grads


def _user_hooks(hooks) -> bool:
    """A parameter's gradient `hooks` hold one besides its own placement hook (a region's
    gradients are placed like their parameters already: that one would do nothing)."""
    if hooks:
        for h in hooks.values():
            if type(h) is not GradToPlacement:
                return True
    return False


def _accumulate_grad_type() -> type:
    leaf = torch.zeros((), requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()


class _Exit(torch.autograd.Function):
    """Local outputs -> distributed outputs; their gradients are resharded to the dual placement."""

    @staticmethod
    def forward(ctx, call, *outs):
        ctx.call = call
        ctx.set_materialize_grads(False)
        wrapped = [new_dist(o.detach(), s) for o, s in zip(outs, call.region.out_specs)]
        ctx.mark_non_differentiable(*[w for w in wrapped if not w.is_floating_point()])
        return tuple(wrapped)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        call = ctx.call
        placed = [_placed_grad(g, s) for g, s in zip(grads, call.region.out_grad_specs)]
        for g in placed:  # the caller may hold these: a parameter's gradient must not be one
            if g is not None:
                call.handed_out.add(dispatch.storage_key(g, start=True))
        return (None, *placed)


def _placed_grad(g: Any, spec: DistSpec):
    if g is None:
        return g
    if type(g) is not DistTensor:  # a plain gradient is the replicated global value
        return piece_of_replicated(g, spec, dispatch._rank())
    return redistribute_local(g._local, g._spec, spec)
