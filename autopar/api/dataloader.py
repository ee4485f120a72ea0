"""shard_dataloader: batches come out as distributed tensors sharded on the batch dim.

When the loader has a batch sampler and a map-style dataset, each rank fetches only the
samples of its own piece of every batch (the split rule of spec.py), so no rank reads or
collates the whole batch.  Otherwise the batch is read whole and cut locally.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..comm import get_rank
from ..mesh import ProcessMesh
from ..placement import Replicate, Shard
from ..spec import split_range
from .tensor import dtensor_from_local, shard_tensor


class ShardDataloader:
    """Iterable (and callable, as the seed's `dataloader()`) over distributed batches."""

    def __init__(
        self,
        dataloader,
        meshes: Union[ProcessMesh, Sequence[ProcessMesh]],
        input_keys: Optional[Sequence[str]] = None,
        shard_dims=None,
        is_dataset_splitted: bool = False,
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

    def __len__(self) -> int:
        return len(self.loader)

    def __call__(self):
        return iter(self)

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

    def _wrap(self, t, m: int, global_rows: Optional[int]):
        if not isinstance(t, torch.Tensor):
            return t
        mesh = self.meshes[m]
        placements = self._placements(m, t)
        if global_rows is None:  # the full batch on every rank: cut locally
            return shard_tensor(t, mesh, placements)
        shape = (global_rows,) + tuple(t.shape[1:])
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
        out = [(k, self._wrap(v, self._mesh_for(i, len(items)), global_rows)) for i, (k, v) in enumerate(items)]
        if kind == "dict":
            return {**batch, **dict(out)}
        if kind == "single":
            return out[0][1]
        return kind(v for _, v in out)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self):
        if self.is_dataset_splitted:
            for batch in self.loader:
                yield self._convert(batch, self._splitted_rows(batch))
            return
        sampler = getattr(self.loader, "batch_sampler", None)
        dataset = getattr(self.loader, "dataset", None)
        if sampler is None or not hasattr(dataset, "__getitem__") or self._needs_whole_batch():
            for batch in self.loader:
                yield self._convert(batch, None)
            return
        collate = self.loader.collate_fn
        for indices in sampler:
            mine = self._my_indices(list(indices))
            yield self._convert(collate([dataset[i] for i in mine]), len(indices))

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

    def _splitted_rows(self, batch) -> int:
        """Global batch size when each rank's loader yields its own part (all parts equal)."""
        items, _ = self._items(batch)
        first = next((v for _, v in items if isinstance(v, torch.Tensor)), None)
        if first is None or first.dim() == 0:
            return None
        _, parts = self._piece(0, get_rank())
        return first.shape[0] * parts


def shard_dataloader(
    dataloader,
    meshes: Union[ProcessMesh, Sequence[ProcessMesh]],
    input_keys: Optional[Sequence[str]] = None,
    shard_dims=None,
    is_dataset_splitted: bool = False,
) -> ShardDataloader:
    """Wrap a DataLoader so its batches are distributed tensors.

    Each tensor is sharded on its batch dim (dim 0) over mesh dim `shard_dims` (a name or
    index per mesh; None replicates).  With several meshes (pipeline), inputs go to the
    first mesh and labels (the last batch item) to the last.  A batch that does not divide
    evenly is split with the library's uneven rule (first pieces one row longer).

    >>> import torch, autopar as dist
    >>> loader = torch.utils.data.DataLoader(torch.arange(8.).reshape(4, 2), batch_size=2)
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> [b.placements for b in dist.shard_dataloader(loader, mesh, shard_dims="dp")]
    [[Shard(0)], [Shard(0)]]
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted)


__all__ = ["ShardDataloader", "shard_dataloader"]
