"""What each action of a `PipelineStage` schedule does on this rank.

F: the stage's forward on a micro-batch (the batch's on the first stage, the previous
stage's output elsewhere) and, on the last stage, the loss; B: the whole backward from the
next stage's input gradient (the loss on the last stage); I and W: the two halves of it.
Each stage edge is an Outbox/Inbox pair between ranks, a LocalPipe on one rank.
"""
from __future__ import annotations

from typing import Callable

from .. import comm
from .orders import Action
from .transfer import Inbox, LocalPipe, Outbox


def _channel(src: int, dst: int) -> str:
    return f"pp{src}>{dst}"


class StageExecutor:
    """The stages this rank holds, wired to their neighbours."""

    def __init__(self, stages: dict, num_stages: int):
        self.stages, self.num_stages = stages, num_stages
        self.me = comm.get_rank()
        self.rank_of = next(iter(stages.values())).rank_of
        self.act_in, self.act_out, self.grad_in, self.grad_out = {}, {}, {}, {}
        pipes: dict = {}
        for k, stage in stages.items():
            if k > 0:
                self.act_in[k] = self._end(k - 1, k, stage, pipes, "activations")
                self.grad_out[k] = self._end(k, k - 1, stage, pipes, "input gradients")
            if k < num_stages - 1:
                self.act_out[k] = self._end(k, k + 1, stage, pipes, "activations")
                self.grad_in[k] = self._end(k + 1, k, stage, pipes, "input gradients")
        self.links = list(dict.fromkeys([*self.act_in.values(), *self.act_out.values(),
                                         *self.grad_in.values(), *self.grad_out.values()]))

    def _end(self, src: int, dst: int, stage, pipes: dict, what: str):
        """This rank's end of the edge src -> dst (stage indices)."""
        a, b = self.rank_of(src), self.rank_of(dst)
        if a == b:
            return pipes.setdefault((src, dst), LocalPipe())
        text = f"stage {src} (rank {a}) -> stage {dst} (rank {b}), {what}"
        if a == self.me:
            return Outbox(_channel(src, dst), b, text, stage.device)
        return Inbox(_channel(src, dst), a, text, stage.device, stage.mesh)

    def begin(self, x_mbs: list, y_mbs: list, loss_fn: Callable, scale: float) -> None:
        self.x_mbs, self.y_mbs, self.loss_fn, self.scale = x_mbs, y_mbs, loss_fn, scale
        self.losses: list = []

    def renew(self) -> None:
        """A new batch signature: every edge states its meta again at its next message."""
        for link in self.links:
            link.renew()

    def drop_held(self) -> None:
        for stage in self.stages.values():
            stage.drop_held()

    # -- the executor interface of OrderRunner ------------------------------------------------
    def _ends(self, a: Action) -> tuple[list, list]:
        """(where `a` receives from, where it sends to)."""
        stage = self.stages[a.stage]
        if a.kind == "F":
            return ([] if stage.is_first else [self.act_in[a.stage]]), ([] if stage.is_last else [self.act_out[a.stage]])
        if a.kind == "W":
            return [], []
        return ([] if stage.is_last else [self.grad_in[a.stage]]), ([] if stage.is_first else [self.grad_out[a.stage]])

    def incoming(self, a: Action) -> list:
        return self._ends(a)[0]

    def outgoing(self, a: Action) -> list:
        return self._ends(a)[1]

    def compute(self, a: Action, received: list) -> dict:
        stage = self.stages[a.stage]
        if a.kind == "F":
            inputs = self.x_mbs[a.mb] if stage.is_first else received[0]
            out = stage.forward(a.mb, inputs, self.loss_fn, self.y_mbs[a.mb], self.scale)
            if stage.is_last:
                self.losses.append(out.detach())
                return {}
            return {self.act_out[a.stage]: out}
        if a.kind == "W":
            stage.backward_weight(a.mb)
            return {}
        grads = None if stage.is_last else received[0]
        found = stage.backward(a.mb, grads) if a.kind == "B" else stage.backward_input(a.mb, grads)
        return {} if stage.is_first else {self.grad_out[a.stage]: found}
