"""Expert parallel: each token goes to the rank holding its expert and comes back, by two
all-to-alls with uneven splits.

The experts' grouped weights ([experts, ...]) are split Shard(0) over one mesh dim (the "ep"
group), so each rank holds `experts / ep` consecutive experts; the tokens are split over the
same dim (each rank routes its own).  One MoE call on rank r:

1. route: its (token, k) pairs sorted by expert (stable), so the rows for rank j are one run;
   the per-expert counts are exchanged first (an all-to-all of `experts` integers), so every
   rank knows how many rows it receives from each rank for each of its experts;
2. dispatch: the sorted token rows (a token once per chosen expert) go to their expert's
   rank, one all-to-all;
3. the local experts run on what arrived (the experts module's own forward, on its local
   weights: HF's grouped GEMM or loop, whatever the model uses);
4. combine: the results go back by the reverse all-to-all, are scaled by their routing
   weights where the token lives and summed per token.

The all-to-all's backward is the reverse all-to-all, so a backward moves each token's
gradient twice as well, and the gradients of tokens, routing weights and expert weights are
those of the single-process computation: an expert's weight gradient is whole on its rank
(every token routed to it came there), summed over the other mesh dims the tokens are split
on.  A rank that routes no token to some rank, or receives none, sends and receives empty
runs; an expert that receives no token gets a zero gradient.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence

import torch

from ..comm import collectives, get_rank
from ..placement import Partial, Replicate, Shard
from ..spec import DistSpec, TensorMeta
from ..tensor.convert import FromLocal, reshard_to
from ..tensor.dtensor import DistTensor, new_dist


class AllToAll(torch.autograd.Function):
    """Rows [sum(send[:j]), ...) of `x` to member j of `ranks`; `recv[j]` rows from j.  The
    gradient goes back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list, recv: list, ranks: tuple):
        ctx.send, ctx.recv, ctx.ranks = send, recv, ranks
        return collectives.all_to_all(x.contiguous(), send, recv, ranks)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.ranks), None, None, None


