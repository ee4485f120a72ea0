"""One rank of an N-rank job, run in this process without any other: `simulate(world_size, rank)`.

Every collective and transfer goes to torch's fake process group, which returns at once and
moves nothing, so the program makes the same decisions it makes in the real job (the
placements, the reshards, the buckets) and `comm_log` records the same collectives with the
same bytes, while the values that come back are meaningless.  Running each rank (or one
rank per distinct role, `representative_ranks`) of a job this way tells what it will send
and hold without the machines: the planner's exact check on small worlds.  With the model
and the batches on the meta device nothing is allocated, so a rank of a thousand-rank job
of a big model simulates in seconds; `Simulation.memory` reports what the rank holds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref

import numpy as np

import torch.distributed as tdist

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ..comm import backend
from ..runtime.local_region import OBSERVES_ONLY
from ..runtime.zero import zero3
from ..tensor import dispatch
from ..tensor.dispatch import storage_key


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds: its pieces of the parameters, of their gradients and of the
    optimizer states (each storage once), and the most bytes autograd held at once for
    backward (`activations_peak`)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations_peak: int


class SavedActivations:
    """Within: every tensor autograd saves for backward is noted, so that `peak()` tells the
    most bytes held at once under the step's schedule (a pipeline's micro-batches in flight
    included).  A storage counts once however many saved tensors look at it, from its first
    save until autograd releases its last; a distributed tensor counts its local piece.
    Only observes: local regions and checkpointing behave as without it."""

    def __init__(self):
        self.events: list = []  # (storage key, bytes, +1 saved / -1 released, the storage weakly), in order
        self._hooks = None

    def __enter__(self) -> "SavedActivations":
        events = self.events

        def pack(t):
            local = getattr(t, "_local", t)
            saved = _Saved(t, local.untyped_storage())
            key, nbytes, storage = storage_key(local), saved.storage.nbytes(), weakref.ref(saved.storage)
            events.append((key, nbytes, 1, storage))
            weakref.finalize(saved, events.append, (key, nbytes, -1, storage))
            return saved

        setattr(pack, OBSERVES_ONLY, True)  # local regions take these hooks for absent
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _Saved.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def peak(self, exclude=()) -> int:
        """The most bytes saved at once, leaving out the storages in `exclude` (the
        parameters', counted as parameters).  They are told apart by the storage itself, not
        its key: a key is an address, which a storage allocated after an activation's release
        (an optimizer's flat buffer, a gathered parameter) may take again."""
        excluded = {id(s) for s in exclude}
        count: dict = {}
        first: dict = {}
        held = peak = 0
        for key, nbytes, step, storage in self.events:
            if id(storage()) in excluded:
                continue
            n = count.get(key, 0)
            if step > 0 and n == 0:
                first[key] = nbytes
                held += nbytes
                peak = max(peak, held)
            elif step < 0 and n == 1:
                held -= first[key]
            count[key] = n + step
        return peak


class _Saved:
    """What autograd keeps instead of a saved tensor: its release is the tensor's.  It holds
    the storage counted too (a reduced distributed tensor swaps its piece), so that no other
    storage can take its key while it counts."""

    __slots__ = ("tensor", "storage", "__weakref__")

    def __init__(self, tensor, storage):
        self.tensor, self.storage = tensor, storage

    def unpack(self):
        return self.tensor


def _storages(tensors) -> tuple[list, int]:
    """The storages of the local pieces of `tensors` (each once), and their bytes."""
    held = {}
    for t in tensors:
        local = getattr(t, "_local", t)
        held[storage_key(local)] = local.untyped_storage()
    return list(held.values()), sum(s.nbytes() for s in held.values())


def memory(model: torch.nn.Module, optimizer=None, activations: "SavedActivations | None" = None) -> MemoryReport:
    """This rank's bytes for `model` and `optimizer` now (call it after `backward` to see the
    gradients), with the activation peak `activations` saw (0 without).  Buffers, and the
    full parameters ZeRO-3 gathers around a layer's use, count neither as parameters nor
    as activations."""
    params, param_bytes = _storages(model.parameters())
    gathered = [g for g in map(zero3.gathered_piece, model.parameters()) if g is not None]
    held = params + _storages(model.buffers())[0] + _storages(gathered)[0]
    _, grad_bytes = _storages(p.grad for p in model.parameters() if p.grad is not None)
    states = [] if optimizer is None else [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return MemoryReport(
        parameters=param_bytes, gradients=grad_bytes, optimizer_states=_storages(states)[1],
        activations_peak=0 if activations is None else activations.peak(exclude=held),
    )


class Simulation:
    """What `simulate` yields: the rank it plays, and what the body saved for backward."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank
        self.activations = SavedActivations()

    def memory(self, model: torch.nn.Module, optimizer=None) -> MemoryReport:
        """This rank's bytes for `model` and `optimizer` now, and the body's activation peak
        so far (see `memory`)."""
        return memory(model, optimizer, self.activations)


def representative_ranks(mesh, alike=None) -> list[int]:
    """One rank per distinct role of `mesh`, to simulate instead of every rank: ranks whose
    coordinates differ only along the `alike` dims (default: every dim but "pp") do the same
    work on their own pieces, so the first of them stands for all.  For pp x dp x mp that is
    the first rank of each pipeline stage.

    >>> import autopar as dist
    >>> mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["pp", "dp", "mp"])
    >>> dist.representative_ranks(mesh), dist.representative_ranks(mesh, alike=["dp"])
    ([0, 4], [0, 1, 4, 5])

    (The world's first rank also sends plain batches to the others, as their source: the
    other ranks of its role receive them instead.)"""
    return sorted(set(rank_roles(mesh, alike).values()))


def rank_roles(mesh, alike=None) -> dict:
    """{rank: the representative rank of its role} (see `representative_ranks`).

    >>> import autopar as dist
    >>> rank_roles(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"]))
    {0: 0, 1: 0, 2: 2, 3: 2}
    """
    alike = [n for n in mesh.dim_names if n != "pp"] if alike is None else list(alike)
    along = {mesh.dim_index(n) for n in alike}
    roles = {}
    for coord, rank in np.ndenumerate(mesh.mesh):
        first = tuple(0 if i in along else c for i, c in enumerate(coord))
        roles[int(rank)] = int(mesh.mesh[first])
    return roles


@contextlib.contextmanager
def simulate(world_size: int, rank: int, activations: bool = True):
    """Run the body as rank `rank` of a `world_size`-rank job, with no communication.

    >>> import torch, autopar as dist
    >>> with dist.simulate(8, 3), dist.comm_log() as log:
    ...     mesh = dist.ProcessMesh(list(range(8)), dim_names=["dp"])
    ...     t = dist.dtensor_from_local(torch.ones(2, 4), mesh, [dist.Shard(0)], shape=(16, 4))
    ...     full = dist.reshard(t, mesh, [dist.Replicate()])
    >>> full.shape, [(r.op, len(r.ranks), r.bytes) for r in log]
    (torch.Size([16, 4]), [('all_gather', 8, 224)])

    The body must not depend on the values collectives return (a loss read to decide a
    branch gets a meaningless number).  Refused inside a real job.

    The body may build its model and batches on the meta device (`with torch.device("meta"):`,
    `ids.to("meta")`): nothing is allocated or computed, so a rank of a model too big for
    this machine simulates, with the same collectives.  There value reads (`.item()`,
    `bool(t)`, `.tolist()`) read zeros, and a local region's trial run, whose values cannot
    be compared, is taken to agree (as it does on real tensors).

    It yields a `Simulation`: `sim.memory(model, optimizer)` gives the rank's bytes of
    parameters, gradients and optimizer states and the peak of what autograd saved for
    backward during the body (`MemoryReport`).  With `activations=False` that peak is not
    tracked: its saved-tensor hooks make autograd run ops the real job does not (a detach
    per saved tensor unpacked), which a recording of the step's ops (`predict.record_step`)
    must not see.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"simulate: rank {rank} is not in a world of {world_size} ranks")
    if tdist.is_initialized():
        raise RuntimeError("simulate: this process already belongs to a real job; simulate from a plain process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    world = tdist.group.WORLD  # meta tensors go to the same fake backend as CPU ones
    world._register_backend(torch.device("meta"), tdist.ProcessGroup.BackendType.CUSTOM,
                            world._get_backend(torch.device("cpu")))
    _forget_job()
    backend.SIMULATING[0] = True
    sim = Simulation(world_size, rank)
    try:
        with sim.activations if activations else contextlib.nullcontext(), _sdpa_on_meta_as_on_cpu():
            yield sim
    finally:
        backend.SIMULATING[0] = False
        tdist.destroy_process_group()
        _forget_job()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _sdpa_on_meta_as_on_cpu():
    """`F.scaled_dot_product_attention` on meta tensors as on the CPU.  Torch picks sdpa's
    kernel by the tensors' device: on meta, the math decomposition, whose matmuls and softmax
    the rules may shard with collectives the real run never makes; the real CPU run calls the
    fused flash kernel (local on its heads).  Where torch's own choice for these shapes on the
    CPU is that kernel, the simulation calls it too (its meta function gives the shapes).
    The function itself stands in for torch's while simulating (a torch-function mode would
    tax every call, and `--calibrate` times calls under `simulate`); a call made while a mode
    is active (context parallel's) goes to the mode first, whose own call comes back here.
    A function someone else put there (routing to other kernels) is left in place."""
    original = torch._C._nn.scaled_dot_product_attention
    if F.scaled_dot_product_attention is not original:
        yield
        return

    def sdpa(*args, **kwargs):
        if len(args) >= 3 and args[0].is_meta and not torch._C._is_torch_function_mode_enabled() \
                and backend.current_device().type == "cpu":
            return _flash_on_cpu(original, *args, **kwargs)
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _flash_on_cpu(sdpa, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """sdpa on meta q, k, v through the kernel torch chooses for CPU tensors of these shapes
    (as the real run's F.scaled_dot_product_attention does)."""
    def like(t):  # a CPU stand-in of t's shape and dtype, one row allocated
        return None if t is None else torch.zeros(t.shape[-1], dtype=t.dtype).expand(t.shape)

    choice = torch._fused_sdp_choice(like(q), like(k), like(v), like(attn_mask), dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # (as torch converts it first)
        attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                     attn_mask=attn_mask, scale=scale)[0]


def _forget_job() -> None:
    """Drop what this process cached about its job: its rank, groups and decisions."""
    backend.forget_job()
    dispatch.clear_cache()
