"""Context parallel: attention over a sequence split across the ranks of the mesh dim "sep".

Two algorithms, named as Paddle names its backends:
- "p2p", ring attention.  Each rank keeps its query rows; the key/value blocks travel
  around the ring of the "sep" ranks (to the next rank, from the previous one), the next
  block's send and receive posted before the current block's attention runs, so the
  transfer overlaps it.  Block results merge by their log-sum-exp.  The backward runs the
  ring again: K/V travel as in the forward, their gradients follow them one hop behind and
  arrive back at their owner after a full turn.  Every rank sends (cp-1)/cp of K and V per
  forward.  With a causal mask the sequence is split head-tail (load-balanced, "zig-zag"):
  cut into 2*cp chunks, rank r holds chunks r and 2*cp-1-r, so every rank computes the same
  number of query-key blocks (`load_balanced_order` gives the order whose plain split is
  this layout; the global tensor then holds the sequence in that order).  Padding comes as
  a key padding mask that travels with its block (`key_padding`).
- "all2all", Ulysses.  One all-to-all each turns the sequence split of q, k, v into a split
  of the heads, each rank attends over the whole sequence for its heads, and one all-to-all
  turns the output back: four per forward.  Needs query heads divisible by the "sep" size
  (grouped key/value heads are repeated up to it); the sequence stays in its natural order.

`context_parallel(mesh, backend)` makes `F.scaled_dot_product_attention` on distributed
tensors run one of these while it is active (the plans `PrepareContextParallel` and
`ContextParallel` of `autopar.api.context_plans` build on it).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..comm import p2p
from ..comm.backend import channel_group, get_rank
from ..mesh import ProcessMesh
from ..placement import Partial, Replicate, Shard
from ..spec import DistSpec, TensorMeta
from ..tensor.convert import FromLocal, local_value, reshard_to
from ..tensor.dtensor import DistTensor

SEP = "sep"  # the mesh dim context parallel splits the sequence over (Paddle's name)
BACKENDS = ("p2p", "all2all")
_SEQ, _HEADS = 2, 1  # dims of q, k, v: (batch, heads, sequence, head dim)
aten = torch.ops.aten


# -- the layout (pure) ----------------------------------------------------------------------
def check_backend(backend: str, what: str) -> None:
    """Refuse a backend name no algorithm answers to."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {list(BACKENDS)} ('p2p': ring, 'all2all': Ulysses), "
                         f"got {backend!r}")


def sep_size(mesh: ProcessMesh, what: str) -> int:
    """The size of `mesh`'s dim "sep"; a mesh without one is refused, naming `what`."""
    if SEP not in mesh.dim_names:
        raise ValueError(f"{what}: mesh {mesh} has no dim named {SEP!r} (its dims: {mesh.dim_names}); "
                         f"context parallel splits the sequence over 'sep'")
    return mesh.get_dim_size(SEP)


def check_sequence_length(seq_len: int, cp: int, load_balanced: bool, what: str) -> None:
    """Refuse a sequence the split cannot cut evenly, saying how much padding it needs."""
    pieces = 2 * cp if load_balanced else cp
    if seq_len % pieces:
        pad = pieces - seq_len % pieces
        layout = f"2 x {cp} head-tail chunks (the load-balanced split)" if load_balanced else f"{cp} pieces"
        raise ValueError(f"{what}: a sequence of {seq_len} tokens does not cut into {layout} over mesh dim "
                         f"{SEP!r} of size {cp}; pad it by {pad} to {seq_len + pad} (a multiple of {pieces})")


