"""ZeRO-3 as FSDP does it: a layer's parameters are gathered just before the layer runs and
freed after, gathered again for its backward, and their gradients reduce-scattered as soon as
its backward is done.

Between uses every parameter a ZeRO-3 `shard_optimizer` steps is sharded over the
data-parallel mesh dim, and so are its `.grad` and its states.  The layers of the models
given to `shard_layer` / `parallelize` that hold such parameters are cut into units: each
child of an `nn.ModuleList` (the repeated blocks of a transformer) and every other layer
holding parameters directly; a parameter held in several units belongs to their closest
common ancestor (a tied embedding: the model itself).  A unit keeps, on each parameter's
`ZeroParam`, a full-size Parameter placed like the sharded one but Replicate over the
data-parallel dim, whose storage holds data only around the unit's use:

- forward: the unit's pre-hook finishes its all-gather (one collective for all its
  parameters; the unit before it started it: prefetch) and puts the full Parameters into its
  layers; the post-hook puts the sharded ones back and frees the storage, except in the
  unit that finishes last (its backward comes first);
- backward: autograd reaches the unit's outputs first, where gradient hooks gather the
  parameters again (and start the previous unit's gather); when every full Parameter
  has its gradient (post-accumulate-grad hooks) the unit starts one reduce-scatter of them
  and frees the storage; at the end of backward the shards are added to the sharded
  parameters' `.grad`.

Under a mixed-precision policy the full Parameters are in its `param_dtype`: the float32
shards are cast before the all-gather (half the bytes in bfloat16) and the gradients are
reduced in its `reduce_dtype` and added, cast back, to the float32 `.grad`.

The full Parameters are placed like data-parallel ones, so the batch stays sharded through
the whole model (every activation, the logits too) and a unit's layers run as local regions.
Bytes: two all-gathers of the parameters and one reduce-scatter of the gradients, 1.5x data
parallel's all-reduce.  Freed storage is refilled in place, so the tensors autograd saved
(views of it) see the data again; a unit's full pieces are views of one flat buffer (per
dtype), whose storage is resized with `inductor.resize_storage_bytes_` (one allocation per
use, not one per parameter: FSDP2's flat buffer), an op a captured program (`to_static`)
records and replays.  A gathered copy is used again
only while its shards are unchanged (their version counters); under a capture or a local
region's verification every use gathers afresh, so that the transfer is seen.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ...comm import all_gather_start, get_rank
from ...comm.observers import capture_running
from ...tensor.backward_end import AtBackwardEnd
from ...tensor.dtensor import new_dist
from ..precision import MixedPrecisionPolicy, cast_dist, spec_in
from .flat_shards import FlatShards
from .param import ZeroParam
from ..grad_reduce import BUCKET_BYTES, GradReduction, grad_plan

_resize = torch.ops.inductor.resize_storage_bytes_

# sharded parameter -> weak reference to its ZeroParam; keyed weakly, by identity: an entry
# goes with its parameter, and one whose ZeroParam went (its optimizer and units) is no unit's
_ZERO_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _gathered(p: torch.Tensor) -> Optional[ZeroParam]:
    """p's ZeroParam when a live ZeRO-3 unit gathers p."""
    ref = _ZERO_PARAMS.get(p)
    zp = ref() if ref is not None else None
    return zp if zp is not None and zp.unit is not None else None


def gathers(p: torch.Tensor) -> bool:
    """True when a ZeRO-3 unit gathers `p` around its use (and reduces its gradient)."""
    return _gathered(p) is not None


