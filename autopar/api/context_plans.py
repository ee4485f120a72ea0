"""Context parallel in `parallelize` plans (Paddle's `PrepareContextParallel` and
`ContextParallel`) and `shard_sequence`, which lays a sequence out over the mesh dim "sep".

    plan = {"model": dist.PrepareContextParallel("p2p"),             # split the inputs over "sep"
            "model.layers.*.self_attn": dist.ContextParallel("p2p")}  # ring attention there

The ring ("p2p") takes the sequence in the load-balanced (head-tail) order, so
PrepareContextParallel("p2p") permutes its inputs' sequence into that order; every layer
but attention works token by token and does not mind, and the attention layers under
ContextParallel("p2p") know the order.  Positions and labels must follow the tokens:
the plan gives the layer `position_ids` of the permuted tokens when its forward takes them
(HF models do), and, at the model, shifts HF-style `labels` by one token before permuting
them (passed as `labels` and `shift_labels`, which HF's causal-LM loss reads unshifted).
"all2all" (Ulysses) keeps the natural order.  Both plans of a model take the same backend.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from ..mesh import ProcessMesh
from ..placement import Shard
from ..runtime.context_parallel import (SEP, SdpaOnSep, check_backend, check_sequence_length, key_padding,
                                        load_balanced_order, sep_size)
from ..runtime.forward_context import forward_within
from ..tensor.dtensor import DistTensor
from .plans import PlanBase, forward_takes, placements_on
from .tensors import reshard, shard_tensor

_IGNORE = -100  # the label HF's (and torch's) cross entropy skips


def shard_sequence(t: torch.Tensor, mesh: ProcessMesh, dim: int = 1, backend: str = "p2p", *,
                   src_data_rank: int | None = 0) -> DistTensor:
    """`t` split on its sequence dim `dim` over the mesh dim "sep", laid out as `backend`'s
    attention takes it: "p2p" (ring) in the load-balanced order (2 x cp chunks, rank r
    holding chunks r and 2*cp-1-r: the global tensor holds the sequence in that order),
    "all2all" (Ulysses) in the natural order.  Other mesh dims keep `t`'s placements.  A
    plain `t` is the mesh's first rank's, sent to the others (`shard_tensor`'s
    `src_data_rank`; None: every rank holds the same `t` and cuts its own piece).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["sep"])
    >>> ids = dist.shard_sequence(torch.arange(8).reshape(1, 8), mesh)
    >>> ids.placements, ids.tolist()  # one rank: chunks 0 and 1 of 2, the order unchanged
    ([Shard(1)], [[0, 1, 2, 3, 4, 5, 6, 7]])
    """
    check_backend(backend, "shard_sequence")
    what = f"shard_sequence of a {list(t.shape)} tensor on dim {dim}"
    cp = sep_size(mesh, what)
    dim = dim % t.dim()
    check_sequence_length(t.shape[dim], cp, backend == "p2p", what)
    if backend == "p2p":
        t = t.index_select(dim, load_balanced_order(t.shape[dim], cp).to(t.device))
    placements = placements_on(t, mesh, **{SEP: Shard(dim)})
    if isinstance(t, DistTensor):
        return reshard(t, mesh, placements)
    return shard_tensor(t, mesh, placements, src_data_rank=src_data_rank)


def _split_over_sep(t: torch.Tensor) -> bool:
    return isinstance(t, DistTensor) and SEP in t._spec.mesh.dim_names and \
        isinstance(t._spec.placements[t._spec.mesh.dim_index(SEP)], Shard)


_MASK_FREE_SDPA = "sdpa_context_parallel"  # HF's sdpa attention under a name HF has no mask builder for


@contextlib.contextmanager
def _hf_attention_without_masks(config) -> Iterator[None]:
    """Within: an HF model of `config` runs its sdpa attention under a name HF knows no mask
    builder for, so it builds none: no causal mask materialized (the attention is causal by
    its flag, which the ring and Ulysses take) and no look at the values of the positions or
    of an all-ones mask (HF's packed-sequence and padding checks read them into Python, which
    a meta tensor in `simulate` cannot answer)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(_MASK_FREE_SDPA, sdpa_attention_forward)
    config._attn_implementation = _MASK_FREE_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


