"""The exact mean of a data-parallel loss with no collective before its backward.

A mean cross-entropy over a batch split on the ranks divides the sum of the losses by C, the
number of targets not ignored, which only the ranks together know: reduced in the forward, it
is an all-reduce every rank waits in before backward (DDP, which averages each rank's own
mean, has none).  Instead the forward keeps this rank's (sum, count) and hands the loss out
pending (`nll_loss`'s kernel offers the pair: `spmd.softmax.MeanTaker`):

- a backward from it (`loss.backward()`, the loss its root, no gradient on any leaf it
  reaches) runs with the count taken as N, every target (known from the shape), while the
  pair rides in the first gradient bucket all-reduced over the same ranks (`riders`; posted
  when the backward ends where no bucket took it).  When the backward ends every gradient it
  made is multiplied by N / C (exactly 1 where no target was ignored) and the loss holds its
  value: the gradients and the loss of the exact mean, with no collective of their own.
- whatever else reads the loss first (an op on it, `.item()`, a reshard, `autograd.grad`, a
  backward through another root) reduces the pair there, as the exact forward did; so does
  a backward whose gradients may not all land in its leaves' `.grad` where the factor can
  reach them (see `_leaves`: ZeRO-2/3, a reentrant checkpoint, a hook on a parameter).

During that backward a hook on an intermediate tensor sees its gradient scaled by C / N
(DDP's hooks see a rank's own unaveraged gradient the same way), as does an intermediate's
`retain_grad()` gradient; what lands in the leaves' `.grad` is exact.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.autograd.function import BackwardCFunction

from .. import comm
from ..comm.observers import capture_running
from ..placement import ReduceType, Replicate
from ..spmd.softmax import defer_means_to
from . import grad_landing, riders
from .dtensor import new_dist
from .observers import watching

_CARRIED = (torch.float32, torch.float64)  # loss dtypes whose sum rides exactly as the forward's would
_MOST_PENDING = 16  # losses neither read nor backpropagated: the oldest is reduced beyond this


class PendingMean:
    """One loss handed out before its (sum, count) was reduced: `loss` and `total` are the
    locals of the loss and of the total weight its backward divides by."""

    __slots__ = ("pair", "loss", "total", "n", "ranks", "rider", "leaves")

    def __init__(self, loss_sum: torch.Tensor, count: torch.Tensor, n: int, ranks: tuple):
        self.pair = torch.stack([loss_sum, count])  # this rank's (sum, count)
        self.loss = torch.empty_like(loss_sum)  # the value, once reduced
        self.total = torch.full_like(count, n)  # the count backward divides by: every target until reduced
        self.n, self.ranks = n, ranks
        self.rider: Optional[riders.MeanParts] = None
        self.leaves: list = []

    def reduce(self) -> None:
        """Reduce the pair now (the exact forward's collective, later)."""
        both = comm.all_reduce(self.pair, self.ranks, ReduceType.SUM)
        self._hold(both[0], both[1])

    def _hold(self, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        """The loss's value and its backward's count, from the sums over the ranks."""
        self.loss.copy_(loss_sum / count)
        self.total.copy_(count)

    def finish(self) -> None:
        """The backward from the loss has ended: take the pair from the bucket that carried
        it (or reduce it now), give the loss its value and every gradient that backward made
        the factor N / C."""
        grad_landing.settle_all()  # (the buckets in flight arrive before their gradients are scaled)
        rider, self.rider = self.rider, None
        if rider is None or rider.withdraw():
            self.reduce()
        else:
            loss_sum, count = rider.result()
            self._hold(loss_sum.to(self.loss.dtype), count.to(self.total.dtype))
        grads: dict = {}
        for leaf in self.leaves:
            g = leaf.grad
            if g is not None:
                g = getattr(g, "_local", g)
                grads.setdefault(g.device, []).append(g)
        self.leaves = []
        factor = self.n / self.total
        for device, group in grads.items():
            torch._foreach_mul_(group, factor.to(device))


class _Means:
    """The MeanTaker of the distributed tensor (see the module doc); the losses it holds."""

    def __init__(self):
        self.pending: list[PendingMean] = []
        self._watch: Optional[contextlib.AbstractContextManager] = None

    def take(self, loss_sum, count, targets, ranks):
        if (not torch.is_grad_enabled() or capture_running() or loss_sum.dtype not in _CARRIED
                or len(ranks) > riders.MOST_RANKS):
            return None
        if len(self.pending) >= _MOST_PENDING:
            self._drop(self.pending[0]).reduce()
        p = PendingMean(loss_sum, count, targets, ranks)
        self.pending.append(p)
        if self._watch is None:  # every op is looked at only while a loss is pending
            self._watch = watching(self)
            self._watch.__enter__()
        return p.loss, p.total

    def _drop(self, p: PendingMean) -> PendingMean:
        self.pending.remove(p)
        if not self.pending and self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
        return p

    def of(self, local: torch.Tensor) -> Optional[PendingMean]:
        for p in self.pending:
            if p.loss is local or p.total is local:
                return p
        return None

    def see(self, func, decision, flat) -> None:
        """An op is about to run: a pending loss among its operands is reduced first (in a
        backward, its total weight is read by nll_loss's backward as it is)."""
        if torch._C._current_graph_task_id() != -1:
            return
        for t in flat:
            self.read(t)

    def read(self, t: torch.Tensor) -> None:
        """`t`'s value is about to be read: if it is a pending loss, reduce it."""
        p = self.of(getattr(t, "_local", None))
        if p is not None:
            self._drop(p).reduce()

    def before_backward(self, total: torch.Tensor) -> None:
        """A backward reaches nll_loss without `backward()` allowing it to run on the guess
        (`autograd.backward(loss, grad)`, `autograd.grad`): the count is reduced here, in it."""
        p = self.of(total)
        if p is not None:
            self._drop(p).reduce()

    def backward(self, root, retain_graph) -> bool:
        """`root.backward()` where `root` is a pending loss whose backward may run before its
        count is known (see the module doc); False where it is not one."""
        p = self.of(root._local)
        if p is None:
            return False
        self._drop(p)
        leaves = _leaves(root)
        if leaves is None:
            p.reduce()  # (gradients there already, or put where the factor cannot reach them)
            return False
        p.leaves = leaves
        p.rider = riders.offer_mean(p.pair[0], p.pair[1], p.ranks)
        spec = root._spec.with_placements([Replicate()] * root._spec.mesh.ndim)
        try:
            torch.Tensor.backward(root, new_dist(torch.ones_like(p.loss), spec), retain_graph)
        finally:  # (a backward that raised too: the loss keeps its value, the bucket is not left with the rider)
            p.finish()
        return True


def _leaves(root: torch.Tensor) -> Optional[list]:
    """The leaves a backward from `root`, a loss on its mesh's ranks, accumulates gradients
    into, each with none yet; None where one has a gradient already, or where a gradient may
    go elsewhere than into the `.grad` of leaves on those ranks (all scale them alike): a leaf on
    other ranks (a pipeline's earlier stage, experts on a sub-mesh; a plain leaf unless the
    loss spans the job), a leaf's post-accumulate hook (ZeRO-2 and -3 move them), a leaf's
    tensor hook that does more than place its gradient, a custom autograd Function from
    outside autopar (a reentrant checkpoint accumulates into leaves its own backward reaches)."""
    mesh = root._spec.mesh
    ranks = frozenset(mesh.process_ids)
    everywhere = len(ranks) == comm.get_world_size()
    seen, stack, leaves = set(), [root.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # (AccumulateGrad's)
        if variable is not None:
            spec = getattr(variable, "_spec", None)
            if (variable.grad is not None or variable._post_accumulate_grad_hooks
                    or (spec.mesh is not mesh and frozenset(spec.mesh.process_ids) != ranks if spec is not None
                        else not everywhere)
                    or not all(getattr(h, "only_places", False) for h in (variable._backward_hooks or {}).values())):
                return None
            leaves.append(variable)
            continue
        if isinstance(fn, BackwardCFunction) and not fn._forward_cls.__module__.startswith("autopar."):
            return None
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


MEANS = _Means()
defer_means_to(MEANS)
