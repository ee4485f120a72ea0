"""DistTensor: a torch.Tensor that stands for a global tensor and holds this rank's piece.

Autograd sees the global tensor (shape, dtype); every aten op reaching it goes through
`dispatch.dispatch`, which asks the SPMD rules where each operand must be, reshards, and
runs the op on the local pieces.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils import _foreach_utils

from ..comm.backend import value_read
from ..comm.collectives import reading_values as _reading_values
from ..comm.fake import readable
from ..spec import DistSpec


_MAKE_WRAPPER = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def new_dist(local: torch.Tensor, spec: DistSpec, requires_grad: bool = False) -> "DistTensor":
    """Wrap `local` as this rank's piece of `spec` (the op dispatch's hot path calls this)."""
    meta = spec.meta
    # positional (size, strides, storage_offset, memory_format, dtype, layout, device, pin_memory,
    # requires_grad): torch's argument parser takes them 0.3 us faster than keywords
    r = _MAKE_WRAPPER(
        DistTensor, meta.shape, meta.stride, None, None, meta.dtype, _STRIDED, local.device, False, requires_grad
    )
    r._local = local
    r._spec = spec
    return r


def local_piece(t):
    """This rank's piece of a DistTensor; any other value as it is."""
    return t._local if type(t) is DistTensor else t


def _value_read(what: str, method):
    """torch's `method` of a tensor run as the value read `what` (see `DistTensor`'s reads)."""

    def read(self):
        with value_read(what):
            return method(self)

    read.__name__ = method.__name__
    return read


class DistTensor(torch.Tensor):
    """A distributed tensor: global meta + this rank's local piece.

    Build one with `shard_tensor`, `dtensor_from_local` or `dtensor_from_fn`.  Its local piece
    never carries a lazy conjugate or negation bit (inside `__torch_dispatch__` torch turns off
    the keys that apply them): a piece given with one has it applied, and the ops that would
    set one (`conj()`, `_neg_view`) apply it (see `dispatch`).
    """

    _local: torch.Tensor
    _spec: DistSpec
    # (storage key, offset, contiguous, spec) of the piece a Partial tensor had before it was reduced
    # in place: views made earlier still look at that storage (dispatch._reduced_view)
    _reduced_from: tuple
    # no slots of its own: `torch.utils.swap_tensors` converts a plain Parameter in place
    # (shard_layer) only into a class of the same layout
    __slots__ = ()

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: DistSpec, requires_grad: bool = False):
        if not _TORCH_SET_UP[0]:
            _first_dist_tensor()
        return new_dist(local.resolve_conj().resolve_neg(), spec, requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _ops.dispatch(func, args, kwargs or _NO_KWARGS)

    # -- the distributed view -------------------------------------------------------
    @property
    def process_mesh(self):
        """The ProcessMesh the tensor lives on."""
        return self._spec.mesh

    @property
    def placements(self) -> list:
        """One Placement per mesh dim."""
        return list(self._spec.placements)

    @property
    def dist_spec(self) -> DistSpec:
        return self._spec

    def local_value(self) -> torch.Tensor:
        """This rank's piece as a plain tensor (differentiable; empty off the mesh)."""
        from .convert import local_value  # (convert builds on this class)

        return local_value(self)

    _local_value = local_value

    def is_dist(self) -> bool:
        return True

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """torch's backward; from a mean loss whose count is not reduced yet, with the count
        carried by the gradient buckets and the gradients scaled once it is (`deferred_mean`)."""
        means = _means.MEANS
        if not (means.pending and gradient is None and inputs is None and not create_graph
                and means.backward(self, retain_graph)):
            torch.Tensor.backward(self, gradient, retain_graph, create_graph, inputs)

    # -- conversions to Python give the global value --------------------------------
    # Collective over the job: each runs on the value-read groups (`comm.value_read`), so
    # a read made on some ranks only is reported instead of pairing with training traffic.
    def full_value(self) -> torch.Tensor:
        from .convert import full_value

        with value_read("full_value()"):
            return full_value(self)

    item = _value_read(".item()", torch.Tensor.item)
    __bool__ = _value_read("bool()", torch.Tensor.__bool__)
    __float__ = _value_read("float()", torch.Tensor.__float__)
    __int__ = _value_read("int()", torch.Tensor.__int__)

    def tolist(self):
        _reading_values("tolist")
        with value_read(".tolist()"):
            return readable(self.full_value()).tolist()

    def numpy(self, *args, **kwargs):
        _reading_values("numpy")
        with value_read(".numpy()"):
            return readable(self.full_value().detach()).cpu().numpy(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None):
        with value_read("print/repr"):
            value = self.full_value().detach()
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"DistTensor({value}, mesh={self._spec.mesh.process_ids} shape={self._spec.mesh.shape}, "
            f"placements={list(self._spec.placements)}{grad})"
        )

    def __reduce_ex__(self, proto):
        raise TypeError(
            "a DistTensor is not picklable: use autopar.save_state_dict for checkpoints "
            "or .full_value() for the dense value"
        )

    def __deepcopy__(self, memo):
        new = DistTensor(self._local.detach().clone(), self._spec, requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter) or getattr(self, "_is_param", False):
            from .convert import distributed_parameter

            new = distributed_parameter(new, self.requires_grad)
        memo[id(self)] = new
        return new


# What autopar adds to torch's own globals waits for the first distributed tensor, made by
# `DistTensor(...)` (every one not computed from another is: shard_tensor, dtensor_from_local,
# dtensor_from_fn, ZeRO-3's conversion of plain parameters, a loaded checkpoint), never for
# `import autopar`: importing a library must not change how torch behaves for others.
_TORCH_SET_UP = [False]


def _foreach_support() -> None:
    """torch's gradient clipping takes its foreach path (one `_foreach_norm` over every
    gradient, one `_foreach_mul_` to scale them) only for the tensor types listed here; per
    tensor, each sharded gradient's norm would be an all-reduce of its own."""
    if DistTensor not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(DistTensor)


_TORCH_SETUPS: list = [_foreach_support]  # run by the first distributed tensor


def on_first_dist_tensor(setup: Callable[[], None]) -> None:
    """Run `setup` (it teaches torch's globals something about distributed tensors) when the
    first distributed tensor is made, or now if one has been."""
    if _TORCH_SET_UP[0]:
        setup()
    else:
        _TORCH_SETUPS.append(setup)


def _first_dist_tensor() -> None:
    _TORCH_SET_UP[0] = True
    for setup in _TORCH_SETUPS:
        setup()
    _TORCH_SETUPS.clear()


_NO_KWARGS: dict = {}
# every aten op on a DistTensor: `dispatch.dispatch` (which builds on this class, so it is
# bound as a module and looked up when an op runs)
from . import dispatch as _ops  # noqa: E402
# a mean loss handed out before its count is reduced, and its backward (`deferred_mean`)
from . import deferred_mean as _means  # noqa: E402