def held_chunks(index: int, cp: int, load_balanced: bool) -> tuple[int, ...]:
    """The global chunks the rank at position `index` of the "sep" ring holds, in order."""
    return (index, 2 * cp - 1 - index) if load_balanced else (index,)


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """The positions of the natural sequence in head-tail order: split evenly over `cp`
    ranks, this order gives rank r chunks r and 2*cp-1-r of 2*cp.

    >>> load_balanced_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    check_sequence_length(seq_len, cp, True, "load_balanced_order")
    chunks = torch.arange(seq_len).chunk(2 * cp)
    return torch.cat([chunks[c] for r in range(cp) for c in held_chunks(r, cp, True)])


def block_pairs(q_chunks: tuple, kv_chunks: tuple, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal diagonal) of the blocks a rank holding query
    chunks `q_chunks` computes against a key/value block holding `kv_chunks`: under a causal
    mask a query chunk sees earlier chunks whole, its own chunk causally, later ones not at all.

    >>> block_pairs((0, 3), (1, 2), causal=True)  # chunk 3 sees chunks 1 and 2 whole
    [(1, 0, False), (1, 1, False)]
    """
    if not causal:
        return [(a, b, False) for a in range(len(q_chunks)) for b in range(len(kv_chunks))]
    return [(a, b, qc == kc) for a, qc in enumerate(q_chunks) for b, kc in enumerate(kv_chunks) if kc <= qc]


# -- one block's attention: the CPU flash kernel, or plain torch elsewhere ----------------------
def _scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _repeated(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query k or v with its heads repeated to the query's."""
    return kv if kv.shape[_HEADS] == heads else kv.repeat_interleave(heads // kv.shape[_HEADS], dim=_HEADS)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Half precision accumulated in fp32, as the attention kernels do."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _acc_zeros(t: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like `t` to accumulate its gradient in (half precision: fp32)."""
    return torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)


def _probabilities(q, k, lse, causal: bool, scale: float, mask) -> torch.Tensor:
    s = (_acc(q) @ _acc(_repeated(k, q.shape[_HEADS])).transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s if lse is None else torch.exp(s - lse.unsqueeze(-1))


def block_forward(q, k, v, causal: bool, scale: Optional[float], mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of q's rows against one key/value block (`mask`: additive, -inf where
    a row may not see a key)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return block_forward_math(q, k, v, causal, scale, mask)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: Optional[float], mask=None) -> tuple:
    """(dq, dk, dv) of one block, given the output and logsumexp of the rows' whole attention:
    the block's share of the gradients (they add up over the blocks)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                          attn_mask=mask, scale=scale)
    return block_backward_math(dout, q, k, v, out, lse, causal, scale, mask)


def block_forward_math(q, k, v, causal: bool, scale: Optional[float], mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` in plain torch (half precision in fp32), for devices without the CPU
    flash kernel."""
    s = _probabilities(q, k, None, causal, _scale(q, scale), mask)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ _acc(_repeated(v, q.shape[_HEADS]))).to(q.dtype), lse


def block_backward_math(dout, q, k, v, out, lse, causal: bool, scale: Optional[float], mask=None) -> tuple:
    """`block_backward` in plain torch: flash attention's backward of one block."""
    sc, heads = _scale(q, scale), q.shape[_HEADS]
    p = _probabilities(q, k, lse, causal, sc, mask)
    do = _acc(dout)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ _acc(_repeated(v, heads)).transpose(-1, -2) - (do * _acc(out)).sum(-1, keepdim=True))
    dq = ds @ _acc(_repeated(k, heads)) * sc
    dk = ds.transpose(-1, -2) @ _acc(q) * sc

    def grouped(g, like):  # a repeated head's gradient summed back into its group
        return g.unflatten(_HEADS, (like.shape[_HEADS], -1)).sum(_HEADS + 1).to(like.dtype)

    return dq.to(q.dtype), grouped(dk, k), grouped(dv, v)


