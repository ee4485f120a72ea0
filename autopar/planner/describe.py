"""From a model to the planner and back: a module's dimensions (`describe`) and the
`parallelize` config that runs a layout on it (`parallelize_config`).

Two families are recognised: HuggingFace decoder models (Llama-like, and GPT-2 with its
Conv1D projections and fused q/k/v; a `config` with num_hidden_layers, hidden_size, ...)
and plain decoder stacks like the examples' GPT (a ModuleList of identical blocks between
token embeddings and a vocabulary-sized head).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..api import plans
from ..api.plans import is_hf_conv1d
from .model import Layout, TransformerSpec

# linear layers of a block split by output features (column) or input features (row)
_COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "q", "k", "v", "fc1",
           "c_attn", "c_fc")
_ROW = ("o_proj", "down_proj", "proj", "fc2", "c_proj")
_GATED = ("gate_proj", "gate_up_proj")
_FINAL_NORM = ("norm", "ln", "ln_f", "final_layernorm")
_MLP_IN = ("up_proj", "fc1", "gate_up_proj", "c_fc")
# HF Conv1D projections computing q, k and v side by side (GPT-2): split with each part cut alike
_FUSED_QKV = ("c_attn",)
_HEADS = ("heads", "num_heads", "n_head")


@dataclass(frozen=True)
class ModelNames:
    """Where the planner's pieces live in the module (names as `named_modules()` gives them)."""

    layers: str  # the ModuleList of decoder blocks
    column: tuple  # block-relative names of column-parallel linears
    row: tuple
    embedding: str
    head: str  # the vocabulary projection
    final_norm: Optional[str] = None
    fused: tuple = ()  # block-relative names of column linears computing 3 equal projections (q, k, v)
    tied: bool = False  # the head shares the embedding's weight

    @property
    def inputs(self) -> str:
        """The layer the token ids go into (HF's inner model): context parallel splits them there."""
        return self.layers.rpartition(".")[0]

    @property
    def attention(self) -> str:
        """Block-relative name of the attention layer (the parent of its first projection)."""
        return self.column[0].rpartition(".")[0]

    @property
    def mlp(self) -> str:
        """Block-relative name of the MLP (the parent of its last projection): a MoE block."""
        return self.row[-1].rpartition(".")[0]


def _layer_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and len({type(x) for x in m}) == 1]
    if not lists:
        raise ValueError(f"{type(model).__name__}: found no ModuleList of identical blocks to plan as the layers")
    return max(lists, key=lambda nm: len(nm[1]))