def gathered_piece(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local piece of the full Parameter a ZeRO-3 unit gathers for `p` (its storage holds
    data only around the unit's use), or None."""
    zp = _gathered(p)
    return None if zp is None else zp.gathered_local


def settle_raised_backwards(zero_params: list) -> None:
    """Before a step: the units' models whose last backward raised settle what it reached."""
    for model in {id(zp.unit.model): zp.unit.model for zp in zero_params if zp.unit is not None}.values():
        model.settle_raised_backward()


def install(zero_params: list, mesh_dim, models: list, policy: Optional[MixedPrecisionPolicy] = None) -> None:
    """Cut the `models` (those `shard_layer` or `parallelize` converted) that hold these
    sharded parameters into units (see the module doc), gathering and reducing in the
    `policy`'s dtypes.  Parameters in none of them, or gathered by another optimizer's units
    already, are left to the op-by-op dispatch."""
    wanted = set()
    for zp in zero_params:
        if not gathers(zp.param):
            _ZERO_PARAMS[zp.param] = weakref.ref(zp)
            wanted.add(zp)
    for model in models:
        owners: dict = {}  # ZeroParam -> [(layer name, layer, attribute)]
        for name, layer in model.named_modules():
            for attr, p in layer._parameters.items():
                ref = _ZERO_PARAMS.get(p) if p is not None else None
                zp = ref() if ref is not None else None
                if zp in wanted and zp.unit is None:
                    owners.setdefault(zp, []).append((name, layer, attr))
        if owners:
            _Model(model, owners, mesh_dim, policy)


def _unit_roots(model: torch.nn.Module) -> dict:
    """{layer name: the unit's root name} for every layer in a repeated block (a child of a
    ModuleList) or holding parameters directly."""
    roots: dict = {}
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.ModuleList):
            for child, _ in layer.named_children():
                block = f"{name}.{child}" if name else child
                for sub, _ in layer.get_submodule(child).named_modules():
                    roots.setdefault(f"{block}.{sub}" if sub else block, block)
    return roots


def _common(names: list) -> str:
    """The closest common ancestor of layer names."""
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


class _Model:
    """One model's units, their forward order, and the end-of-forward/backward bookkeeping."""

    def __init__(self, model: torch.nn.Module, owners: dict, mesh_dim, policy: Optional[MixedPrecisionPolicy]):
        blocks = _unit_roots(model)
        members: dict = {}  # unit root name -> [ZeroParam]
        layers = dict(model.named_modules())
        for zp, holders in owners.items():
            root = _common([blocks.get(name, name) for name, _, _ in holders])
            while isinstance(layers[root], (torch.nn.ModuleList, torch.nn.ModuleDict)):  # (never called)
                root = root.rpartition(".")[0]
            zp.holders = [(layer._parameters, attr) for _, layer, attr in holders]
            members.setdefault(root, []).append(zp)
        self.units = [_Unit(self, layers[name], name, group, mesh_dim, policy) for name, group in members.items()]
        self.order: list = []  # units in the order their forward starts
        self.last: Optional[_Unit] = None  # the unit whose forward ends last (kept for backward)
        self.recording = True
        self.ends: list = []
        self.backward_end = AtBackwardEnd(self.backward_done)
        model.register_forward_hook(lambda *_: self.forward_done())

    # -- forward ----------------------------------------------------------------------------
    def forward_started(self, unit: "_Unit") -> None:
        if self.backward_end.abandoned():
            self.drop_raised_backward()
        if self.recording and unit not in self.order:
            self.order.append(unit)
        self._prefetch(unit, 1)

    def _prefetch(self, unit: "_Unit", step: int) -> None:
        """Start gathering the unit that runs next (forward: after `unit`; backward: before)."""
        if self.recording or capture_running() or unit not in self.order:
            return
        i = self.order.index(unit) + step
        if 0 <= i < len(self.order):
            self.order[i].start_gather()

    def unit_done(self, unit: "_Unit") -> None:
        if self.recording:
            self.ends.append(unit)

    def forward_done(self) -> None:
        """The model's forward ended: free what is not needed next (a prefetched unit that
        did not run); the order seen the first time is the order prefetched from now on."""
        if self.recording and self.order:
            self.recording = False
            self.last = self.ends[-1]
        for unit in self.units:
            if not unit.keep and not unit.in_use:
                unit.free()

    # -- backward ---------------------------------------------------------------------------
    def backward_started(self, unit: "_Unit") -> None:
        if not self.backward_end.queued():  # (once per backward, a reentrant one within it included)
            self.backward_end.queue()
        if unit is not None:
            self._prefetch(unit, -1)

    def backward_done(self) -> None:
        """End of backward: reduce what is left (parameters that got no gradient leave their
        unit incomplete), add the reduced shards to the parameters' gradients, free all."""
        for unit in self.units:
            unit.reduce()
        for unit in self.units:
            unit.deliver()
        for unit in self.units:  # collected while an earlier reduction was pending (after a backward that raised)
            unit.reduce()
            unit.deliver()
        for unit in self.units:
            unit.keep = False
            unit.free()

    def drop_raised_backward(self) -> None:
        """A new forward after a backward that raised: what that backward collected or reduced
        is dropped (FSDP2's `reset_iter_state`, done where it is seen; a single process would
        have kept the gradients it reached in `.grad`), and the units freed."""
        self.backward_end.forget()
        dropped = sum(len(unit.grads) + (len(unit.reduction[0]) if unit.reduction else 0) for unit in self.units)
        for unit in self.units:
            unit.grads = {}
            if unit.reduction is not None:
                unit.reduction[1].finish()  # (every rank started it: finished, not abandoned)
                unit.reduction = None
            unit.keep = False
            unit.free()
        warnings.warn(f"ZeRO-3: the last backward raised before it ended; the {dropped} gradients it had "
                      f"reached are dropped at this forward, not added to .grad (a single process keeps them "
                      f"until zero_grad())", stacklevel=4)

    def settle_raised_backward(self) -> None:
        """The step after a backward that raised (no forward since): its gradients, as far as
        it reached, added to `.grad` (as a single process has them)."""
        if self.backward_end.abandoned():
            self.backward_end.forget()
            warnings.warn("ZeRO-3: the last backward raised before it ended; this step uses the gradients it reached",
                          stacklevel=4)
            self.backward_done()


class _Unit:
    """A layer's parameters under ZeRO-3 (FSDP2's FSDPParamGroup): their ZeroParams, each with
    the sharded Parameter (the user's) and the full one (used in the layer's forward and
    backward); one all-gather and one reduce-scatter per use.  Under a mixed-precision
    policy the full Parameters are in its `param_dtype` (the shards are cast before the
    gather) and the gradients are reduced in its `reduce_dtype`."""

    def __init__(self, model: _Model, layer: torch.nn.Module, name: str, params: list, mesh_dim,
                 policy: Optional[MixedPrecisionPolicy] = None):
        self.model, self.name = model, name
        self.params = params
        self.reduce_dtype = policy.reduction_dtype if policy is not None else None
        param_dtype = policy.param_dtype if policy is not None else None
        rank = get_rank()
        self.groups = []
        by_dtype: dict = {}
        # the garbage collector does not see a distributed Parameter's post-accumulate-grad
        # hooks: a hook holding the unit would keep it and its parameters for good
        unit = weakref.ref(self)
        locals_ = self._full_locals(rank, param_dtype)
        for i, (zp, local) in enumerate(zip(params, locals_)):
            p, spec = zp.param, zp.param._spec
            m = spec.mesh.dim_index(mesh_dim)
            coord = spec.mesh.coordinate(rank)
            dtype = local.dtype
            zp.unit = self
            zp.gathered = torch.nn.Parameter(new_dist(local, spec_in(zp.unsharded, dtype)), requires_grad=p.requires_grad)
            zp.gathered_local = local.data  # its own version counter: refills do not touch autograd's
            if p.requires_grad:
                zp.gathered.register_post_accumulate_grad_hook(lambda _p, i=i: unit().grad_ready(i))
            if coord is not None:
                ranks = spec.mesh.group_of(rank, (m,))
                by_dtype.setdefault((ranks, dtype), []).append((i, spec.placements[m].dim))
        for (ranks, _), entries in by_dtype.items():
            idx = [i for i, _ in entries]
            layout = FlatShards.of(tuple(tuple(params[i].gathered_local.shape) for i in idx),
                                   tuple(d for _, d in entries), len(ranks))
            self.groups.append((idx, ranks, ranks.index(rank), layout))
        self.trainable = sum(zp.param.requires_grad for zp in params)
        self.pending: list = []  # all-gathers in flight
        self.gathered: Optional[list] = None  # (local piece, version) of each shard the full copy holds
        self.in_use = self.keep = False
        self.grads: dict = {}
        self.reduction = None
        self._free_storage()
        layer.register_forward_pre_hook(lambda *_: self.before_forward())
        layer.register_forward_hook(lambda _m, args, kwargs, out: self.after_forward(out, (args, kwargs)), with_kwargs=True)

    def _full_locals(self, rank: int, param_dtype: Optional[torch.dtype]) -> list:
        """The full Parameters' local pieces: views of one flat buffer per dtype and device
        (`self.storages`, whose storage is resized as the unit gathers and frees: one
        allocation and one release per use, not one per parameter)."""
        shapes, keys = [], []
        for zp in self.params:
            p = zp.param
            coord = p._spec.mesh.coordinate(rank)
            shapes.append(tuple(zp.unsharded.local_shape(coord)) if coord is not None else None)
            keys.append((param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype,
                         p._local.device))
        sizes: dict = {}  # (dtype, device) -> elements
        for shape, key in zip(shapes, keys):
            if shape is not None:
                sizes[key] = sizes.get(key, 0) + math.prod(shape)
        flats = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
        self.storages = [flat.data for flat in flats.values()]
        out, used = [], dict.fromkeys(flats, 0)
        for shape, key in zip(shapes, keys):
            if shape is None:  # (this rank holds no piece)
                out.append(torch.empty((0,), dtype=key[0], device=key[1]))
                continue
            n = math.prod(shape)
            out.append(flats[key][used[key]:used[key] + n].view(shape))
            used[key] += n
        return out

    # -- gathering --------------------------------------------------------------------------
    def _versions(self) -> list:
        return [(zp.param._local, zp.param._local._version) for zp in self.params]

    def _holds_current(self) -> bool:
        """The full copy holds the shards as they are now (the same pieces, unchanged since)."""
        return self.gathered is not None and all(
            zp.param._local is local and local._version == version
            for zp, (local, version) in zip(self.params, self.gathered)
        )

    def start_gather(self) -> None:
        if self.pending or self._holds_current():
            return
        for w in self.storages:
            _resize(w, w.numel() * w.element_size())
        for idx, ranks, me, layout in self.groups:
            dtype = self.params[idx[0]].gathered_local.dtype  # (the policy's: cast before gathering)
            send = layout.pack_pieces([self.params[i].param._local.to(dtype) for i in idx], me)
            self.pending.append(all_gather_start(send, ranks))
        self.gathered = None

    def wait_gather(self) -> None:
        if capture_running():  # a capture or a region's verification must see the transfer
            self.free()
        self.start_gather()
        if self.pending:
            versions = self._versions()
            with torch.no_grad():
                for (idx, _, _, layout), pending in zip(self.groups, self.pending):
                    layout.unpack(pending.wait(), [self.params[i].gathered_local for i in idx])
            self.pending = []
            self.gathered = versions

    def free(self) -> None:
        for pending in self.pending:
            pending.wait()
        self.pending = []
        if self.gathered is not None:
            self._free_storage()
            self.gathered = None

    def _free_storage(self) -> None:
        for w in self.storages:
            _resize(w, 0)

    def _use(self, gathered: bool) -> None:
        """Put the full Parameters (or the sharded ones back) into the unit's layers."""
        for zp in self.params:
            p = zp.gathered if gathered else zp.param
            for where, attr in zp.holders:
                where[attr] = p

    # -- hooks ------------------------------------------------------------------------------
    def before_forward(self) -> None:
        if not capture_running():
            self.start_gather()  # (before the next unit's prefetch)
        self.model.forward_started(self)
        self.wait_gather()
        self.in_use = True
        self._use(True)

    def after_forward(self, out, inputs=()):
        self._use(False)
        self.in_use = False
        self.model.unit_done(self)
        grad = torch.is_grad_enabled()
        # an output that is one of the unit's inputs handed back (T5's blocks return the
        # position bias they were given) gets its gradient from other units: not a sign
        # that this unit's backward comes next
        given = {id(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in given] if grad else []
        for t in outs:  # their gradients arrive before the unit's backward runs: gather there
            t.register_hook(self.before_backward)
        # the unit whose backward comes first keeps its parameters, and so does one whose
        # outputs cannot carry the regather (none found): until the end of backward
        self.keep = grad and (not outs or self is self.model.last)
        if not self.keep:
            self.free()

    def before_backward(self, _grad=None) -> None:
        if not capture_running():
            self.start_gather()  # (before the previous unit's prefetch)
        self.model.backward_started(self)
        self.wait_gather()

    def grad_ready(self, i: int) -> None:
        full = self.params[i].gathered
        g, full.grad = full.grad, None
        # (one gradient per backward; a second one here comes after a backward that raised)
        self.grads[i] = g if i not in self.grads else self.grads[i] + g
        self.model.backward_started(None)
        if len(self.grads) == self.trainable:
            self.reduce()
            if self.trainable == len(self.params):  # (frozen ones may still be needed)
                self.free()

    def reduce(self) -> None:
        """Start reducing the gradients collected (to the sharded parameters' placements)."""
        if not self.grads or self.reduction is not None:
            return
        idx = sorted(self.grads)
        grads = [cast_dist(self.grads[i], self.reduce_dtype) for i in idx]
        plans = [grad_plan(g._spec, self.params[i].param._spec) for i, g in zip(idx, grads)]
        self.reduction = (idx, GradReduction(grads, plans, BUCKET_BYTES))  # (one collective per unit)
        self.grads = {}

    def deliver(self) -> None:
        if self.reduction is None:
            return
        idx, reduction = self.reduction
        self.reduction = None
        with torch.no_grad():
            for i, g in zip(idx, reduction.finish()):
                p = self.params[i].param
                g = cast_dist(g, p.dtype)  # (reduced in the policy's dtype: into the float32 .grad)
                p.grad = g if p.grad is None else p.grad + g