def _merge(acc: Optional[tuple], out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """Two partial attentions of the same rows, combined by their log-sum-exp (half precision
    in fp32)."""
    if acc is None:
        return _acc(out), lse
    total = torch.logaddexp(acc[1], lse)

    def weight(part):  # (a row that has seen no key yet, -inf in both, keeps weight 0)
        return torch.where(total == float("-inf"), 0.0, torch.exp(part - total)).unsqueeze(-1)

    return acc[0] * weight(acc[1]) + _acc(out) * weight(lse), total


# -- the ring ---------------------------------------------------------------------------------
_KV, _DKV = "cp.kv", "cp.dkv"  # the point-to-point channels of the blocks and of their gradients
_CHANNELS = (_KV, _DKV)


class Ring:
    """The ring of "sep" ranks this rank is in, and what every block of it computes."""

    def __init__(self, ranks: tuple, causal: bool, scale: Optional[float], load_balanced: bool):
        me = get_rank()
        self.causal, self.scale = causal, scale
        self.cp, self.index = len(ranks), ranks.index(me)
        self.balanced = load_balanced and causal
        self.next, self.prev = ranks[(self.index + 1) % self.cp], ranks[(self.index - 1) % self.cp]
        # each ring edge's channels made in one global order: made in ring order, every rank
        # would first wait for its next neighbour, who waits for its own next, around the ring
        for pair in sorted({tuple(sorted((me, self.next))), tuple(sorted((self.prev, me)))}):
            for channel in _CHANNELS:
                channel_group(pair, channel)

    def source(self, step: int) -> int:
        """The ring position whose key/value block this rank holds at `step`."""
        return (self.index - step) % self.cp

    def pairs(self, step: int) -> list:
        """The (query chunk, key chunk, causal diagonal) blocks computed at `step`."""
        mine = held_chunks(self.index, self.cp, self.balanced)
        return block_pairs(mine, held_chunks(self.source(step), self.cp, self.balanced), self.causal)

    def chunks(self, t: torch.Tensor, dim: int = _SEQ) -> tuple:
        """A local piece cut into the chunks it holds (one unless load-balanced)."""
        return tuple(c.contiguous() for c in t.chunk(2 if self.balanced else 1, dim=dim))

    def held_block(self, kv: torch.Tensor, k, v, keep) -> tuple:
        """The key/value block packed in `kv` (shaped as this rank's `k`, `v`, `keep`) cut into
        its chunks: (keys, values, key paddings or None)."""
        kb, vb, keepb = _unpack(kv, (k, v, keep))
        return self.chunks(kb), self.chunks(vb), None if keep is None else self.chunks(keepb, 1)

    def block(self, a: int, b: int, diagonal: bool, qs, ks, vs, keeps) -> tuple:
        """(q, k, v, causal, additive mask, rows seeing some key or None) of block (a, b): with
        a key padding (`keeps`, 1 where a key may be seen), the mask holds it and the diagonal."""
        if keeps is None:
            return qs[a], ks[b], vs[b], diagonal, None, None
        q, k = qs[a], ks[b]
        seen = (keeps[b] > 0)[:, None, None, :].expand(q.shape[0], 1, q.shape[_SEQ], k.shape[_SEQ])
        if diagonal:
            seen = seen & torch.ones(seen.shape[-2:], dtype=torch.bool, device=q.device).tril()
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float("-inf"))
        return q, k, vs[b], False, mask, seen.any(-1)

    def pass_on(self, buf: torch.Tensor, channel: str) -> tuple:
        """Post sending `buf` to the next rank and receiving its like from the previous one
        (a captured program replays both posted, as they are here: `comm.inflight`)."""
        incoming = torch.empty_like(buf)
        return p2p.isend(buf, self.next, channel), p2p.irecv(incoming, self.prev, channel)


def _pack(*ts: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts if t is not None])


def _unpack(buf: torch.Tensor, like: tuple) -> list:
    """`buf` cut back into tensors shaped as `like` (None stays None)."""
    given = [t for t in like if t is not None]
    pieces = iter(piece.view(t.shape) for piece, t in zip(buf.split([t.numel() for t in given]), given))
    return [None if t is None else next(pieces) for t in like]