class Routing:
    """Where this rank's (token, k) pairs go and what it receives.

    `order`: the pairs (flattened [tokens, k]) sorted by expert, `restore` its inverse;
    `tokens`: the token of each sorted pair; `send` / `recv`: rows to / from each member of the group; `local_expert`:
    the local expert (0 .. experts/ep - 1) of each received row, in arrival order.

    On the meta device (`simulate` of a model too big to hold) the routing has no values, so
    it is taken as balanced, the planner's own assumption: each rank's tokens * k pairs spread
    evenly over the experts (tokens * k / experts each; a remainder one more each to the first
    experts), every rank of the group routing as many tokens.  The counts' exchange still
    runs, so the collectives and their bytes are those of a real run routed so."""

    __slots__ = ("k", "order", "restore", "tokens", "send", "recv", "local_expert")

    def __init__(self, index: torch.Tensor, num_experts: int, ranks: tuple):
        size = len(ranks)
        per_rank = num_experts // size
        flat = index.reshape(-1)
        self.k = index.shape[-1] if index.dim() > 1 else 1
        self.order = torch.argsort(flat, stable=True)
        self.restore = torch.empty_like(self.order)  # where each (token, slot) pair sits in `order`
        self.restore[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        self.tokens = torch.div(self.order, self.k, rounding_mode="floor")
        if index.is_meta:
            self._balanced(flat, num_experts, ranks)
            return
        counts = torch.bincount(flat, minlength=num_experts)
        got = collectives.all_to_all(counts, [per_rank] * size, [per_rank] * size, ranks)  # [source, local expert]
        # the split sizes are read into Python: a captured program (to_static) cannot replay them
        collectives.reading_values("the expert routing's split sizes (.tolist())")
        self.send = counts.view(size, per_rank).sum(1).tolist()
        self.recv = got.view(size, per_rank).sum(1).tolist()
        self.local_expert = torch.repeat_interleave(
            torch.arange(per_rank, device=index.device).repeat(size), got.to(index.device))

    def _balanced(self, flat: torch.Tensor, num_experts: int, ranks: tuple) -> None:
        size, pairs = len(ranks), flat.numel()
        per_rank = num_experts // size
        counts = [pairs // num_experts + (e < pairs % num_experts) for e in range(num_experts)]
        collectives.all_to_all(flat.new_empty(num_experts), [per_rank] * size, [per_rank] * size, ranks)
        mine = ranks.index(get_rank())
        self.send = [sum(counts[j * per_rank:(j + 1) * per_rank]) for j in range(size)]
        self.recv = [self.send[mine]] * size
        self.local_expert = flat.new_empty(sum(self.recv))


def dispatch_combine(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     ranks: tuple, run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * expert[index[t, k]](hidden[t]) for this rank's tokens (plain local
    tensors), the experts split evenly over `ranks`: `run_experts(rows, local_expert)` runs
    this rank's experts, row i through its local expert `local_expert[i]`."""
    route = Routing(index, num_experts, ranks)
    if hidden.is_meta:
        _meta_grouped_mm_takes_fp32()
    # (index_select, not hidden[tokens]: the same rows, and its backward, an index_add, is faster
    # on CPU than indexing's accumulating index_put)
    rows = AllToAll.apply(hidden.index_select(0, route.tokens), route.send, route.recv, ranks)
    done = run_experts(rows, route.local_expert)
    back = AllToAll.apply(done, route.recv, route.send, ranks)
    # each token's k rows back in (token, slot) order, weighted and summed over k, as HF's
    # experts combine them (an index_add into the tokens would keep all k rows once more for
    # its backward, which torch saves its source for, and sum in the experts' order)
    weighted = back.index_select(0, route.restore) * weights.reshape(-1, 1)
    return weighted.view(hidden.shape[0], route.k, -1).sum(1).to(hidden.dtype)


_META_GROUPED_MM: list = []  # the kernel registration, once made


def _meta_grouped_mm_takes_fp32() -> None:
    """Let `_grouped_mm`'s meta kernel take what its CPU kernel takes (see spmd.registry's
    META_OUTPUTS): the experts of a model simulated on meta run it on plain meta tensors, in
    fp32 as HF calls it, forward and backward.  Registered once, the first time experts run
    on meta; the shapes still come from torch's own meta function, at bf16."""
    if _META_GROUPED_MM:
        return
    from torch._meta_registrations import meta_grouped_mm

    def meta(a, b, offs=None, bias=None, out_dtype=None):
        bf = torch.bfloat16
        out = meta_grouped_mm(a.to(bf), b.to(bf), offs, None if bias is None else bias.to(bf), out_dtype)
        return out.to(out_dtype or a.dtype)

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that it overrides the meta kernel: it is meant to)
        lib.impl("_grouped_mm", meta, "Meta")
    _META_GROUPED_MM.append(lib)


# -- the distributed boundary -----------------------------------------------------------------
class _Pieces(torch.autograd.Function):
    """Distributed tensors -> their local pieces; each gradient comes back as a distributed
    tensor placed by `grad_specs` (a None gradient, an expert that got no token, as zeros)."""

    @staticmethod
    def forward(ctx, grad_specs: tuple, *tensors):
        ctx.grad_specs = grad_specs
        out = [t._local.view_as(t._local) for t in tensors]
        # (a piece whose tensor needs no gradient gets none: no backward computes it)
        ctx.mark_non_differentiable(*[o for o, t in zip(out, tensors) if not t.requires_grad])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(None if spec is None else new_dist(g.contiguous(), spec)
                        for g, spec in zip(grads, ctx.grad_specs)))


def _grad_spec(spec: DistSpec, placements: Sequence) -> DistSpec:
    return DistSpec(spec.mesh, tuple(placements), TensorMeta.contiguous(spec.shape, spec.meta.dtype))


def token_placements(spec: DistSpec, ep: int) -> tuple:
    """The placements the tokens ([tokens, ...]) are routed under: split on dim 0 over mesh dim
    `ep` (each rank routes its own), as they are on every other dim where they are split on
    dim 0 or whole, whole where they are anything else."""
    return tuple(Shard(0) if k == ep else p if p in (Shard(0), Replicate()) else Replicate()
                 for k, p in enumerate(spec.placements))


def expert_parallel(hidden: DistTensor, index: DistTensor, weights: DistTensor, params: list, ep: int,
                    num_experts: int, run_local: Callable[[list, torch.Tensor, torch.Tensor], torch.Tensor]):
    """The MoE experts' output for distributed tokens `hidden` [tokens, hidden], their chosen
    experts `index` and routing `weights` [tokens, k], with the experts' grouped weights
    `params` split Shard(0) over mesh dim `ep`.  Tokens not split over `ep` are cut there (no
    communication) and the output gathered back.  `run_local(local params, rows,
    local_expert)` runs this rank's experts.  The output is placed like the (cut) tokens."""
    mesh = params[0]._spec.mesh
    if get_rank() not in mesh:  # another pipeline stage's layer: no piece here, nothing sent
        return hidden.clone()
    placements = token_placements(hidden._spec, ep)
    inputs = [reshard_to(t, t._spec.with_placements(placements)) for t in (hidden, index, weights)]
    spec = inputs[0]._spec
    split = [type(p) is Shard and mesh.shape[k] > 1 for k, p in enumerate(placements)]
    param_grads = tuple(
        _grad_spec(p._spec, [q if k == ep or not split[k] else Partial() for k, q in enumerate(p._spec.placements)])
        for p in params)
    grad_specs = (_grad_spec(spec, placements), None, _grad_spec(inputs[2]._spec, placements)) + param_grads
    local = _Pieces.apply(grad_specs, *inputs, *params)
    ranks = mesh.dim_group_of(get_rank(), ep)
    out = dispatch_combine(local[0], local[1], local[2], num_experts, ranks,
                           lambda rows, experts: run_local(list(local[3:]), rows, experts))
    out = FromLocal.apply(out, spec)
    return out if placements == hidden._spec.placements else reshard_to(out, hidden._spec)


