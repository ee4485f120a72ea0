"""Tied parameters across stages (`shared_parameters`): one logical parameter, one copy per stage.

Every rank names the tied parameters the same way (`[{"params": [emb.weight, head.weight]}]`
from its own copy of the model); each finds which of them its stages hold, and the pipeline's
ranks compare notes once: an entry naming a parameter no stage holds, or copies of different
shapes, fail on every rank.  The copies start equal (the first holder's value is broadcast)
and every step sums their gradients over the stages that hold them before the optimizer
runs, so they stay equal.
"""
from __future__ import annotations

import json

import torch

from .. import comm
from ..api.tensors import reshard
from ..tensor.dtensor import DistTensor, new_dist
from .agree import Problem, gather_text, agree


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local if type(t) is DistTensor else t


class TiedParameters:
    """The tied copies this rank holds, and the ranks each tie spans."""

    def __init__(self, stages: list, ranks: tuple):
        entries = next((s.shared_parameters for s in stages if s.shared_parameters), None) or []
        held_by_me = {}
        for e, entry in enumerate(entries):
            for j, p in enumerate(entry["params"]):
                if any(p is q for s in stages for q in s.module.parameters()):
                    held_by_me.setdefault(e, []).append(j)
        mine = {"entries": len(entries), "held": {str(e): js for e, js in held_by_me.items()},
                "shapes": [[list(p.shape) for p in entry["params"]] for entry in entries]}
        notes = [json.loads(t) for t in gather_text(json.dumps(mine), ranks)] if len(ranks) > 1 else [mine]
        agree(_check(notes, ranks, entries), ranks, "shared_parameters")
        self.ties = []  # (this rank's copies, the ranks holding a copy)
        for e, entry in enumerate(entries):
            holders = tuple(r for r, n in zip(ranks, notes) if str(e) in n["held"])
            copies = list({id(q): q for q in (entry["params"][j] for j in held_by_me.get(e, []))}.values())
            if copies:
                self.ties.append((copies, holders))
        self._equalize()

    def _equalize(self) -> None:
        """Every copy takes the value of the first holder's first copy."""
        with torch.no_grad():
            for copies, holders in self.ties:
                value = _local(copies[0]).detach().clone()
                if len(holders) > 1:
                    value = comm.broadcast(value, holders[0], holders)
                for p in copies:
                    _local(p).copy_(value)

    def sum_grads(self) -> None:
        """Give every copy the sum of all copies' gradients."""
        with torch.no_grad():
            for copies, holders in self.ties:
                grads = [self._placed_grad(p) for p in copies]
                total = grads[0].clone()
                for g in grads[1:]:
                    total.add_(g)
                if len(holders) > 1:
                    total = comm.all_reduce(total, holders, inplace=True)
                for n, p in enumerate(copies):
                    g = total if n == 0 else total.clone()
                    p.grad = new_dist(g, p._spec) if type(p) is DistTensor else g

    @staticmethod
    def _placed_grad(p: torch.Tensor) -> torch.Tensor:
        """This copy's gradient as a local piece placed like the parameter (zeros if it has none)."""
        if p.grad is None:
            return torch.zeros_like(_local(p))
        if type(p) is DistTensor:
            return reshard(p.grad, p._spec.mesh, p._spec.placements)._local
        return p.grad


def _check(notes: list, ranks: tuple, entries: list):
    counts = {n["entries"] for n in notes}
    if len(counts) > 1:
        return Problem(f"shared_parameters: the pipeline's ranks name different numbers of ties "
                       f"({dict(zip(ranks, (n['entries'] for n in notes)))})")
    for e, entry in enumerate(entries):
        shapes = notes[0]["shapes"][e]
        held = set()
        for n in notes:
            held.update(n["held"].get(str(e), []))
        for j, p in enumerate(entry["params"]):
            if j not in held:
                return Problem(f"shared_parameters[{e}]['params'][{j}] (shape {list(p.shape)}) is held by no stage "
                               f"of the pipeline on ranks {list(ranks)}")
        if any(s != shapes[0] for s in shapes):
            return Problem(f"shared_parameters[{e}]: the tied parameters have different shapes {shapes}")
    return None