class _RingAttention(torch.autograd.Function):
    """Ring attention on local pieces: q, k, v (batch, heads, local sequence, head dim)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, ring: Ring):
        qs, acc = ring.chunks(q), [None] * (2 if ring.balanced else 1)
        keep = None if keep is None else keep.to(k.dtype)  # travels with its keys
        kv = _pack(k, v, keep)
        for step in range(ring.cp):
            moving = ring.pass_on(kv, _KV) if step < ring.cp - 1 else None
            ks, vs, keeps = ring.held_block(kv, k, v, keep)
            for a, b, diagonal in ring.pairs(step):
                qa, kb_, vb_, causal, mask, seen = ring.block(a, b, diagonal, qs, ks, vs, keeps)
                o, lse = block_forward(qa, kb_, vb_, causal, ring.scale, mask)
                if seen is not None:  # a row seeing no key here: no part of its softmax
                    o, lse = o.masked_fill(~seen.unsqueeze(-1), 0), lse.masked_fill(~seen, float("-inf"))
                acc[a] = _merge(acc[a], o, lse)
            if moving is not None:
                moving[0].wait()
                kv = moving[1].wait()
        out = torch.cat([o for o, _ in acc], dim=_SEQ).to(q.dtype)
        lse = torch.cat([lse for _, lse in acc], dim=_SEQ)
        # a row that sees no key at all comes out 0, as torch's kernels give it, and no gradient
        # (a finite stand-in for its logsumexp makes each block's probabilities 0)
        ctx.save_for_backward(q, k, v, out, lse.masked_fill(lse == float("-inf"), 0.0), keep)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, keep = ctx.saved_tensors
        ring = ctx.ring
        dout = dout.contiguous()
        qs, dos, outs, lses = ring.chunks(q), ring.chunks(dout), ring.chunks(out), ring.chunks(lse, -1)
        dq = [_acc_zeros(x) for x in qs]
        kv, grads = _pack(k, v, keep), None  # grads: the dk/dv of the block held, from the ranks before
        for step in range(ring.cp):
            moving = ring.pass_on(kv, _KV) if step < ring.cp - 1 else None
            ks, vs, keeps = ring.held_block(kv, k, v, keep)
            dks = [_acc_zeros(x) for x in ks]
            dvs = [_acc_zeros(x) for x in vs]
            for a, b, diagonal in ring.pairs(step):
                qa, kb_, vb_, causal, mask, _ = ring.block(a, b, diagonal, qs, ks, vs, keeps)
                g = block_backward(dos[a], qa, kb_, vb_, outs[a], lses[a], causal, ring.scale, mask)
                dq[a] += g[0]
                dks[b] += g[1]
                dvs[b] += g[2]
            mine = _pack(torch.cat(dks, dim=_SEQ), torch.cat(dvs, dim=_SEQ))
            if grads is not None:
                mine = grads[1].wait() + mine
                grads[0].wait()
            grads = ring.pass_on(mine, _DKV)  # one hop behind the block; the last hop takes it home
            if moving is not None:
                moving[0].wait()
                kv = moving[1].wait()
        grads[0].wait()
        dk, dv = _unpack(grads[1].wait(), (k, v))
        return _laid_out_like(torch.cat(dq, dim=_SEQ), q), _laid_out_like(dk, k), _laid_out_like(dv, v), None, None


def _laid_out_like(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`grad` in `t`'s dtype and memory layout: a distributed tensor's piece is laid out as its
    global strides say (q is a transposed view in most models), and the views of the backward
    rely on it."""
    return torch.empty_like(t).copy_(grad)


