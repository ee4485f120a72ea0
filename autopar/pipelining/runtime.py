"""Running this rank's part of a pipeline order: compute, transfers posted ahead, time kept.

An *executor* says what each action receives (`incoming`), computes (`compute`: returns
the values for each outgoing end) and sends (`outgoing`); the runner does the rest, for
stage modules and captured programs alike.  Receives are posted a few actions ahead (the
bytes move while the rank computes) and sends return at once (waited at the end of the
step), so a rank blocks only for a message it needs now.  A problem on this rank (a stage
that raised, an output whose shape changed) stops the computing, not the transfers: the
rank still takes every message it was promised and sends zeros (or a failure note) for
every one it promised, then every rank raises the same error at the end of the step,
before any optimizer could use the gradients.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import torch

from .. import comm
from .agree import Problem, agree
from .orders import Action
from .transfer import Inbox, Outbox, UpstreamFailed

LOOKAHEAD = 3  # actions whose receives are posted before the current one runs


class StepTimes(NamedTuple):
    """Where one rank's step went, in seconds: computing, posting and finishing sends, and
    idle (the bubble: waiting for a message, or at the step's end for the ranks still busy)."""

    compute: float
    send: float
    idle: float
    total: float


def open_channels(links) -> None:
    """Make the channel of every remote end in `links`, ordered by (ranks, name): a channel is
    made by both its ranks together, and one order shared by all ranks never leaves two ranks
    each waiting for the other's channel."""
    ends = [(tuple(sorted((comm.get_rank(), x.peer))), x.channel) for x in links if isinstance(x, (Inbox, Outbox))]
    for pair, name in sorted(set(ends)):
        comm.channel_group(pair, name)


class OrderRunner:
    """Runs `order` (this rank's actions) with `executor` (incoming, outgoing, compute)."""

    def __init__(self, executor, order: list):
        self.executor, self.order = executor, order

    def run(self, what: str) -> StepTimes:
        self.problem: Optional[Problem] = None
        self.sends: list = []
        self.t_compute = self.t_send = self.t_idle = 0.0
        start = time.perf_counter()
        incoming = [self.executor.incoming(a) for a in self.order]
        ahead = [(k, link) for k, links in enumerate(incoming) for link in links]
        through = [sum(len(links) for links in incoming[:k + 1]) for k in range(len(incoming))]
        posted = 0
        for k, a in enumerate(self.order):
            while posted < len(ahead) and ahead[posted][0] < k + LOOKAHEAD:
                if not ahead[posted][1].post_ahead():
                    break
                posted += 1
            received = [self._take(link, a) for link in incoming[k]]
            posted = max(posted, through[k])  # (take() posts what was not posted yet)
            self._act(a, received)
            self.sends = [w for w in self.sends if not w.is_completed()]
        t0 = time.perf_counter()
        for w in self.sends:
            w.wait()
        t1 = time.perf_counter()
        self.t_send += t1 - t0
        agree(self.problem, tuple(range(comm.get_world_size())), what)
        self.t_idle += time.perf_counter() - t1  # waiting for the ranks that finish last
        return StepTimes(self.t_compute, self.t_send, self.t_idle, time.perf_counter() - start)

    def _take(self, link, a: Action):
        t0 = time.perf_counter()
        try:
            return link.take()
        except UpstreamFailed as e:
            self._fail(f"stage {a.stage} (rank {comm.get_rank()}) got nothing for {a.kind}{a.mb}: {e}", None)
        except ValueError as e:
            self._fail(str(e), e)
        finally:
            self.t_idle += time.perf_counter() - t0
        return None

    def _fail(self, message: str, cause: Optional[BaseException]) -> None:
        if self.problem is None:
            self.problem = Problem(message, cause)

    def _act(self, a: Action, received: list) -> None:
        values: dict = {}
        if self.problem is None:
            t0 = time.perf_counter()
            try:
                values = self.executor.compute(a, received)
            except Exception as e:  # the step fails on every rank at its end (see module doc)
                self._fail(f"stage {a.stage} (rank {comm.get_rank()}), {a.kind}{a.mb}: {type(e).__name__}: {e}", e)
            self.t_compute += time.perf_counter() - t0
        for link in self.executor.outgoing(a):
            self._send(link, values.get(link))

    def _send(self, link, values) -> None:
        t0 = time.perf_counter()
        if self.problem is None:
            try:
                self.sends += link.send(values)
            except ValueError as e:
                self._fail(str(e), e)
        if self.problem is not None:
            self.sends += link.send_failed(self.problem.message)
        self.t_send += time.perf_counter() - t0


def format_times(times: Optional[StepTimes], ranks: tuple) -> str:
    """One row per rank of `ranks` with its last step's times (collective over `ranks`)."""
    if times is None:
        raise RuntimeError("format_times: run a step first")
    mine = torch.tensor(list(times), dtype=torch.float64, device=comm.current_device())
    rows = comm.all_gather(mine, ranks) if len(ranks) > 1 else [mine]
    lines = ["rank  compute ms  send ms  idle ms (bubble)  total ms"]
    for r, (c, s, i, t) in zip(ranks, (row.tolist() for row in rows)):
        lines.append(f"{r:>4}  {c * 1e3:>10.2f}  {s * 1e3:>7.2f}  {i * 1e3:>7.2f} ({i / t:>5.1%})  {t * 1e3:>8.2f}")
    return "\n".join(lines)
