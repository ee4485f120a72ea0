"""A stage's backward in two steps: the input gradient now, the weight gradients later.

Zero-bubble schedules send the previous stage its input gradient as soon as possible and
compute the weight gradients in what would otherwise be idle time.  `backward_input` runs
autograd to the stage inputs only: nodes that lead to the inputs run, and of each node only
the outputs the inputs need (a linear layer computes dX, not dW).  Hooks on the *frontier*
nodes (those on the way to the inputs that also feed a parameter's subgraph) keep the
gradients that reached them.  `backward_weight` restarts autograd at the frontier with those
gradients and runs only the parameters' subgraphs: nothing on the input path runs twice.
Parameters are grouped by shared frontier nodes, one autograd call per group, so one
group's restart never walks into another's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _grad_node(t: torch.Tensor):
    return get_gradient_edge(t).node


def _parents(roots: list) -> dict:
    """{node: the nodes with an edge into it} over the graph below `roots`."""
    parents: dict = {r: [] for r in roots}
    queue = list(roots)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _above(starts: list, parents: dict, stop=frozenset()) -> tuple[set, set]:
    """Nodes reached from `starts` walking towards the roots, not past `stop`: (walked, stops hit)."""
    walked, hit = set(), set()
    queue = [s for s in starts if s in parents]
    while queue:
        node = queue.pop()
        if node in walked:
            continue
        walked.add(node)
        for parent in parents[node]:
            if parent in stop:
                hit.add(parent)
            elif parent not in walked:
                queue.append(parent)
    return walked, hit


class PendingWeightGrad:
    """What `backward_weight` needs: per parameter group its frontier nodes and their gradients,
    or (`whole`) the outputs and gradients of a backward that could not be split."""

    def __init__(self, groups: list, captured: dict, whole: Optional[tuple] = None):
        self.groups, self.captured, self.whole = groups, captured, whole


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list, PendingWeightGrad]:
    """Gradients of `inputs` (None where unused); the parameters' part is left pending."""
    params = [p for p in params if p.requires_grad]
    roots = [o.grad_fn for o in outputs]
    parents = _parents([r for r in roots if r is not None])
    input_nodes = [_grad_node(x) for x in inputs]
    on_input_path, _ = _above(input_nodes, parents)
    groups: list = []  # [frontier nodes, params], disjoint in frontier nodes
    for p in params:
        walked, frontier = _above([_grad_node(p)], parents, stop=on_input_path)
        if not walked:
            continue  # not used by this micro-batch
        if not frontier or any(r in walked for r in roots):
            # the parameter reaches an output without passing the input path: no split
            return _whole(outputs, grads, inputs)
        joined = [g for g in groups if g[0] & frontier]
        groups = [g for g in groups if not g[0] & frontier]
        groups.append([frontier.union(*(g[0] for g in joined)), [q for g in joined for q in g[1]] + [p]])
    if not inputs or not groups:
        return _whole(outputs, grads, inputs)
    captured: dict = {}
    handles = [node.register_prehook(_keeper(captured, node)) for frontier, _ in groups for node in frontier]
    try:
        found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return list(found), PendingWeightGrad(groups, captured)


def _keeper(captured: dict, node):
    def keep(grad_outputs):
        captured[node] = grad_outputs

    return keep


def _whole(outputs, grads, inputs) -> tuple[list, PendingWeightGrad]:
    """No split: the input gradients now (if any), everything again at the weight step."""
    found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True) if inputs else []
    return list(found), PendingWeightGrad([], {}, whole=(outputs, grads))


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the parameters' gradients (`.grad`) from what `backward_input` left."""
    if pending.whole is not None:
        outputs, grads = pending.whole
        torch.autograd.backward(outputs, grads)
        return
    handed: set = set()
    for frontier, params in pending.groups:
        edges, seeds = [], []
        for node in frontier:
            for i, g in enumerate(pending.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        handles = []
        if len(frontier) > 1:  # a frontier node reached again from another gets its kept gradient only
            handles = [n.register_prehook(_fixed(pending.captured.get(n))) for n in frontier]
        try:
            # (the graph is kept: another group's restart may pass through nodes this one ran;
            # it goes when the stage drops the micro-batch's outputs)
            found = torch.autograd.grad(
                edges, [get_gradient_edge(p) for p in params], seeds, retain_graph=True, allow_unused=True
            )
        finally:
            for h in handles:
                h.remove()
        for p, g in zip(params, found):
            if g is None:
                continue
            if id(g) in handed:  # autograd hands one tensor to several parameters (an add's operands)
                g = g.clone()
            handed.add(id(g))
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
    pending.captured.clear()


def _fixed(grads):
    return lambda _incoming: grads
