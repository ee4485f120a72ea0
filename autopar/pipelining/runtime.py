"""Running this rank's part of a pipeline order: compute, transfers posted ahead, time kept.

Receives are posted a few actions ahead (the bytes move while the rank computes) and sends
return at once (waited at the end of the step), so a rank blocks only for a message it needs
now.  Every stage edge has its own channel, created for the whole pipeline in one global order
before the first step.  A problem on this rank (a stage that raised, an output whose shape
changed) stops the computing, not the transfers: the rank still takes every message it was
promised and sends zeros (or a failure note) for every one it promised, then every rank
raises the same error at the end of the step, before any optimizer could use the gradients.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

import torch

from .. import comm
from .agree import Problem, agree
from .orders import Action
from .transfer import Inbox, LocalPipe, Outbox, UpstreamFailed

LOOKAHEAD = 3  # actions whose receives are posted before the current one runs


class StepTimes(NamedTuple):
    """Where one rank's step went, in seconds: computing, posting and finishing sends, and
    idle (the bubble: waiting for a message, or at the step's end for the ranks still busy)."""

    compute: float
    send: float
    idle: float
    total: float


def _channel(src: int, dst: int) -> str:
    return f"pp{src}>{dst}"


class Runtime:
    """Executes `order` (this rank's actions) over the `stages` this rank holds."""

    def __init__(self, stages: dict, order: list, num_stages: int, ranks: tuple):
        self.stages, self.order, self.num_stages, self.ranks = stages, order, num_stages, ranks
        self.me = comm.get_rank()
        any_stage = next(iter(stages.values()))
        self.rank_of = any_stage.rank_of
        self.act_in, self.act_out, self.grad_in, self.grad_out = {}, {}, {}, {}
        pipes: dict = {}
        for k, stage in stages.items():
            if k > 0:
                self.act_in[k] = self._end(k - 1, k, stage, pipes, "activations")
                self.grad_out[k] = self._end(k, k - 1, stage, pipes, "input gradients")
            if k < num_stages - 1:
                self.act_out[k] = self._end(k, k + 1, stage, pipes, "activations")
                self.grad_in[k] = self._end(k + 1, k, stage, pipes, "input gradients")
        self.links = list(dict.fromkeys(list(self.act_in.values()) + list(self.act_out.values())
                                        + list(self.grad_in.values()) + list(self.grad_out.values())))
        self._open_channels()

    def _end(self, src: int, dst: int, stage, pipes: dict, what: str):
        """This rank's end of the edge src -> dst (stage indices)."""
        a, b = self.rank_of(src), self.rank_of(dst)
        if a == b:
            return pipes.setdefault((src, dst), LocalPipe())
        text = f"stage {src} (rank {a}) -> stage {dst} (rank {b}), {what}"
        if a == self.me:
            return Outbox(_channel(src, dst), b, text, stage.device)
        return Inbox(_channel(src, dst), a, text, stage.device, stage.mesh)

    def _open_channels(self) -> None:
        """Make every channel this rank is on, in one order shared by all ranks (a channel is
        made by both its ranks together: any other order could leave two ranks each waiting
        for the other's channel)."""
        edges = [(k, k + 1) for k in range(self.num_stages - 1)] + [(k + 1, k) for k in range(self.num_stages - 1)]
        for src, dst in sorted(edges):
            a, b = self.rank_of(src), self.rank_of(dst)
            if a != b and self.me in (a, b):
                comm.channel_group((min(a, b), max(a, b)), _channel(src, dst))

    def _incoming(self, a: Action):
        stage = self.stages[a.stage]
        if a.kind == "F" and not stage.is_first:
            return self.act_in[a.stage]
        if a.kind in "BI" and not stage.is_last:
            return self.grad_in[a.stage]
        return None

    # -- one step ------------------------------------------------------------------------------
    def run(self, x_mbs: list, y_mbs: list, loss_fn: Callable, scale: float, what: str) -> tuple[list, StepTimes]:
        """Run the order over the micro-batches; returns the last stage's losses and the times."""
        self.problem: Optional[Problem] = None
        self.sends: list = []
        self.t_compute = self.t_send = self.t_idle = 0.0
        start = time.perf_counter()
        incoming = [self._incoming(a) for a in self.order]
        losses: list = []
        posted = 0
        try:
            for k, a in enumerate(self.order):
                while posted < min(len(self.order), k + LOOKAHEAD):
                    if incoming[posted] is not None and not incoming[posted].post_ahead():
                        break
                    posted += 1
                received = self._take(incoming[k], a) if incoming[k] is not None else None
                posted = max(posted, k + 1)
                self._act(a, received, x_mbs, y_mbs, loss_fn, scale, losses)
                self.sends = [w for w in self.sends if not w.is_completed()]
            t0 = time.perf_counter()
            for w in self.sends:
                w.wait()
            t1 = time.perf_counter()
            self.t_send += t1 - t0
            agree(self.problem, tuple(range(comm.get_world_size())), what)
            self.t_idle += time.perf_counter() - t1  # waiting for the ranks that finish last
        except BaseException:
            for stage in self.stages.values():
                stage.drop_held()
            raise
        times = StepTimes(self.t_compute, self.t_send, self.t_idle, time.perf_counter() - start)
        return losses, times

    def _take(self, link, a: Action):
        t0 = time.perf_counter()
        try:
            return link.take()
        except UpstreamFailed as e:
            self._fail(f"stage {a.stage} (rank {self.me}) got nothing for {a.kind}{a.mb}: {e}", None)
        except ValueError as e:
            self._fail(str(e), e)
        finally:
            self.t_idle += time.perf_counter() - t0
        return None

    def _fail(self, message: str, cause: Optional[BaseException]) -> None:
        if self.problem is None:
            self.problem = Problem(message, cause)

    def _act(self, a: Action, received, x_mbs, y_mbs, loss_fn, scale, losses) -> None:
        stage = self.stages[a.stage]
        result = None
        if self.problem is None and a.kind in "FBIW":
            t0 = time.perf_counter()
            try:
                if a.kind == "F":
                    inputs = x_mbs[a.mb] if stage.is_first else received
                    result = stage.forward(a.mb, inputs, loss_fn, y_mbs[a.mb], scale)
                    if stage.is_last:
                        losses.append(result.detach())
                elif a.kind == "B":
                    result = stage.backward(a.mb, received)
                elif a.kind == "I":
                    result = stage.backward_input(a.mb, received)
                else:
                    stage.backward_weight(a.mb)
            except Exception as e:  # the step fails on every rank at its end (see module doc)
                self._fail(f"stage {a.stage} (rank {self.me}), {a.kind}{a.mb}: {type(e).__name__}: {e}", e)
            self.t_compute += time.perf_counter() - t0
        if a.kind == "F" and not stage.is_last:
            self._send(self.act_out[a.stage], result)
        elif a.kind in "BI" and not stage.is_first:
            self._send(self.grad_out[a.stage], result)

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

    def renew(self) -> None:
        """A new batch signature: every edge states its meta again at its next message."""
        for link in self.links:
            link.renew()


def format_times(times: Optional[StepTimes], ranks: tuple) -> str:
    """One row per rank of `ranks` with its last step's times (collective over `ranks`)."""
    if times is None:
        raise RuntimeError("format_times: run a step first")
    mine = torch.tensor(list(times), dtype=torch.float64)
    rows = comm.all_gather(mine, ranks) if len(ranks) > 1 else [mine]
    lines = ["rank  compute ms  send ms  idle ms (bubble)  total ms"]
    for r, (c, s, i, t) in zip(ranks, (row.tolist() for row in rows)):
        lines.append(f"{r:>4}  {c * 1e3:>10.2f}  {s * 1e3:>7.2f}  {i * 1e3:>7.2f} ({i / t:>5.1%})  {t * 1e3:>8.2f}")
    return "\n".join(lines)