def describe(model: torch.nn.Module, seq: Optional[int] = None) -> tuple[TransformerSpec, ModelNames]:
    """The transformer dimensions of `model` and the names of its parts.  `seq` defaults to
    the model's position table (learned, or HF's max_position_embeddings)."""

    layers_name, blocks = _layer_list(model)
    block = blocks[0]
    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear) or is_hf_conv1d(m)}
    leaf = lambda n: n.rpartition(".")[2]  # noqa: E731
    column = tuple(n for n in linears if leaf(n) in _COLUMN)
    row = tuple(n for n in linears if leaf(n) in _ROW)
    if not column or not row:
        raise ValueError(
            f"{type(model).__name__}: its blocks' linears {sorted(linears)} name no column-parallel "
            f"({', '.join(_COLUMN)}) or row-parallel ({', '.join(_ROW)}) layer"
        )
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    if not embeddings:
        raise ValueError(f"{type(model).__name__}: found no token embedding (nn.Embedding)")
    emb_name, emb = max(embeddings, key=lambda nm: nm[1].num_embeddings)
    vocab, hidden = emb.num_embeddings, emb.embedding_dim
    heads_of = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == vocab
                and not n.startswith(layers_name + ".")]
    raw = [n for n, p in model.named_parameters() if p.dim() == 2 and p.shape == (hidden, vocab)]
    head = heads_of[-1] if heads_of else raw[-1].rpartition(".")[0] if raw else None
    if head is None:
        raise ValueError(f"{type(model).__name__}: found no output layer projecting onto the vocabulary of {vocab}")
    head_weight = model.get_submodule(head).weight
    cfg = getattr(model, "config", None)
    gated = any(leaf(n) in _GATED for n in linears)
    up_name, up = next(((n, m) for n, m in linears.items() if leaf(n) in _MLP_IN), (None, None))
    if up is None:
        raise ValueError(f"{type(model).__name__}: its blocks' linears {sorted(linears)} name no MLP input {_MLP_IN}")
    ffn = _out_features(up) // (2 if leaf(up_name) == "gate_up_proj" else 1)
    if cfg is not None and hasattr(cfg, "num_attention_heads"):
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        seq = seq or cfg.max_position_embeddings
    else:
        heads = next((getattr(m, a) for m in block.modules() for a in _HEADS if hasattr(m, a)), None)
        if heads is None:
            raise ValueError(f"{type(model).__name__}: no config.num_attention_heads and no block attribute {_HEADS}")
        k = [m for n, m in linears.items() if leaf(n) in ("k_proj", "k")]
        kv_heads = _out_features(k[0]) * heads // hidden if k else heads
    positions = [m.num_embeddings for n, m in embeddings if n != emb_name]
    seq = seq or (positions[0] if positions else None)
    if seq is None:
        raise ValueError(f"{type(model).__name__}: give the sequence length (no position table to read it from)")
    norms = [n for n, _ in model.named_modules() if leaf(n) in _FINAL_NORM and not n.startswith(layers_name + ".")]
    ops = count_ops(model, blocks[0])
    spec = TransformerSpec(
        layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq,
        gated=gated, tied=head_weight is emb.weight, bias=any(m.bias is not None for m in linears.values()),
        positions=positions[0] if positions else 0,
        **({} if ops is None else {"layer_ops": ops[0], "other_ops": max(ops[1] - len(blocks) * ops[0], 0)}),
    )
    fused = tuple(n for n in column if leaf(n) in _FUSED_QKV and _out_features(linears[n]) == 3 * hidden)
    return spec, ModelNames(layers_name, column, row, emb_name, head, norms[-1] if norms else None, fused, spec.tied)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(model: torch.nn.Module, block: torch.nn.Module, tokens: int = 8) -> Optional[tuple]:
    """(aten ops of `block`'s forward, aten ops of the whole forward) on one sequence of
    `tokens` ids, in eval mode under no_grad with the random state put back: the host cost
    the planner prices per layer.  None if the model does not run on token ids alone."""
    device = next(model.parameters()).device
    counter, at_block = _OpCounter(), []
    hooks = [block.register_forward_pre_hook(lambda *_: at_block.append(counter.ops)),
             block.register_forward_hook(lambda *_: at_block.append(counter.ops))]
    training = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad(), counter:
            model(torch.zeros(1, tokens, dtype=torch.long, device=device))
    except Exception:  # noqa: BLE001 - an unusual forward: the planner keeps its default counts
        return None
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    if len(at_block) < 2:
        return None
    return at_block[1] - at_block[0], counter.ops


def _out_features(layer: torch.nn.Module) -> int:
    """Output features of an nn.Linear ([out, in] weight) or a HF Conv1D ([in, out])."""
    return layer.out_features if isinstance(layer, torch.nn.Linear) else layer.weight.shape[1]


HF_LLAMA = ModelNames(
    layers="model.layers",
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
    embedding="model.embed_tokens",
    head="lm_head",
    final_norm="model.norm",
)