def ring_attention(q, k, v, ranks: tuple, causal: bool = False, scale: Optional[float] = None,
                   load_balanced: bool = True, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's query rows over the whole sequence split across `ranks`
    (local pieces, differentiable); with `causal`, the pieces are in the load-balanced layout
    when `load_balanced`, else contiguous.  `keep` (batch, local sequence), true where a key
    may be seen, is a key padding mask: a row seeing no key comes out 0, as in torch."""
    if len(ranks) == 1:
        mask = None if keep is None else keep.bool()[:, None, None, :]
        if mask is not None and causal:
            mask = mask & torch.ones(q.shape[_SEQ], k.shape[_SEQ], dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                              enable_gqa=True)
    return _RingAttention.apply(q, k, v, keep, Ring(tuple(ranks), causal, scale, load_balanced))


# -- on distributed tensors ---------------------------------------------------------------------
def _over_sep(t: DistTensor, sep: int, dim: int) -> list:
    """`t`'s placements with "sep" splitting tensor dim `dim` (the sequence or the heads),
    Partial ones reduced; no other mesh dim may split the sequence."""
    out = [Replicate() if isinstance(p, Partial) else p for p in t._spec.placements]
    for i, p in enumerate(out):
        if i != sep and isinstance(p, Shard) and p.dim % t.dim() == _SEQ:
            raise ValueError(f"context parallel over mesh dim {SEP!r} of {t._spec.mesh}: a {list(t.shape)} attention "
                             f"input placed {t._spec.placements} splits dim {p.dim} over mesh dim "
                             f"{t._spec.mesh.dim_names[i]!r} too; only 'sep' may split the sequence")
    out[sep] = Shard(dim)
    return out


def _placed(t: DistTensor, placements: list) -> DistTensor:
    return reshard_to(t, DistSpec(t._spec.mesh, placements, t._spec.meta))


def _check_inputs(q, k, v, mesh: ProcessMesh, dropout_p: float, backend: str) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if type(t) is not DistTensor or t._spec.mesh != mesh:
            where = t._spec.mesh if type(t) is DistTensor else "a plain tensor"
            raise ValueError(f"context parallel ({backend!r}) over mesh {mesh}: the attention's {name} "
                             f"{list(t.shape)} is {where}; q, k and v must be distributed tensors on that mesh")
        if t.dim() != 4:
            raise ValueError(f"context parallel ({backend!r}): the attention's {name} has shape {list(t.shape)}; "
                             f"expected (batch, heads, sequence, head dim)")
    if dropout_p:
        raise ValueError(f"context parallel ({backend!r}) over mesh {mesh}: attention dropout ({dropout_p}) "
                         f"is not supported; set the model's attention dropout to 0")


def _key_padding_piece(keep: DistTensor, q: DistTensor, sep: int) -> torch.Tensor:
    """This rank's piece of the key padding mask `keep` (batch, sequence), split as q's rows."""
    on_mesh = type(keep) is DistTensor and keep._spec.mesh == q._spec.mesh
    if not on_mesh or tuple(keep.shape) != (q.shape[0], q.shape[_SEQ]):
        raise ValueError(f"context parallel ring ('p2p'): the key padding mask {list(keep.shape)} must be a "
                         f"distributed (batch, sequence) tensor on {q._spec.mesh} for the query {list(q.shape)}")
    placements = [Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in q._spec.placements]
    placements[sep] = Shard(1)
    return local_value(_placed(keep.detach(), placements))


def _ring_sdpa(mesh, load_balanced, keep, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    _check_inputs(q, k, v, mesh, dropout_p, "p2p")
    if attn_mask is not None:
        raise ValueError(f"context parallel ring ('p2p') over mesh {mesh}: an attention mask "
                         f"{list(attn_mask.shape)} is not supported (causal or full attention, and a key padding "
                         f"mask given to context_parallel; use backend 'all2all' for other masks)")
    sep = mesh.dim_index(SEP)
    cp = mesh.shape[sep]
    check_sequence_length(q.shape[_SEQ], cp, load_balanced and is_causal, "context parallel ring ('p2p')")
    if k.shape[_SEQ] != q.shape[_SEQ]:
        raise ValueError(f"context parallel ring ('p2p'): query {list(q.shape)} and key {list(k.shape)} "
                         f"must have the same sequence length")
    placements = _over_sep(q, sep, _SEQ)
    q, k, v = (_placed(t, placements) for t in (q, k, v))
    ranks = mesh.dim_group_of(get_rank(), sep)
    keep = None if keep is None else _key_padding_piece(keep, q, sep)
    out = ring_attention(local_value(q), local_value(k), local_value(v), ranks, is_causal, scale,
                         load_balanced, keep)
    shape = (*q.shape[:3], v.shape[-1])
    return FromLocal.apply(out, DistSpec(mesh, placements, TensorMeta.contiguous(shape, q.dtype)))


def _ulysses_sdpa(mesh, load_balanced, keep, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    _check_inputs(q, k, v, mesh, dropout_p, "all2all")
    if keep is not None:
        raise ValueError(f"context parallel all-to-all ('all2all') over mesh {mesh} takes padding as the "
                         f"attention's attn_mask, not as a key padding mask")
    sep = mesh.dim_index(SEP)
    cp = mesh.shape[sep]
    ways = cp * _heads_split_elsewhere(q, sep)
    repeat = kv_head_repeats(q.shape[_HEADS], k.shape[_HEADS], ways)
    if repeat is None:
        name, t = ("query", q) if q.shape[_HEADS] % ways else ("key", k)
        also = "" if ways == cp else f" (and the other mesh dims splitting them: {ways} ways in all)"
        raise ValueError(f"context parallel all-to-all ('all2all', Ulysses) over mesh dim {SEP!r} of size {cp} "
                         f"splits the attention heads{also}, but the {name} {list(t.shape)} has {t.shape[_HEADS]} "
                         f"heads, not divisible by {ways} (nor by repeating its groups); use backend 'p2p' or a "
                         f"'sep' size dividing the heads")
    check_sequence_length(q.shape[_SEQ], cp, False, "context parallel all-to-all ('all2all')")
    if repeat > 1:  # fewer key/value heads than ranks: each repeated, every rank holds whole groups
        k, v = (t.repeat_interleave(repeat, dim=_HEADS) for t in (k, v))
    last = _sep_last(mesh)
    by_heads = [_placed(t, _over_sep(t, last.ndim - 1, _HEADS)) for t in (_reviewed(t, last, sep) for t in (q, k, v))]
    if type(attn_mask) is DistTensor and attn_mask._spec.mesh == mesh:
        attn_mask = _reviewed(attn_mask, last, sep)
    out = F.scaled_dot_product_attention(*by_heads, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    out = _placed(out, _over_sep(out, last.ndim - 1, _SEQ))
    return _reviewed(out, mesh, last.ndim - 1, sep)


def _heads_split_elsewhere(t: DistTensor, sep: int) -> int:
    """Into how many pieces mesh dims other than "sep" split `t`'s heads (tensor parallel)."""
    return math.prod(t._spec.mesh.shape[i] for i, p in enumerate(t._spec.placements)
                     if i != sep and isinstance(p, Shard) and p.dim % t.dim() == _HEADS)


def _sep_last(mesh: ProcessMesh) -> ProcessMesh:
    """`mesh` with its dim "sep" moved last.  Shards of one tensor dim cut in mesh dim order,
    so on it Ulysses cuts each rank's heads (those tensor parallel gave it) further over
    "sep", and its all-to-alls stay within the "sep" group; on `mesh`, where "sep" comes
    before "mp", the heads would be dealt out anew across both."""
    sep = mesh.dim_index(SEP)
    order = [i for i in range(mesh.ndim) if i != sep] + [sep]
    return ProcessMesh(np.transpose(mesh.mesh, order), [mesh.dim_names[i] for i in order])


def _reviewed(t: DistTensor, mesh: ProcessMesh, frm: int, to: Optional[int] = None) -> DistTensor:
    """`t` on `mesh`, its mesh dims reordered with dim `frm` moved to `to` (default: last):
    the same pieces on the same ranks, nothing moves, unless a mesh dim passed over cuts the
    same tensor dim as `frm` (their order would change the pieces): `frm` is gathered first."""
    placements = list(t._spec.placements)
    to = len(placements) - 1 if to is None else to
    passed = placements[min(frm, to):max(frm, to) + 1]
    moved = placements[frm]
    if isinstance(moved, Shard) and sum(isinstance(p, Shard) and p.dim % t.dim() == moved.dim % t.dim()
                                        for p in passed) > 1:
        placements[frm] = Replicate()
        t = _placed(t, placements)
    placements.insert(to, placements.pop(frm))
    return FromLocal.apply(local_value(t), DistSpec(mesh, placements, t._spec.meta))


def kv_head_repeats(q_heads: int, kv_heads: int, cp: int) -> Optional[int]:
    """How many times Ulysses repeats each key/value head so that the heads split over `cp`
    ranks with every query head beside its key/value head (1: as they are; None: the query
    heads do not divide by `cp`, or no repeat of the groups does).

    >>> kv_head_repeats(32, 8, 16), kv_head_repeats(4, 2, 2), kv_head_repeats(6, 2, 4)
    (2, 1, None)
    """
    if q_heads % cp or q_heads % kv_heads:
        return None
    group = q_heads // kv_heads
    return next((r for r in range(1, group + 1) if group % r == 0 and kv_heads * r % cp == 0), None)


_ALGORITHMS = {"p2p": _ring_sdpa, "all2all": _ulysses_sdpa}


_KEY_PADDING: list = []  # the key padding masks in force (`key_padding`), innermost last


@contextlib.contextmanager
def key_padding(keep: Optional[DistTensor]) -> Iterator[None]:
    """Within: the ring hides the keys where `keep` (batch, sequence), split like them, is 0
    (HF's 2D attention mask; None: every key is seen)."""
    _KEY_PADDING.append(keep)
    try:
        yield
    finally:
        _KEY_PADDING.pop()


class SdpaOnSep(TorchFunctionMode):
    """While active: F.scaled_dot_product_attention on distributed tensors on `mesh` runs
    the context-parallel algorithm (with the key padding in force); any other call runs as
    it is."""

    def __init__(self, mesh: ProcessMesh, backend: str, load_balanced: bool):
        super().__init__()
        self.mesh, self.algorithm, self.load_balanced = mesh, _ALGORITHMS[backend], load_balanced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention and args and type(args[0]) is DistTensor \
                and args[0]._spec.mesh == self.mesh:
            keep = _KEY_PADDING[-1] if _KEY_PADDING else None
            return self.algorithm(self.mesh, self.load_balanced, keep, *args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def context_parallel(mesh: ProcessMesh, backend: str = "p2p", load_balanced: bool = True,
                     key_padding_mask: Optional[DistTensor] = None) -> Iterator[None]:
    """Within the block, `F.scaled_dot_product_attention` on distributed q, k, v of shape
    (batch, heads, sequence, head dim) on `mesh` runs context parallel over its dim "sep":
    the ring ("p2p") or Ulysses ("all2all").  The output is split over "sep" on the sequence
    like the query.  For the causal ring the sequence must be in the load-balanced order
    (`shard_sequence(..., backend="p2p")` lays it out so); `load_balanced=False` takes a
    contiguous split instead (correct, but the last rank does the most work).  The ring
    takes padding as `key_padding_mask` (batch, sequence), 0 at the padded keys, laid out as
    the keys (a row seeing no key comes out 0, as in torch); Ulysses takes any attn_mask.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["sep"])
    >>> q = dist.shard_sequence(torch.randn(1, 2, 8, 4), mesh, dim=2)
    >>> with dist.context_parallel(mesh, backend="p2p"):
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> out.placements
    [Shard(2)]
    """
    check_backend(backend, "context_parallel")
    sep_size(mesh, "context_parallel")
    with SdpaOnSep(mesh, backend, load_balanced), key_padding(key_padding_mask):
        yield


__all__ = ["BACKENDS", "SEP", "SdpaOnSep", "block_backward", "block_backward_math", "block_forward",
           "block_forward_math", "block_pairs", "check_backend", "check_sequence_length", "context_parallel",
           "held_chunks", "key_padding", "kv_head_repeats", "load_balanced_order", "ring_attention", "sep_size"]
