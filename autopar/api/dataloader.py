"""shard_dataloader: batches come out as distributed tensors sharded on the batch dim.

When the loader has a batch sampler and a map-style dataset, each rank fetches only the
samples of its own piece of every batch (the split rule of spec.py), so no rank reads or
collates the whole batch.  Otherwise the batch is read whole (rank 0's batch is the one
cut, see `shard_tensor`).

Shuffling: each rank iterates its own copy of the loader, so every rank must draw the same
order.  Before every epoch the generator the sampler draws from (its own, or torch's global
one) takes rank 0's state: every rank cuts rank 0's permutation, which is the one a single
process seeded like rank 0 draws.  `set_epoch(e)` is passed on to a sampler that has one.

Counting: `count_items(piece)` counts what a loss over the batch divides by (its targets not
ignored) on this rank's piece; the sum over the pieces is handed out with the batch, so a
loss summed over a rank's rows and divided by it is the exact global mean without a
collective in the step's forward, and a model that computes its loss in its forward (HF's)
runs whole as one local region.  `count_window=k` counts k batches in a row together (the
micro-batches of one optimizer step).  The loader then reads one window ahead: the sum's
small all-reduce is posted while the window before runs, or, while a training loop reduces
gradient buckets in backward, rides in the first of them (`tensor/riders.py`: no collective
of its own).

Resuming: `state_dict()` says where the epoch is (how many batches have been handed out, and
the random states its order was drawn from); `load_state_dict(state)` on a fresh loader makes
its next iteration continue with the next batch, on any data-parallel degree (a batch is the
loader's global batch; each rank takes its piece of it).
"""
from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..tensor import riders, rng
from ..comm import Pending, all_reduce_start, current_device, get_rank
from ..mesh import ProcessMesh
from ..placement import Replicate, Shard
from ..spec import split_range
from ..tensor.dtensor import local_piece
from .tensors import dtensor_from_local, shard_tensor


_INFERRED = object()  # a batch item's global size comes from every rank's piece
COUNT_KEY = "num_items_in_batch"  # HF's name: `model(**batch)` passes it to the model's loss