def parallelize_config(names: ModelNames, layout: Layout) -> dict:
    """The `parallelize` config of `layout`, a key per dim of degree > 1: ZeRO over "dp", Megatron's column/row plan over
    "mp" (the embedding split on hidden, or on vocabulary when the head shares its weight, the
    head on vocabulary; sequence parallel between
    the blocks when the layout says so, on the [batch, seq, hidden] activations the model
    passes, no transposes), 1F1B stages over "pp" cut where the layout cuts; context
    parallel over "sep" (the inputs split where the token ids go in, every block's attention
    ring or all-to-all) and the experts of every block's MLP split over "dp"."""
    shape = layout.shape
    config: dict = {"dp_config": {"sharding_level": shape.zero}} if shape.dp > 1 else {}
    if shape.tp > 1:
        each = f"{names.layers}.*."
        plan = {each + n: plans.ColWiseParallel(fused=3 if n in names.fused else 1) for n in names.column}
        plan.update({each + n: plans.RowWiseParallel() for n in names.row})
        # a head tied to the embedding splits both by vocabulary (the embedding's output then
        # comes out Partial and is reduced where it is next needed)
        embedding = plans.RowWiseParallel() if names.tied else plans.ColWiseParallel()
        plan[names.embedding] = embedding
        plan[names.head] = plans.ColWiseParallel()
        if shape.sequence_parallel:
            plan[names.embedding] = [embedding, plans.SequenceParallelBegin(need_transpose=False)]
            for part in sorted({n.partition(".")[0] for n in names.column + names.row if "." in n}):
                plan[each + part] = plans.SequenceParallelDisable(need_transpose=False)
            if names.final_norm:
                plan[names.final_norm] = plans.SequenceParallelEnable()
            plan[names.head] = [plans.ColWiseParallel(), plans.SequenceParallelEnd(need_transpose=False)]
        config["mp_config"] = {"parallelize_plan": plan}
    if shape.cp > 1 or shape.ep > 1:
        from ..api.context_plans import ContextParallel, PrepareContextParallel
        from ..api.moe import ExpertParallel

        plan = config.setdefault("mp_config", {"parallelize_plan": {}})["parallelize_plan"]
        each = f"{names.layers}.*."
        if shape.cp > 1:
            backend = "p2p" if shape.cp_mode == "ring" else "all2all"
            plan[names.inputs] = PrepareContextParallel(backend)
            # beside sequence parallel's entry on the attention layer (which gathers its input's
            # sequence over "mp" for the column projections), not in its place
            attention = plan.get(each + names.attention)
            plan[each + names.attention] = ContextParallel(backend) if attention is None else [
                attention, ContextParallel(backend)]
        if shape.ep > 1:  # the MLP's experts, not its dense projections
            for key in [k for k in plan if k.startswith(each + names.mlp + ".")]:
                del plan[key]
            plan[each + names.mlp] = ExpertParallel()
    if shape.pp > 1:
        starts, at = [], 0
        for n in chunk_layers(layout)[:-1]:
            at += n
            starts.append(at)
        config["pp_config"] = {
            "split_spec": {f"{names.layers}.{i}": plans.SplitPoint.BEGINNING for i in starts},
            "schedule_mode": "1F1B" if shape.vpp == 1 else "VPP", "accumulate_steps": shape.micro_batches,
        }
        if shape.vpp > 1:
            config["pp_config"]["vpp_degree"] = shape.vpp
    return config


def chunk_layers(layout: Layout) -> list:
    """Layers per pipeline chunk in model order: chunk c runs on stage c mod pp, each stage's
    layers split evenly over its vpp chunks (one chunk per stage without interleaving)."""
    pp, v = layout.shape.pp, layout.shape.vpp
    return [layout.stage_layers[c % pp] // v for c in range(pp * v)]


def recomputed_layers(layout: Layout) -> list:
    """Indices of the decoder layers `layout` recomputes: the first r of each stage's n,
    taken chunk by chunk in model order (a stage's layers all hold their activations
    about equally long)."""
    pp = layout.shape.pp
    left = list(layout.recompute)
    out, start = [], 0
    for c, n in enumerate(chunk_layers(layout)):
        take = min(left[c % pp], n)
        left[c % pp] -= take
        out += range(start, start + take)
        start += n
    return out


_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # HF names, old and new


def _checkpointed(forward):
    """`forward` under non-reentrant activation checkpointing when a backward can follow.  A
    key/value cache is not passed in: the recomputation would append the keys a second
    time (HF turns caching off under checkpointing for the same reason)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kwargs = {k: None if k in _CACHE_KWARGS else v for k, v in kwargs.items()}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(model: torch.nn.Module, names: ModelNames, layout: Layout) -> list:
    """Run the layers `layout` recomputes under activation checkpointing (exact under every
    placement): each keeps only its input and runs its forward again in the backward.
    Returns their names."""
    blocks = model.get_submodule(names.layers)
    done = []
    for i in recomputed_layers(layout):
        block = blocks[i]
        if not getattr(block, "_autopar_recomputed", False):
            block.forward = _checkpointed(block.forward)
            block._autopar_recomputed = True
        done.append(f"{names.layers}.{i}")
    return done


def config_json(config: dict) -> dict:
    """`config` with plans and split points as strings (for --json and printing)."""
    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        return repr(v) if not hasattr(v, "name") else v.name

    return plain(config)
