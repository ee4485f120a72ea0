"""Small sums carried by a gradient bucket's all-reduce instead of a collective of their own.

A data-parallel loader that counts a batch's targets (`shard_dataloader(count_items=...)`)
needs each count summed over the ranks; so does a mean loss, whose backward is run before its
count is known (`deferred_mean`).  Posted alone, such an 8-byte all-reduce costs a rank's
core about what it saves on a CPU machine (BENCHMARKS.md 18k).  A bucket of this step's
gradients is all-reduced over the same ranks in backward (`grad_landing.Landing`): the sums
ride in the spare elements the bucket's buffer keeps after its gradients, and arrive with it.

A count rides as PIECES integers of BITS bits each; every partial sum of a piece over up to
2**(24 - BITS) ranks stays below 2**24, so float32's sum is exact in any order.  A loss's
sum rides as one element, summed in the bucket's dtype.  Every rank offers and takes riders
at the same points of the same program, so a bucket carries the same riders on every rank
(its collective's size is the same everywhere).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..placement import ReduceType

BITS, PIECES = 12, 4
MOST_RANKS = 1 << (24 - BITS)  # the most ranks a count's pieces sum exactly over
SPARE = 2 * PIECES + 1  # elements a bucket's buffer keeps after its gradients: a loader's count and a loss's mean
_CARRIERS = (torch.float32, torch.float64)  # bucket dtypes that sum the pieces exactly
_WAITING: list = []  # riders offered, not yet taken by a bucket
_STARTED: dict = {}  # ranks -> how many buckets over them that could carry a rider have started


class Rider:
    """Values of this rank to be summed over `ranks` by the next bucket that takes it (`width`
    elements of its buffer); `summed` once that bucket has arrived."""

    __slots__ = ("ranks", "width", "summed", "carrier")

    def __init__(self, ranks: tuple, width: int):
        self.ranks, self.width = tuple(ranks), width
        self.summed = None
        self.carrier = None  # the bucket carrying it, until it arrives (set and cleared by the bucket)

    def values(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The `width` elements to sum, in the bucket's dtype."""
        raise NotImplementedError

    def arrived(self, summed: torch.Tensor) -> None:
        """The elements summed over the ranks (no host sync: the sums stay on the device)."""
        raise NotImplementedError

    def result(self):
        """The sums, settling the bucket that carries them if it is still in flight (a
        backward that raised leaves it to the pre-step)."""
        if self.summed is None:
            self.carrier.settle()
        return self.summed

    def withdraw(self) -> bool:
        """Take it off the queue if no bucket has taken it; whether it was still waiting."""
        if self in _WAITING:
            _WAITING.remove(self)
            return True
        return False


def pieces(n: Union[int, torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A count below 2**(BITS * PIECES) as its PIECES pieces (an integer-valued tensor's on its
    device, without reading it)."""
    mask = (1 << BITS) - 1
    if isinstance(n, int):
        return torch.tensor([(n >> (BITS * i)) & mask for i in range(PIECES)], dtype=dtype, device=device)
    shifts = torch.arange(0, BITS * PIECES, BITS, device=n.device)
    return ((n.to(torch.int64) >> shifts) & mask).to(dtype=dtype, device=device)


def count_of(summed_pieces: torch.Tensor) -> torch.Tensor:
    """The count whose pieces were summed: a 0-dim int64 tensor."""
    scale = torch.tensor([1 << (BITS * i) for i in range(PIECES)], dtype=torch.int64, device=summed_pieces.device)
    return (summed_pieces.round().to(torch.int64) * scale).sum()


class Count(Rider):
    """A loader's count `n` (a Python int); `summed` its sum, a 0-dim int64 tensor."""

    __slots__ = ("n",)

    def __init__(self, n: int, ranks: tuple):
        super().__init__(ranks, PIECES)
        self.n = n

    def values(self, dtype, device):
        return pieces(self.n, dtype, device)

    def arrived(self, summed):
        self.summed = count_of(summed)


class MeanParts(Rider):
    """A loss's sum over this rank's targets and their count (0-dim tensors on the device);
    `summed` the pair (sum, count) over the ranks: the sum in the bucket's dtype, the count int64."""

    __slots__ = ("loss_sum", "count")

    def __init__(self, loss_sum: torch.Tensor, count: torch.Tensor, ranks: tuple):
        super().__init__(ranks, PIECES + 1)
        self.loss_sum, self.count = loss_sum, count

    def values(self, dtype, device):
        return torch.cat([pieces(self.count, dtype, device), self.loss_sum.reshape(1).to(dtype=dtype, device=device)])

    def arrived(self, summed):
        self.summed = (summed[PIECES].clone(), count_of(summed[:PIECES]))


def _rides(ranks: tuple) -> bool:
    return len(ranks) <= MOST_RANKS


def offer(n: int, ranks: tuple) -> Optional[Count]:
    """A rider for the count `n` queued for the next bucket over `ranks`, or None where it
    cannot ride (a negative count, one too large for its pieces, more ranks than their sums
    allow)."""
    if not 0 <= n < 1 << (BITS * PIECES) or not _rides(ranks):
        return None
    rider = Count(n, ranks)
    _WAITING.append(rider)
    return rider


def offer_mean(loss_sum: torch.Tensor, count: torch.Tensor, ranks: tuple) -> Optional[MeanParts]:
    """A rider for a loss's (sum, count) queued for the next bucket over `ranks`, or None where
    the ranks are more than the count's pieces sum over (the count is below the number of
    targets, whose shape keeps it far under its pieces' range)."""
    if not _rides(ranks):
        return None
    rider = MeanParts(loss_sum, count, ranks)
    _WAITING.append(rider)
    return rider


def take(ranks: tuple, dtype: torch.dtype, op: ReduceType) -> list:
    """The riders waiting for a bucket summed over `ranks` in `dtype`, in the order offered and
    as many as its spare elements hold, off the queue, as that bucket starts in backward."""
    if dtype not in _CARRIERS or op is not ReduceType.SUM:
        return []
    _STARTED[ranks] = _STARTED.get(ranks, 0) + 1
    taken, room = [], SPARE
    for rider in list(_WAITING):
        if rider.ranks == ranks and rider.width <= room:
            _WAITING.remove(rider)
            taken.append(rider)
            room -= rider.width
    return taken


def buckets_started(ranks: tuple) -> int:
    """How many buckets over `ranks` that could carry a rider have started in backward: a
    loader rides its counts only while a training loop starts them (a rider no bucket takes
    is posted late, at its hand-out)."""
    return _STARTED.get(ranks, 0)