class ShardDataloader:
    """Iterable (and callable, `dataloader()`, as Paddle's guide loops over it) over distributed batches."""

    def __init__(
        self,
        dataloader,
        meshes: Union[ProcessMesh, Sequence[ProcessMesh]],
        input_keys: Optional[Sequence[str]] = None,
        shard_dims=None,
        is_dataset_splitted: bool = False,
        count_items: Optional[Callable[[Any], Union[int, torch.Tensor]]] = None,
        count_window: int = 1,
    ):
        self.loader = dataloader
        self.meshes = [meshes] if isinstance(meshes, ProcessMesh) else list(meshes)
        if not self.meshes or not all(isinstance(m, ProcessMesh) for m in self.meshes):
            raise TypeError(f"shard_dataloader needs a ProcessMesh or a list of them, got {meshes!r}")
        dims = shard_dims if isinstance(shard_dims, (list, tuple)) else [shard_dims] * len(self.meshes)
        if len(dims) != len(self.meshes):
            raise ValueError(f"shard_dims {shard_dims!r} needs one entry per mesh ({len(self.meshes)})")
        self.shard_dims = [None if d is None else m.dim_index(d) for m, d in zip(self.meshes, dims)]
        self.input_keys = list(input_keys) if input_keys is not None else None
        self.is_dataset_splitted = is_dataset_splitted
        if count_items is not None and len(self.meshes) > 1:
            raise ValueError(
                f"shard_dataloader: count_items needs the batch on one mesh; this loader places it on "
                f"{len(self.meshes)} (pipeline stages): count the targets in the step instead"
            )
        if count_window != 1 and count_items is None:
            raise ValueError("shard_dataloader: count_window is the number of batches count_items counts together; "
                             "pass count_items too")
        if not isinstance(count_window, int) or count_window < 1:
            raise ValueError(f"shard_dataloader: count_window must be a positive int (the batches of one optimizer "
                             f"step), got {count_window!r}")
        self.count_items, self.count_window = count_items, count_window
        self.num_items_in_batch: Optional[torch.Tensor] = None  # the global count of the last batch handed out
        self._handed_out = 0  # batches of the current epoch
        # buckets able to carry a count started in backward when the last window read ahead
        # was counted (`riders.buckets_started`; None before the first)
        self._buckets_seen: Optional[int] = None
        self._epoch_states: list = []  # (generator, state) each draw of this epoch's order started from
        self._resume: Optional[dict] = None

    def __len__(self) -> int:
        return len(self.loader)

    def __call__(self):
        return iter(self)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the loader's samplers that take one (DistributedSampler-style
        samplers reshuffle by epoch); a sampler drawing from a generator needs none."""
        for sampler in self._samplers():
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    # -- resuming ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches of the current epoch handed out so far and the random states the epoch's
        order was drawn from (the same on every rank: rank 0's).  Save it with the model."""
        return {"batches": self._handed_out, "random_states": [state.clone() for _, state in self._epoch_states]}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue an epoch after `state["batches"]` batches, in the
        order `state_dict()` recorded (the random states of the job are left as they are)."""
        if set(state) != {"batches", "random_states"}:
            raise ValueError(f"ShardDataloader.load_state_dict: expected the keys batches and random_states, "
                             f"got {sorted(state)}")
        self._resume = state

    def _generators(self) -> list:
        """The generators this epoch's order is drawn from: the loader's (its workers' seed),
        then each sampler's (torch's global one where it has none)."""
        found = [getattr(self.loader, "generator", None) or torch.default_generator]
        for sampler in self._samplers():
            if hasattr(sampler, "generator"):
                g = sampler.generator or torch.default_generator
                if all(g is not f for f in found):
                    found.append(g)
        return found

    @contextlib.contextmanager
    def _drawing_the_epoch(self):
        """Around the draws of an epoch's order: record the states they start from, or, resuming
        mid-epoch, draw from the recorded states and give the job its own states back after."""
        generators = self._generators()
        resume, self._resume = self._resume, None
        if resume is None or not resume["batches"]:
            self._epoch_states = [(g, g.get_state()) for g in generators]
            yield 0
            return
        if len(resume["random_states"]) != len(generators):
            raise ValueError(f"ShardDataloader.load_state_dict: the state has {len(resume['random_states'])} random "
                             f"states, this loader draws its order from {len(generators)} generators")
        now = [g.get_state() for g in generators]
        self._epoch_states = list(zip(generators, resume["random_states"]))
        for g, state in self._epoch_states:
            g.set_state(state)
        try:
            yield resume["batches"]
        finally:
            for g, state in zip(generators, now):
                g.set_state(state)

    # -- one order on every rank -------------------------------------------------------------
    def _samplers(self) -> list:
        loader = self.loader
        found = []
        for s in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
            if s is not None and all(s is not f for f in found):
                found.append(s)
        return found

    def _same_order_on_every_rank(self) -> None:
        """Give every generator the loader's samplers draw from rank 0's state."""
        for sampler in self._samplers():
            if isinstance(sampler, torch.utils.data.DistributedSampler) and sampler.num_replicas > 1:
                raise ValueError(
                    f"shard_dataloader: the loader's DistributedSampler already splits the data over "
                    f"{sampler.num_replicas} replicas; shard_dataloader splits each batch itself: give the loader "
                    f"a plain sampler, or pass is_dataset_splitted=True if each rank's loader yields its own part"
                )
            if hasattr(sampler, "generator"):
                rng.agree_with_rank0(sampler.generator or torch.default_generator)

    # -- placement of each batch item -------------------------------------------------------
    def _mesh_for(self, index: int, count: int) -> int:
        """Inputs to the first mesh, labels (the last item) to the last mesh."""
        if len(self.meshes) == 1:
            return 0
        return len(self.meshes) - 1 if index == count - 1 and count > 1 else min(index, len(self.meshes) - 1)

    def _placements(self, m: int, t: torch.Tensor) -> list:
        mesh, dim = self.meshes[m], self.shard_dims[m]
        placements = [Replicate()] * mesh.ndim
        if dim is not None and t.dim() > 0:
            placements[dim] = Shard(0)
        return placements

    def _wrap(self, t, m: int, global_rows):
        """`global_rows`: the global batch size of this rank's piece `t`; None: `t` is the whole
        batch; _INFERRED: a piece whose global size the pieces of all ranks tell."""
        if not isinstance(t, torch.Tensor):
            return t
        mesh = self.meshes[m]
        placements = self._placements(m, t)
        if global_rows is None:
            return shard_tensor(t, mesh, placements)
        shape = None if global_rows is _INFERRED else (global_rows,) + tuple(t.shape[1:])
        return dtensor_from_local(t, mesh, placements, shape=shape)

    def _items(self, batch):
        if isinstance(batch, dict):
            keys = self.input_keys or list(batch.keys())
            return [(k, batch[k]) for k in keys], "dict"
        if isinstance(batch, (list, tuple)):
            return list(enumerate(batch)), type(batch)
        return [(0, batch)], "single"

    def _convert(self, batch, global_rows: Optional[int]):
        items, kind = self._items(batch)
        if global_rows is not _INFERRED:
            rows = global_rows if global_rows is not None else next(
                (v.shape[0] for _, v in items if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            self._check_rows(rows)
        out = [(k, self._wrap(v, self._mesh_for(i, len(items)), global_rows)) for i, (k, v) in enumerate(items)]
        if kind == "dict":
            return {**batch, **dict(out)}
        if kind == "single":
            return out[0][1]
        return kind(v for _, v in out)

    def _check_rows(self, rows: Optional[int]) -> None:
        """Every rank that a batch is split over needs at least one sample of it (the same
        verdict on every rank: they all see the same batch sizes)."""
        for mesh, dim in zip(self.meshes, self.shard_dims):
            if rows is None or dim is None or rows >= mesh.shape[dim]:
                continue
            raise ValueError(
                f"shard_dataloader: a batch of {rows} samples cannot be split over the {mesh.shape[dim]} ranks of "
                f"mesh dim '{mesh.dim_names[dim]}' (data-parallel degree {mesh.shape[dim]}): every rank needs at "
                f"least one sample. This is usually the loader's last, short batch: pass drop_last=True to the "
                f"DataLoader (or make the dataset size a multiple of the batch size)"
            )

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self):
        self._handed_out = 0
        batches = self._batches() if self.count_items is None else self._counted(self._batches())
        for batch in batches:
            self._handed_out += 1
            yield batch

    def _counted(self, batches):
        """The batches with their global counts, a window (`count_window` batches) at a time,
        read one window ahead: the sum of a window's counts over its batches and the ranks
        (one 8-byte all-reduce) is posted when the window before it is handed out and has
        mostly arrived by the time it is handed out itself (a mean loss's count all-reduce
        waits in the forward instead; docs/training.md, The loss)."""
        k = self.count_window
        window = list(itertools.islice(batches, k))
        if self._handed_out % k:  # (`_resumed` has set where the epoch goes on)
            raise ValueError(
                f"ShardDataloader: the loaded state handed out {self._handed_out} batches, not a whole number of "
                f"count windows of {k} batches: save the state at the end of an optimizer step"
            )
        current = (window, self._count_start(window, ride=False)) if window else None  # (needed at once)
        while current is not None:
            window = list(itertools.islice(batches, k))
            ahead = (window, self._count_start(window, ride=True)) if window else None
            count = self._arrived(current[1])
            for batch in current[0]:
                yield self._with_count(batch, count)
            current = ahead

    def _count_start(self, window: list, ride: bool):
        """`count_items` of this rank's pieces of the window's batches; their sum over the
        ranks holding the other pieces offered to the next gradient bucket (a `riders.Count`)
        where it may `ride` and buckets have started in backward since the last window was
        counted (a training loop), else posted (a `comm.Pending`); the count itself where no
        other rank holds a piece."""
        mesh, dim, rank = self.meshes[0], self.shard_dims[0], get_rank()
        if rank not in mesh:
            return None
        n = sum(self._count_of(batch) for batch in window)
        if dim is None or mesh.shape[dim] == 1:
            return n
        ranks = mesh.dim_group_of(rank, dim)
        rider = None
        if ride:
            seen, self._buckets_seen = self._buckets_seen, riders.buckets_started(ranks)
            rider = riders.offer(n, ranks) if seen not in (None, self._buckets_seen) else None
        return rider if rider is not None else _count_posted(n, ranks)

    def _count_of(self, batch) -> int:
        n = self.count_items(_pieces(batch))
        if isinstance(n, torch.Tensor) and n.numel() == 1 and not (n.is_floating_point() or n.is_complex()):
            n = n.item()
        if isinstance(n, (bool, torch.Tensor)) or not hasattr(n, "__index__"):
            raise TypeError(f"shard_dataloader: count_items must return an integer or a one-element integer "
                            f"tensor, got {n!r}")
        return operator.index(n)

    @staticmethod
    def _arrived(count) -> Optional[torch.Tensor]:
        """A window's count as handed out: a 0-dim int64 tensor on the job's device, as HF's
        Trainer passes it (a tensor, not an int: a module run as a local region is keyed by a
        tensor argument's shape, by an int's value, so every new count would verify it again).
        A rider no bucket took (the loop has stopped reducing in backward) is posted now."""
        if isinstance(count, riders.Count):
            count = _count_posted(count.n, count.ranks) if count.withdraw() else count.result()
        if isinstance(count, Pending):
            return count.wait().reshape(())
        if isinstance(count, torch.Tensor):
            return count
        return None if count is None else torch.tensor(count, dtype=torch.int64, device=current_device())

    def _with_count(self, batch, count: Optional[torch.Tensor]):
        """`batch` with its count; `num_items_in_batch` is one tensor for the loader's life,
        written with each count: a step captured by `to_static` that divides by it reads the
        count of each batch it replays (a new tensor each batch would be captured as the first
        batch's constant).  A dict batch's item is the batch's own tensor."""
        if count is not None and self.num_items_in_batch is not None:
            self.num_items_in_batch.copy_(count)
        elif count is not None:
            self.num_items_in_batch = count.clone()
        if count is None or not isinstance(batch, dict):
            return batch
        if COUNT_KEY in batch:
            raise ValueError(f"shard_dataloader: the batch already has a {COUNT_KEY!r} item; count_items would "
                             f"replace it: drop one of them")
        return {**batch, COUNT_KEY: count}

    def _batches(self):
        if self.is_dataset_splitted:
            for batch in self._resumed(lambda: iter(self.loader)):
                yield self._convert(batch, _INFERRED)
            return
        self._same_order_on_every_rank()
        sampler = getattr(self.loader, "batch_sampler", None)
        dataset = getattr(self.loader, "dataset", None)
        map_style = hasattr(dataset, "__getitem__") and not isinstance(dataset, torch.utils.data.IterableDataset)
        if sampler is None or not map_style or self._needs_whole_batch():
            for batch in self._resumed(lambda: iter(self.loader)):
                yield self._convert(batch, None)
            return

        def indices():
            # the draw a DataLoader iterator makes (its workers' base seed) before its sampler's:
            # the random stream then goes on as when the loader itself is iterated
            torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
            return iter(sampler)

        collate = self.loader.collate_fn
        for batch_indices in self._resumed(indices):
            self._check_rows(len(batch_indices))
            mine = self._my_indices(list(batch_indices))
            yield self._convert(collate([dataset[i] for i in mine]), len(batch_indices))

    def _resumed(self, start):
        """`start()`, the epoch's iterator (its draws fix the epoch's order), advanced past the
        batches a loaded state had handed out: a sampler's by their indices alone, a loader's
        read and dropped (it has no other way to skip).  The sampler draws at the first."""
        with self._drawing_the_epoch() as skip:
            batches = start()
            for _ in range(skip):
                next(batches)
        self._handed_out = skip
        return batches

    def _needs_whole_batch(self) -> bool:
        """Per-rank reading needs every item on a mesh this rank shards the same way."""
        rank = get_rank()
        pieces = {self._piece(m, rank) for m in range(len(self.meshes)) if rank in self.meshes[m]}
        return len(pieces) != 1 or len(self.meshes) > 1

    def _piece(self, m: int, rank: int) -> tuple:
        mesh, dim = self.meshes[m], self.shard_dims[m]
        if dim is None:
            return (0, 1)
        return (mesh.coordinate(rank)[dim], mesh.shape[dim])

    def _my_indices(self, indices: list) -> list:
        rank = get_rank()
        if rank not in self.meshes[0]:
            return []
        index, parts = self._piece(0, rank)
        a, b = split_range(len(indices), parts, index)
        return indices[a:b]


def _count_posted(n: int, ranks: tuple) -> Pending:
    """The all-reduce of this rank's count `n` over `ranks`, posted (on the device the job's
    collectives run on: NCCL reduces no host tensor)."""
    return all_reduce_start(torch.tensor([n], dtype=torch.int64, device=current_device()), ranks)


def _pieces(batch):
    """A handed-out batch with each distributed tensor replaced by this rank's piece."""
    if isinstance(batch, dict):
        return {k: local_piece(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(local_piece(v) for v in batch)
    return local_piece(batch)


def shard_dataloader(
    dataloader,
    meshes: Union[ProcessMesh, Sequence[ProcessMesh]],
    input_keys: Optional[Sequence[str]] = None,
    shard_dims=None,
    is_dataset_splitted: bool = False,
    count_items: Optional[Callable[[Any], Union[int, torch.Tensor]]] = None,
    count_window: int = 1,
) -> ShardDataloader:
    """Wrap a DataLoader so its batches are distributed tensors.

    Each tensor is sharded on its batch dim (dim 0) over mesh dim `shard_dims` (a name or
    index per mesh; None replicates).  With several meshes (pipeline), inputs go to the
    first mesh and labels (the last batch item) to the last.  A batch that does not divide
    evenly is split with the library's uneven rule (first pieces one row longer); one with
    fewer samples than ranks to split it over is refused (a short last batch: pass the
    loader drop_last=True).  A shuffled
    loader gives every rank rank 0's order (collective: every rank iterates the loader).

    `count_items(piece)`, given this rank's piece of a batch (plain tensors, the batch's
    structure), returns what a loss over it divides by, e.g. its targets not ignored; the sum
    over the pieces, a 0-dim int64 tensor on the job's device, is `loader.num_items_in_batch`
    (one tensor, written with each batch's count: a `to_static` step dividing by it reads each
    batch's) and, for a dict batch, its `"num_items_in_batch"` item (the batch's own tensor; HF
    models take it: `model(**batch)` divides the summed loss by it).  The step's loss is then
    a sum over a known count: it stays Partial, with no collective before backward.  Under gradient accumulation pass
    `count_window=k` (the micro-batches of one optimizer step): each of k batches in a row
    gets the count over all k, so the summed micro-batch losses, each over that count, are
    the exact mean over the step's batches (HF's Trainer's count).  To post the sum early the
    loader reads one window ahead.

    >>> import torch, autopar as dist
    >>> loader = torch.utils.data.DataLoader(torch.arange(8.).reshape(4, 2), batch_size=2)
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> [b.placements for b in dist.shard_dataloader(loader, mesh, shard_dims="dp")]
    [[Shard(0)], [Shard(0)]]
    >>> targets = torch.utils.data.DataLoader(torch.tensor([3, -100, 5, 7]), batch_size=4)
    >>> counted = dist.shard_dataloader(targets, mesh, shard_dims="dp", count_items=lambda t: (t != -100).sum())
    >>> [int(counted.num_items_in_batch) for _ in counted]
    [3]
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, count_items, count_window)


__all__ = ["ShardDataloader", "shard_dataloader"]