class PrepareContextParallel(PlanBase):
    """Put on the model (the layer taking the token ids): its tensor inputs with a sequence
    dim (dim 1 of [batch, sequence, ...]: ids, embeddings, position ids) are split over the
    mesh dim "sep" as `backend` ("p2p" ring, "all2all" Ulysses) needs (`shard_sequence`).
    A forward taking `position_ids` without being given them gets those of the tokens it
    holds.  An HF model on sdpa attention builds no attention mask while it runs (HF would
    otherwise read its positions, permuted for "p2p", and take them for packed sequences,
    and its mask builder reads the mask's values, which a meta tensor cannot answer): its
    attention is causal by the kernel's flag; any other forward taking `attention_mask`
    without one gets an all-ones mask, which tells an HF model the same.  For "p2p" a 2D
    padding mask given goes to the ring as its key padding instead (HF's masks would follow
    the natural order, not the permuted one).  One taking `use_cache` gets False in
    training (HF's key cache would concatenate the split keys, gathering them).  At the top
    model, HF-style `labels` (passed by keyword) are shifted one token and split alike.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["sep"])
    >>> model = torch.nn.Sequential(torch.nn.Embedding(16, 4))
    >>> plan = {"0": dist.PrepareContextParallel("p2p")}
    >>> model, _ = dist.parallelize(model, mesh=mesh, config={"mp_config": {"parallelize_plan": plan}})
    >>> model(torch.zeros(2, 8, dtype=torch.long)).placements
    [Shard(1)]
    """

    mesh_dim = SEP

    def __init__(self, backend: str = "p2p") -> None:
        check_backend(backend, "PrepareContextParallel")
        self.backend = backend

    def _split(self, t: torch.Tensor, mesh: ProcessMesh) -> torch.Tensor:
        if t.dim() < 2 or _split_over_sep(t):
            return t
        return shard_sequence(t, mesh, 1, self.backend)

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        sep_size(mesh, f"PrepareContextParallel on '{name}'")
        positions, mask = forward_takes(layer, "position_ids"), forward_takes(layer, "attention_mask")
        cache = forward_takes(layer, "use_cache")
        hf_sdpa = getattr(getattr(layer, "config", None), "_attn_implementation", None) == "sdpa"
        scoped: list = []  # the contexts entered for the layer's run (key padding, HF's attention)

        def hook(layer, args, kwargs):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._split(t, mesh), (args, kwargs))
            if cache and layer.training and kwargs.get("use_cache") is None:
                kwargs["use_cache"] = False  # a key cache would gather the split keys back (and is of no use)
            first = next((t for t in list(args) + list(kwargs.values()) if _split_over_sep(t)), None)
            if first is not None and positions and kwargs.get("position_ids") is None:
                # every rank knows the positions: each cuts its own (none sent from the first rank)
                kwargs["position_ids"] = shard_sequence(torch.arange(first.shape[1], device=first.device).unsqueeze(0),
                                                        mesh, 1, self.backend, src_data_rank=None)
            given = kwargs.get("attention_mask")
            keep = given if self.backend == "p2p" and isinstance(given, DistTensor) and given.dim() == 2 else None
            stack = contextlib.ExitStack()
            if first is not None and mask and (given is None or keep is not None):
                if hf_sdpa:  # HF builds no mask at all: the attention is causal by its flag
                    kwargs["attention_mask"] = None
                    stack.enter_context(_hf_attention_without_masks(layer.config))
                else:  # plain: it tells, without reading a distributed value, that HF need build no mask
                    kwargs["attention_mask"] = torch.ones(first.shape[:2], dtype=torch.long, device=first.device)
            stack.enter_context(key_padding(keep))  # the ring applies the padding itself
            scoped.append(stack)
            return args, kwargs

        def leave(*_):
            scoped.pop().close()

        layer.register_forward_pre_hook(hook, with_kwargs=True)
        layer.register_forward_hook(leave, always_call=True)

    def prepare_model(self, model: torch.nn.Module, mesh: ProcessMesh) -> None:
        def hook(_model, args, kwargs):
            labels = kwargs.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not _split_over_sep(labels):
                split = shard_sequence(F.pad(labels[:, 1:], (0, 1), value=_IGNORE), mesh, 1, self.backend)
                kwargs = {**kwargs, "labels": split, "shift_labels": split}
            return args, kwargs

        model.register_forward_pre_hook(hook, with_kwargs=True)


class ContextParallel(PlanBase):
    """Put on an attention layer: while it runs, `F.scaled_dot_product_attention` on its
    sequence-split q, k, v is context parallel over the mesh dim "sep", the ring ("p2p",
    sequence in the load-balanced order PrepareContextParallel("p2p") makes) or Ulysses
    ("all2all").  The rest of the layer (projections, rotary embedding) works token by token.

    >>> import torch, autopar as dist
    >>> dist.ContextParallel("all2all")
    ContextParallel(backend='all2all')
    """

    mesh_dim = SEP

    def __init__(self, backend: str = "p2p") -> None:
        check_backend(backend, "ContextParallel")
        self.backend = backend

    def apply(self, layer: torch.nn.Module, mesh: ProcessMesh, name: str) -> None:
        sep_size(mesh, f"ContextParallel on '{name}'")
        forward_within(layer, lambda: SdpaOnSep(mesh, self.backend, load_balanced=True))


__all__ = ["ContextParallel", "PrepareContextParallel", "shard_sequence"]
