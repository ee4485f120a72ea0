"""Small integer sums carried by a gradient bucket's all-reduce instead of a collective of their own.

A data-parallel loader that counts a batch's targets (`shard_dataloader(count_items=...)`)
needs each count summed over the ranks.  Posted alone, that 8-byte all-reduce costs a rank's
core about what it saves on a CPU machine (BENCHMARKS.md 18k).  The loader reads a batch
ahead, so the next batch's count is known while this one trains, and a bucket of this step's
gradients is all-reduced over the same ranks in backward (`grad_landing.Landing`): the count
rides in the spare elements the bucket's buffer keeps after its gradients, and arrives with it.

A count rides as PIECES integers of BITS bits each; every partial sum of a piece over up to
2**(24 - BITS) ranks stays below 2**24, so float32's sum is exact in any order.  Every rank
offers and takes riders at the same points of the same program, so a bucket carries one on
every rank or on none (its collective's size is the same everywhere).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..placement import ReduceType

BITS, PIECES = 12, 4
SPARE = PIECES  # elements a bucket's buffer keeps after its gradients
_CARRIERS = (torch.float32, torch.float64)  # bucket dtypes that sum the pieces exactly
_WAITING: list = []  # riders offered, not yet taken by a bucket
_STARTED: dict = {}  # ranks -> how many buckets over them that could carry a rider have started


class Rider:
    """This rank's count `n`, to be summed over `ranks` by the next bucket that takes it;
    `summed` (a 0-dim int64 tensor on the bucket's device) once that bucket has arrived."""

    __slots__ = ("n", "ranks", "summed", "carrier")

    def __init__(self, n: int, ranks: tuple):
        self.n, self.ranks = n, tuple(ranks)
        self.summed: Optional[torch.Tensor] = None
        self.carrier = None  # the bucket carrying it, until it arrives

    def pieces(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        mask = (1 << BITS) - 1
        return torch.tensor([(self.n >> (BITS * i)) & mask for i in range(PIECES)], dtype=dtype, device=device)

    def arrived(self, summed_pieces: torch.Tensor) -> None:
        """The pieces summed over the ranks (no host sync: the sum stays on the device)."""
        scale = torch.tensor([1 << (BITS * i) for i in range(PIECES)], dtype=torch.int64, device=summed_pieces.device)
        self.summed = (summed_pieces.round().to(torch.int64) * scale).sum()
        self.carrier = None

    def result(self) -> torch.Tensor:
        """The sum, settling the bucket that carries it if it is still in flight (a backward
        that raised leaves it to the pre-step)."""
        if self.summed is None:
            self.carrier.settle()
        return self.summed

    def withdraw(self) -> bool:
        """Take it off the queue if no bucket has taken it; whether it was still waiting."""
        if self in _WAITING:
            _WAITING.remove(self)
            return True
        return False


def offer(n: int, ranks: tuple) -> Optional[Rider]:
    """A rider for `n` queued for the next bucket over `ranks`, or None where it cannot ride
    (a negative count, one too large for its pieces, more ranks than their sums allow)."""
    if not 0 <= n < 1 << (BITS * PIECES) or len(ranks) > 1 << (24 - BITS):
        return None
    rider = Rider(n, ranks)
    _WAITING.append(rider)
    return rider


def take(ranks: tuple, dtype: torch.dtype, op: ReduceType) -> Optional[Rider]:
    """The first rider waiting for a bucket summed over `ranks` in `dtype`, off the queue, as
    that bucket starts in backward."""
    if dtype not in _CARRIERS or op is not ReduceType.SUM:
        return None
    _STARTED[ranks] = _STARTED.get(ranks, 0) + 1
    for rider in _WAITING:
        if rider.ranks == ranks:
            _WAITING.remove(rider)
            return rider
    return None


def buckets_started(ranks: tuple) -> int:
    """How many buckets over `ranks` that could carry a rider have started in backward: a
    loader rides its counts only while a training loop starts them (a rider no bucket takes
    is posted late, at its hand-out)."""
    return _STARTED.get(ranks, 0)