def block_grad_specs(spec: DistSpec, params: Sequence[DistTensor], experts: frozenset, ep: int) -> Optional[tuple]:
    """Whether a token-wise MoE block (each token's output depends on its own hidden state
    alone, as in HF's MoE blocks) can run whole on this rank's tokens `spec` as plain torch:
    the gradient specs of the tokens and of `params` when it can, else None.  It can when the
    tokens are split over mesh dim `ep` (on any dim but the hidden one, the last) and split so
    or whole on the other mesh dims, and the parameters are whole but the experts' (ids in
    `experts`), split Shard(0) over `ep` alone.  A parameter's gradient is then Partial on
    the mesh dims the tokens are split on, but the experts' on `ep` (every token routed to an
    expert came to its rank)."""
    mesh, last = spec.mesh, len(spec.shape) - 1
    split = []
    for k, p in enumerate(spec.placements):
        if type(p) is Shard and p.dim != last:
            split.append(mesh.shape[k] > 1)
        elif type(p) is Replicate and (k != ep or mesh.shape[k] == 1):
            split.append(False)
        else:
            return None
    grads = [_grad_spec(spec, spec.placements)]
    for t in params:
        want = tuple(Shard(0) if k == ep and id(t) in experts else Replicate() for k in range(mesh.ndim))
        if t._spec.mesh != mesh or tuple(t._spec.placements) != want:
            return None
        grads.append(_grad_spec(t._spec, [q if type(q) is Shard or not split[k] else Partial()
                                          for k, q in enumerate(want)]))
    return tuple(grads)


def on_pieces(hidden: DistTensor, params: Sequence[DistTensor], grad_specs: tuple,
              run: Callable[[torch.Tensor, list], torch.Tensor]) -> DistTensor:
    """`run(local tokens, local params)` on this rank's pieces (see `block_grad_specs`), its
    output (shaped as the tokens) placed as the tokens: one boundary for the whole block, its
    gradients placed by `grad_specs`."""
    local = _Pieces.apply(grad_specs, hidden, *params)
    out = run(local[0], list(local[1:]))
    if not isinstance(out, torch.Tensor) or out.shape != local[0].shape:
        raise RuntimeError(f"ExpertParallel: the MoE block returned {type(out).__name__} "
                           f"{list(getattr(out, 'shape', []))} on tokens {list(local[0].shape)}: a block run on "
                           f"its rank's tokens must return one tensor shaped as them")
    spec = hidden._spec if out.dtype == hidden.dtype else DistSpec(
        hidden._spec.mesh, hidden._spec.placements, TensorMeta.contiguous(hidden._spec.shape, out.dtype))
    return FromLocal.apply(out, spec)


def check_experts(num_experts: int, top_k: Optional[int], mesh, ep: int, what: str) -> None:
    """Refuse an expert count the mesh dim does not divide, or a top-k above the expert count."""
    size = mesh.shape[ep]
    if num_experts % size:
        part = math.gcd(num_experts, size)
        fix = (f"split the dim in two, {size // part} x {part}, and name the second 'ep': the experts go over "
               f"its {part} ranks ({num_experts // part} a rank) and data parallel stays over all {size}"
               if part > 1 else f"no ep size above 1 divides both {num_experts} and {size}")
        raise ValueError(
            f"{what}: {num_experts} experts do not divide over mesh dim {mesh.dim_names[ep]!r} of size {size} "
            f"(mesh {mesh}, placement Shard(0)): each rank must hold the same number of experts; {fix}")
    if top_k is not None and top_k > num_experts:
        raise ValueError(f"{what}: top-k {top_k} is larger than the expert count {num_experts}")


__all__ = ["AllToAll", "Routing", "block_grad_specs", "check_experts", "dispatch_combine", "expert_parallel",
           "on_pieces", "token_placements"]
