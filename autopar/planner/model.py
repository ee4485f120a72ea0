"""Analytic accounting of a decoder-only transformer (Llama, GPT) under a parallel layout.

For a layout (dp x cp x tp x pp degrees, expert parallel degree, ZeRO level, sequence
parallel, micro-batch size and count, layers and fully recomputed layers per pipeline stage)
it gives per rank: memory by category, the time of one training step and the bytes each
collective kind moves.

Every figure of a stage is affine in (n, r), the stage's layer count and recomputed layer
count (`Affine`); `stage_terms` computes those coefficients once, `evaluate` reads them at
the layout's (n, r), and the planner's integer program (search.py) optimises over them:
the two cannot disagree.

Conventions (Megatron-LM's; activations as autopar saves them, `_activation_bytes`):
- ranks are ordered tp fastest, then cp, then dp, then pp (a tp group shares a node);
- context parallel (cp) splits every sequence over cp ranks, load-balanced for the causal
  mask (each rank holds a head and a tail chunk): activations and attention work are 1/cp
  per rank.  "ring" passes K/V blocks around the cp ranks (cp - 1 sends of the rank's K and V
  per layer forward; in the backward K/V again and their gradients a full turn home), overlapped with the
  attention of the block in hand, so only the part of the ring slower than that attention
  is charged; "all2all" (Ulysses) turns the sequence split into a head split around
  attention: four all-to-alls of q, k, v and the output per layer forward, four in backward;
- mixture of experts: a MoE layer's routed experts are split over ep ranks, folded over the
  dp x cp ranks (torchtitan's dp2ep) and next to the tp group; each token's hidden state goes
  to its top-k experts' ranks and back (two all-to-alls forward, two backward); the dense
  parameters' gradients are reduced over dp x cp and ZeRO shards them over dp, the experts'
  over the dp x cp / ep ranks holding the same experts (ZeRO over what is left of dp).  Layers are priced at their average (DeepSeek-V3's three
  dense layers of 61 spread over all);
- bf16 mixed precision: 2-byte weights and activations, fp32 gradients accumulated over
  micro-batches and reduced in bf16, Adam's fp32 master weights and two moments (12 bytes);
  "fp32": 4-byte everything, no master copy;
- attention is flash attention (no s x s scores kept) and causal (half the score FLOPs);
- 1F1B: stage s holds min(pp - s, m) micro-batches of activations; a step takes
  (m - 1) x the slowest stage's micro-batch time + one micro-batch through every stage;
  interleaved 1F1B (vpp v > 1: each stage's layers in v chunks, chunk c on stage c mod pp)
  cuts that pipeline fill by v, holds what autopar's order holds (`orders.peak_held`) and
  sends v times as often;
- the data-parallel gradient reduction and the optimizer run after the pipeline flushes,
  not overlapped with the backward (an upper bound on the step time).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from .cost import DeviceProfile, collective_time, link, matmul_time, memory_bound_time, op_link

MEMORY = ("params", "grads", "optimizer", "activations", "reserved")
MICRO_TIME = ("compute", "host", "tp_comm", "cp_comm", "ep_comm", "zero_comm", "p2p")  # per micro-batch
END_TIME = ("dp_comm", "optimizer")  # once per step, after the pipeline flushes
TIME = MICRO_TIME + END_TIME
# bytes per parameter: (weights, gradients, optimizer states, reduced gradient, gathered weight)
_STATE_BYTES = {"bf16": (2, 4, 12, 2, 2), "fp32": (4, 4, 8, 4, 4)}
_ACT_BYTES = {"bf16": 2, "fp32": 4}
_ADAM_TRAFFIC = {"bf16": 30, "fp32": 28}  # bytes read + written per parameter by one Adam update
CP_MODES = ("ring", "all2all")
# (memory category, the ZeRO level from which it is sharded, bytes per parameter)
_STATES = {precision: (("params", 3, w), ("grads", 2, g), ("optimizer", 1, o))
           for precision, (w, g, o, _, _) in _STATE_BYTES.items()}


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA, HF's `DeepseekV3Attention`): the queries
    through a rank-`q_lora` latent, keys and values through one rank-`kv_lora` latent beside
    a `rope_dim` rotary key shared by the heads; per head `nope_dim + rope_dim` query and key
    dims and `v_dim` value dims.  The down projections into the latents are small and whole
    on every tensor-parallel rank (as Megatron-core runs them); the up projections and the
    output split by heads."""

    q_lora: int
    kv_lora: int
    rope_dim: int
    nope_dim: int
    v_dim: int

    def down_params(self, hidden: int) -> int:
        """The projections into the latents and the latents' norms: whole on every tp rank."""
        return hidden * (self.q_lora + self.kv_lora + self.rope_dim) + self.q_lora + self.kv_lora

    def up_params(self, hidden: int, heads: int) -> int:
        """The latents' projections to the heads and the output projection: split by heads."""
        qk = self.nope_dim + self.rope_dim
        return heads * (self.q_lora * qk + self.kv_lora * (self.nope_dim + self.v_dim) + self.v_dim * hidden)

    def down_saved(self) -> int:
        """Elements per token autograd keeps of the latents, whole on every tp rank: the query
        latent (its projection's output, normalized, the norm's output) and the key/value
        latent (the projection's output with the rotary key, normalized, the norm's output)."""
        return 3 * self.q_lora + self.kv_lora + self.rope_dim + 2 * self.kv_lora

    def up_saved(self, heads: int) -> int:
        """Elements per token kept of the heads (split by tp): the queries and keys with their
        rotary part, the key/value up projection's output (the values are a view of it), the
        attention's output and the output projection's contiguous input."""
        return heads * (2 * (self.nope_dim + self.rope_dim) + self.nope_dim + 3 * self.v_dim)


@dataclass(frozen=True)
class TransformerSpec:
    """The dimensions that set a decoder-only transformer's cost."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated: bool = True  # SwiGLU MLP (gate, up, down); else fc1-act-fc2
    tied: bool = False  # LM head shares the embedding's weight
    bias: bool = False  # linear biases and LayerNorm shifts (GPT)
    positions: int = 0  # rows of a learned position embedding (0: rotary)
    # aten ops one decoder layer's forward runs, and the rest of the model's forward (embedding,
    # final norm, head, masks): their host cost matters where layers are small (`describe`
    # counts them on a module; these are HF Llama's)
    layer_ops: int = 100
    other_ops: int = 50
    # mixture of experts (experts == 0: dense): routed experts per MoE layer, experts each
    # token goes to, an expert's inner size (default ffn), always-used shared experts, and
    # how many first layers keep a dense MLP of `ffn`
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    # latent attention (DeepSeek's MLA) in place of q, k, v and o of heads x head size
    latent: Optional[LatentAttention] = None

    def __post_init__(self):
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"TransformerSpec: top_k={self.top_k} must be between 1 and experts={self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"TransformerSpec: dense_layers={self.dense_layers} must be within layers={self.layers}")

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def mlp_saved(self) -> int:
        """Tensors of the MLP's inner size a layer keeps for backward: the gate's output, its
        activation, up's output and their product (gated); fc1's output and its activation."""
        return 4 if self.gated else 2

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def attention_matmul_params(self) -> int:
        h, lat = self.hidden, self.latent
        return 2 * h * h + 2 * h * self.kv_dim if lat is None else lat.down_params(h) + lat.up_params(h, self.heads)

    def attention_whole_params(self) -> int:
        """Of those, what every tensor-parallel rank holds whole (latent attention's down
        projections and norms)."""
        return 0 if self.latent is None else self.latent.down_params(self.hidden)

    def attention_saved(self) -> tuple[int, int]:
        """Elements per token a layer's attention keeps for backward beside its input:
        (split by tp, whole on every tp rank).  q, its output and the output projection's
        input (h each) and k, v (kv_dim each); latent attention's own (`LatentAttention`)."""
        if self.latent is None:
            return 3 * self.hidden + 2 * self.kv_dim, 0
        return self.latent.up_saved(self.heads), self.latent.down_saved()

    def expert_params(self) -> int:
        """One expert's MLP matrices."""
        return self.mlp_matrices * self.hidden * (self.expert_ffn or self.ffn)

    def _per_layer(self, dense: float, moe: float) -> float:
        """The average over the layers of a dense layer's `dense` and a MoE layer's `moe`."""
        return ((self.layers - self.moe_layers) * dense + self.moe_layers * moe) / self.layers

    def layer_matmul_params(self) -> float:
        """Matrix parameters of a layer (on average over dense and MoE layers): all experts."""
        moe = (self.experts + self.shared_experts) * self.expert_params() + self.hidden * self.experts
        return self.attention_matmul_params() + self._per_layer(self.mlp_matrices * self.hidden * self.ffn, moe)

    def layer_active_params(self) -> float:
        """Matrix parameters a token runs through in a layer: its top-k experts, the shared ones
        and the router in a MoE layer."""
        moe = (self.top_k + self.shared_experts) * self.expert_params() + self.hidden * self.experts
        return self.attention_matmul_params() + self._per_layer(self.mlp_matrices * self.hidden * self.ffn, moe)

    def layer_expert_params(self) -> float:
        """Routed experts' parameters of a layer (on average): what expert parallel splits."""
        return self._per_layer(0.0, self.experts * self.expert_params())

    def layer_split_params(self) -> float:
        """Parameters a tensor-parallel group splits: the matrices and their column biases."""
        biases = (self.hidden + 2 * self.kv_dim + (self.mlp_matrices - 1) * self.ffn) if self.bias else 0
        return self.layer_matmul_params() - self.attention_whole_params() + biases

    def layer_replicated_params(self) -> int:
        """Norm weights (and shifts), the row-parallel biases and latent attention's down
        projections, whole on every tp rank."""
        return (4 if self.bias else 2) * self.hidden + (2 * self.hidden if self.bias else 0) + \
            self.attention_whole_params()

    def layer_params(self) -> int:
        return self.layer_split_params() + self.layer_replicated_params()

    def embedding_params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    def head_params(self) -> int:
        """LM head (unless tied) and the final norm."""
        return (0 if self.tied else self.vocab * self.hidden) + (2 if self.bias else 1) * self.hidden

    def params(self) -> float:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def active_params(self) -> float:
        """Parameters one token runs through (all of them in a dense model)."""
        return self.params() - self.layers * (self.layer_matmul_params() - self.layer_active_params())

    def key_value_width(self) -> int:
        """A token's keys and values over the heads (what context parallel moves of them):
        2 kv_dim for plain heads; latent attention's, expanded per head, heads x (qk + v)."""
        lat = self.latent
        return 2 * self.kv_dim if lat is None else self.heads * (lat.nope_dim + lat.rope_dim + lat.v_dim)

    def attention_width(self) -> float:
        """Half the query/key and value widths summed over the heads: a token's scores and
        weighted sum cost 2 x seq x this FLOPs each, forward (the hidden size for plain heads;
        latent attention's heads are wider: 192 + 128 over 128 heads, 2.9 x DeepSeek-V3's hidden)."""
        return self.hidden if self.latent is None else self.key_value_width() / 2

    def flops_per_token(self) -> float:
        """Model FLOPs of forward + backward per token: 6 x the matmul parameters it runs
        through (the LM head included; a MoE layer's top-k experts) + causal attention's
        scores and weighted sum (6 s `attention_width` per layer: 6 s h for plain heads)."""
        matmul = self.layers * self.layer_active_params() + self.vocab * self.hidden
        return 6.0 * matmul + 6.0 * self.layers * self.seq * self.attention_width()


# Published shapes (`python -m autopar.planner --model NAME`): Llama 3 8B and 405B, and
# DeepSeek-V3 (671B parameters, 37B active: 256 routed experts of 2048 and one shared, top-8,
# the first three layers dense, latent attention's 187M matrices per layer)
PRESETS = {
    "llama": TransformerSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=4096),
    "llama3-405b": TransformerSpec(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                                   seq=8192),
    "deepseek-v3": TransformerSpec(
        layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129280, seq=4096, experts=256, top_k=8,
        expert_ffn=2048, shared_experts=1, dense_layers=3,
        latent=LatentAttention(q_lora=1536, kv_lora=512, rope_dim=64, nope_dim=128, v_dim=128)),
}


@dataclass(frozen=True)
class Shape:
    """A layout without its stage split: degrees, ZeRO level, sequence parallel, batching."""

    dp: int
    tp: int
    pp: int
    micro_batch: int  # sequences per micro-batch
    micro_batches: int  # per step, per data-parallel rank
    zero: int = 0
    sequence_parallel: bool = False
    precision: str = "bf16"
    vpp: int = 1  # chunks per pipeline stage (interleaved 1F1B when > 1)
    cp: int = 1  # context parallel: ranks splitting each sequence (mesh dim "sep")
    cp_mode: str = "ring"  # "ring" (K/V passed around) or "all2all" (Ulysses)
    ep: int = 1  # expert parallel: ranks splitting the routed experts, folded over dp x cp

    def __post_init__(self):
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"Shape: cp_mode={self.cp_mode!r} must be one of {CP_MODES}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"Shape: ep={self.ep} must divide dp x cp = {self.dp * self.cp} (it folds over them)")

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.micro_batches


@dataclass(frozen=True)
class Layout:
    shape: Shape
    stage_layers: tuple  # decoder layers per pipeline stage
    recompute: tuple  # of those, fully recomputed in the backward


@dataclass(frozen=True)
class Affine:
    """c + n * per_layer + r * per_recompute."""

    c: float = 0.0
    per_layer: float = 0.0
    per_recompute: float = 0.0

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.c + other.c, self.per_layer + other.per_layer, self.per_recompute + other.per_recompute)

    def __mul__(self, k: float) -> "Affine":
        return Affine(self.c * k, self.per_layer * k, self.per_recompute * k)

    def at(self, n: int, r: int) -> float:
        return self.c + n * self.per_layer + r * self.per_recompute


@dataclass
class StageTerms:
    """One stage's figures as Affine in (n, r): memory bytes by category, the time of one
    micro-batch (forward + backward) and of the step's end by category, and bytes per
    collective kind per micro-batch and per step end."""

    memory: dict = field(default_factory=dict)
    micro_time: dict = field(default_factory=dict)
    end_time: dict = field(default_factory=dict)
    micro_bytes: dict = field(default_factory=dict)
    end_bytes: dict = field(default_factory=dict)

    def add(self, kind: str, key: str, term: Affine) -> None:
        table = getattr(self, kind)
        table[key] = table.get(key, Affine()) + term


def _collective(terms: StageTerms, where: str, category: str, op: str, group: int, stride: int,
                messages: Affine, nbytes: Affine, profile: DeviceProfile) -> None:
    """Charge `messages` collectives `op` moving `nbytes` in all over `group` ranks `stride`
    apart: a latency per message and the ring's bandwidth term per byte.  `where` is
    "micro" (per micro-batch) or "end" (once per step)."""
    if group == 1:
        return
    alpha = collective_time(op, 0.0, group, profile, stride)
    per_byte = collective_time(op, 1.0, group, profile, stride) - alpha
    terms.add(f"{where}_time", category, messages * alpha + nbytes * per_byte)
    terms.add(f"{where}_bytes", op, nbytes)


def stage_terms(spec: TransformerSpec, profile: DeviceProfile, shape: Shape, stage: int,
                role: Optional[StageTerms] = None) -> StageTerms:
    """Stage `stage`'s figures per rank as Affine in (its layers, its recomputed layers):
    its role's (`role_terms`: first, last or in between; computed here unless given) and
    the activations of the micro-batches it holds."""
    first, last = stage == 0, stage == shape.pp - 1
    role = role_terms(spec, profile, shape, first, last) if role is None else role
    inflight = held_micro_batches(shape, stage)
    full, ckpt = _activation_bytes(spec, shape)
    act = Affine(0.0, inflight * full, -inflight * (full - ckpt))
    if first:
        act += Affine(inflight * ckpt)  # the embedding's output, a layer input's size
    memory = dict(role.memory)
    memory["activations"] = memory.get("activations", Affine()) + act
    return StageTerms(memory, role.micro_time, role.end_time, role.micro_bytes, role.end_bytes)


def _moe_mlp_acts(spec: TransformerSpec) -> float:
    """Per token, the MLP's inner activations (elements) of a layer on average: a MoE layer
    keeps its top-k and shared experts' and the dispatched and combined hidden states."""
    per_expert = spec.mlp_saved * (spec.expert_ffn or spec.ffn)
    moe = per_expert * (spec.top_k + spec.shared_experts) + 2 * spec.top_k * spec.hidden if spec.experts else 0
    return spec._per_layer(spec.mlp_saved * spec.ffn, moe)


def _routing_bytes(spec: TransformerSpec) -> float:
    """Per token, what a MoE layer's routing keeps (on average over the layers), whatever the
    precision: the router's fp32 scores over the experts (the top-k weights are gathered from
    them), and for each of its k pairs the dispatch's int64 indices and the fp32 weights
    (52 bytes, as autopar's dispatch under HF's routers keeps them; measured under `simulate`,
    tests/test_plan_confirmed.py), and the weights' normalizer."""
    return spec._per_layer(0.0, 4.0 * spec.experts + 52.0 * spec.top_k + 4.0) if spec.experts else 0.0


def _activation_bytes(spec: TransformerSpec, shape: Shape) -> tuple:
    """Bytes per rank per micro-batch a full layer keeps and a recomputed layer keeps (its
    input).  A full layer keeps what autograd saves as autopar runs it (measured under
    `simulate`, tests/test_plan_confirmed.py): each norm's input and normalized input, split
    only under sequence parallel; the attention's and the MLP's inputs whole, as the column
    projections save them (sequence parallel gathers them; Megatron would keep its split
    and gather it again in backward); the attention's own (`attention_saved`: q, k, v, its
    output and the output projection's contiguous input, split by tp; latent attention's
    latents whole); the MLP's inner tensors (`mlp_saved`); a MoE layer's routing
    (`_routing_bytes`)."""
    h, tp, a = spec.hidden, shape.tp, _ACT_BYTES[shape.precision]
    tokens = shape.micro_batch * spec.seq / shape.cp
    sp_div = tp if shape.sequence_parallel else 1
    split, whole = spec.attention_saved()
    full = tokens * a * (4 * h / sp_div + 2 * h + whole + (split + _moe_mlp_acts(spec)) / tp) + \
        tokens * _routing_bytes(spec)
    return full, tokens * a * h / sp_div


@dataclass(frozen=True)
class _Params:
    """Parameters a rank holds (Affine in its layers) and the ranks holding the same ones:
    `shard` ranks (`shard_stride` apart) that ZeRO shards them over (the mesh dim "dp"), and
    `rest` ranks (`rest_stride` apart) that only reduce their gradients (sep, say)."""

    params: Affine
    shard: int
    shard_stride: int
    rest: int
    rest_stride: int


def _param_groups(spec: TransformerSpec, shape: Shape, first: bool, last: bool) -> list:
    """A tp shard of the matrices and whole norms, the same on every dp and sep rank (ZeRO
    over "dp"); and, a MoE model, a tp x ep shard of the routed experts, the same on the dp x
    sep / ep ranks that hold those experts (ZeRO over what is left of "dp")."""
    h, tp, dp, cp, ep = spec.hidden, shape.tp, shape.dp, shape.cp, shape.ep
    layer_p = (spec.layer_split_params() - spec.layer_expert_params()) / tp + spec.layer_replicated_params()
    norm = (2 if spec.bias else 1) * h  # the final norm, whole on every tp rank
    fixed_p = (spec.embedding_params() / tp if first else 0.0) + \
        ((spec.head_params() - norm) / tp + norm if last else 0.0)
    if spec.tied and last and not first:
        fixed_p += spec.vocab * h / tp  # the last stage keeps its own copy of the shared weight
    groups = [_Params(Affine(fixed_p, layer_p), dp, tp * cp, cp, tp)]
    if spec.experts:
        experts = Affine(0.0, spec.layer_expert_params() / (tp * ep))
        if dp % ep == 0:  # the experts split over part of "dp", sharded over the rest
            groups.append(_Params(experts, dp // ep, tp * cp * ep, cp, tp))
        else:  # folded over dp x sep: no ZeRO shard left
            groups.append(_Params(experts, 1, 1, dp * cp // ep, tp * ep))
    return groups


def _sharded(groups: list, shape: Shape, level: int, nbytes: float) -> Affine:
    """Bytes per rank of a per-parameter state of `nbytes` that ZeRO `level` and above shard."""
    return sum((g.params * (nbytes / g.shard if shape.zero >= level else nbytes) for g in groups), Affine())


def state_bytes_floor(spec: TransformerSpec, shape: Shape) -> float:
    """Bytes of parameters, gradients and optimizer states the fullest stage holds at least
    (its share of the layers, nothing else): a shape above the memory limit cannot fit."""
    groups = _param_groups(spec, shape, False, False)
    per_layer = sum((_sharded(groups, shape, level, b) for _, level, b in _STATES[shape.precision]), Affine())
    return per_layer.per_layer * spec.layers / shape.pp


def role_terms(spec: TransformerSpec, profile: DeviceProfile, shape: Shape, first: bool, last: bool) -> StageTerms:
    """A stage's figures but the activations it holds: the same for every stage in between."""
    h, tp, dp, pp, cp, ep = spec.hidden, shape.tp, shape.dp, shape.pp, shape.cp, shape.ep
    wb, _, _, reduce_b, gather_b = _STATE_BYTES[shape.precision]
    a = _ACT_BYTES[shape.precision]
    tokens = shape.micro_batch * spec.seq / cp  # this rank's tokens of a micro-batch
    sp_div = tp if shape.sequence_parallel else 1
    moe = spec.moe_layers / spec.layers  # the share of layers with experts
    terms = StageTerms()

    groups = _param_groups(spec, shape, first, last)
    sharded = lambda level, nbytes: _sharded(groups, shape, level, nbytes)  # noqa: E731
    for category, level, nbytes in _STATES[shape.precision]:
        terms.add("memory", category, sharded(level, nbytes))
    if shape.zero >= 3:  # two layers gathered at a time (the one running, the next prefetched)
        gathered = sum((g.params.per_layer * (1 - 1 / g.shard) for g in groups), 0.0)
        terms.add("memory", "params", Affine(2 * gathered * wb))

    # activations beyond the micro-batches held (`stage_terms`): one layer's working set in
    # the backward, and on the last stage the head's input (whole, as its columns save it),
    # the final norm's input and normalized input, the logits, fp32 softmax and its gradient
    mlp_acts = _moe_mlp_acts(spec)
    act = Affine(_activation_bytes(spec, shape)[0])
    if last:
        act += Affine(tokens * a * (h + 2 * h / sp_div) + tokens * spec.vocab / tp * (a + 4 + 4))
    terms.add("memory", "activations", act)
    terms.add("memory", "reserved", Affine(profile.reserved_bytes))

    # compute of one micro-batch, forward + backward (backward = 2 x forward), recompute = + forward;
    # a rank's tokens attend to the whole sequence (its K/V blocks under cp)
    prec = shape.precision
    attention_flops = 2.0 * tokens * spec.seq * spec.attention_width() / tp
    layer_flops = 2.0 * tokens * spec.layer_active_params() / tp + attention_flops
    gemms = 4 + spec.mlp_matrices + 1  # q, k, v, o, the MLP's matrices, one fused attention kernel
    fwd = matmul_time(layer_flops, gemms, profile, prec)
    norm_bytes, other_bytes = 10 * h, 2 * (h + spec.kv_dim) + mlp_acts
    moved = tokens * a * (norm_bytes / sp_div + other_bytes / tp) + moe * 4 * tokens * spec.top_k * h * a / sp_div
    fwd += memory_bound_time(moved, profile)  # (a MoE layer permutes its tokens to and from the experts)
    compute = Affine(0.0, 3 * fwd, fwd)
    if last:
        head = matmul_time(3 * 2.0 * tokens * h * spec.vocab / tp, 3, profile, prec)
        compute += Affine(head + memory_bound_time(3 * tokens * spec.vocab / tp * (a + 8), profile))
    if first:
        compute += Affine(memory_bound_time(3 * tokens * h * a, profile))  # lookup, its gradient's scatter
    crowd = crowding(shape, profile)
    terms.add("micro_time", "compute", compute * crowd)

    # host: per forward op a step runs about three aten ops (the op, two in its backward), two
    # distributed dispatches and one autograd node (counted on HF Llama under dp and under mp:
    # 3.1 aten ops, 2.0 dispatches, 0.75 nodes per forward op); a recomputed layer runs its
    # forward again.  A CPU computes its ops itself (host and compute add); a GPU's host issues
    # ops while the device runs, so only host time beyond the device's counts
    per_op = profile.op_latency + profile.dispatch_overhead
    pass_cost = 3 * profile.op_latency + 2 * profile.dispatch_overhead + profile.autograd_node
    ends = (0.5 if first else 0.0) + (0.5 if last else 0.0)  # embedding side / head side of the rest
    host = Affine(ends * spec.other_ops * pass_cost, spec.layer_ops * pass_cost, spec.layer_ops * per_op) * crowd
    if profile.host_overlaps:
        host = Affine(*(max(0.0, x - y) for x, y in zip(
            (host.c, host.per_layer, host.per_recompute), (compute.c, compute.per_layer, compute.per_recompute))))
    terms.add("micro_time", "host", host)

    # tensor parallel: per layer, forward (again when recomputed) and backward each gather the
    # attention's and the MLP's input and reduce-scatter their outputs (sequence parallel), or
    # all-reduce the outputs; the embedding and the head add one each
    activation = tokens * a * h
    if tp > 1:
        ops = ("all_gather", "reduce_scatter") if shape.sequence_parallel else ("all_reduce",)
        # the embedding split by hidden (untied) turns into a sequence split: an all-to-all each way
        hidden_split = first and shape.sequence_parallel and not spec.tied
        ends = (1 if first and not hidden_split else 0) + (1 if last else 0)
        for op in ops:
            # a recomputed forward gathers both inputs again but reduces only the attention's
            # output: checkpointing stops once the saved tensors are back, before the MLP's
            per_op = Affine(ends, 4, 2 if op == "all_gather" else 1)
            _collective(terms, "micro", "tp_comm", op, tp, 1, per_op, per_op * activation, profile)
        if hidden_split:
            _collective(terms, "micro", "tp_comm", "all_to_all", tp, 1, Affine(2), Affine(2 * activation / tp),
                        profile)

    # context parallel, per layer: forward once (again when recomputed), then backward
    if cp > 1:
        kv = tokens * a * spec.key_value_width() / tp  # this rank's K and V
        if shape.cp_mode == "ring":  # forward: K/V cp - 1 hops; backward: K/V again, dK/dV a full turn home
            alpha, bandwidth = op_link(profile, "send", *link(profile, cp, tp))
            hop, attention = alpha + kv / bandwidth, matmul_time(attention_flops, cp, profile, prec)
            forward = max(0.0, (cp - 1) * hop - attention)
            backward = max(0.0, (2 * cp - 1) * hop - 2 * attention)
            terms.add("micro_time", "cp_comm", Affine(0.0, forward + backward, forward))
            terms.add("micro_bytes", "send", Affine(0.0, (3 * cp - 2) * kv, (cp - 1) * kv))
        else:
            moved = tokens * a * (2 * spec.attention_width() + spec.key_value_width()) / tp  # q, k, v, the output
            _collective(terms, "micro", "cp_comm", "all_to_all", cp, tp, Affine(0.0, 8, 4),
                        Affine(0.0, 2 * moved, moved), profile)

    # expert parallel, per MoE layer: each token's hidden state to its top-k experts and back,
    # forward (again when recomputed) and backward
    if spec.experts and ep > 1:
        routed = tokens * spec.top_k * h * a / sp_div
        _collective(terms, "micro", "ep_comm", "all_to_all", ep, tp, Affine(0.0, 4 * moe, 2 * moe),
                    Affine(0.0, 4 * moe * routed, 2 * moe * routed), profile)

    # ZeRO-2/3 keep only a shard of the gradient, so each micro-batch reduce-scatters it;
    # ZeRO-3 also gathers each layer's weights for its forward and again for its backward
    # (the embedding and the head are units of their own)
    # (the shard's gradient is then all-reduced over the other ranks holding it: sep)
    units = Affine((1 if first else 0) + (1 if last else 0), 1)
    for g in groups:
        if shape.zero >= 2:
            _collective(terms, "micro", "zero_comm", "reduce_scatter", g.shard, g.shard_stride, units,
                        g.params * reduce_b, profile)
            _collective(terms, "micro", "zero_comm", "all_reduce", g.rest, g.rest_stride, units,
                        g.params * (reduce_b / g.shard), profile)
        if shape.zero >= 3:
            _collective(terms, "micro", "zero_comm", "all_gather", g.shard, g.shard_stride, units * 2,
                        g.params * (2 * gather_b), profile)

    # pipeline: the activation (split over tp) goes forward, its gradient backward
    if pp > 1:
        sends = Affine((shape.vpp - last) + (shape.vpp - first))
        _collective(terms, "micro", "p2p", "send", 2, tp * cp * dp, sends, sends * (activation / tp), profile)

    # end of step: gradients all-reduced over dp x sep (ZeRO-1: reduce-scattered over dp), the updated
    # weight shards all-gathered (ZeRO-1/2), then Adam
    once = Affine(1.0)
    for g in groups:
        if shape.zero == 0:
            _collective(terms, "end", "dp_comm", "all_reduce", g.shard * g.rest, g.rest_stride, once,
                        g.params * reduce_b, profile)
        if shape.zero == 1:
            _collective(terms, "end", "dp_comm", "reduce_scatter", g.shard, g.shard_stride, once,
                        g.params * reduce_b, profile)
            _collective(terms, "end", "dp_comm", "all_reduce", g.rest, g.rest_stride, once,
                        g.params * (reduce_b / g.shard), profile)
        if shape.zero in (1, 2):
            _collective(terms, "end", "dp_comm", "all_gather", g.shard, g.shard_stride, once,
                        g.params * gather_b, profile)
    terms.add("end_time", "optimizer", sharded(1, _ADAM_TRAFFIC[prec] / profile.hbm_bandwidth))
    return terms


@dataclass
class Estimate:
    """What a layout costs per rank (memory: the stage that needs most)."""

    layout: Layout
    memory_by_stage: list  # per stage: category -> bytes
    step_time: float
    time: dict  # category -> seconds of the step
    bytes_per_step: dict  # collective kind -> bytes a rank of the busiest stage moves per step
    model_flops: float  # per step, whole job, recompute not counted
    mfu: float
    fits: Optional[bool] = None

    @property
    def memory_per_stage(self) -> list:
        return [sum(m.values()) for m in self.memory_by_stage]

    @property
    def peak_memory(self) -> float:
        return max(self.memory_per_stage)

    @property
    def memory(self) -> dict:
        """category -> bytes on the stage that needs most."""
        return max(self.memory_by_stage, key=lambda m: sum(m.values()))


def crowding(shape: Shape, profile: DeviceProfile) -> float:
    """How much slower each rank computes because ranks outnumber the cores they share (a
    profile measured on one machine: `cores`; devices of their own: 1)."""
    if not profile.cores:
        return 1.0
    return max(1.0, min(shape.world, profile.ranks_per_node) / profile.cores)


def held_micro_batches(shape: Shape, stage: int) -> float:
    """How many micro-batches' activations of all its layers stage `stage` holds at the peak
    under the shape's schedule (interleaved: in chunk units over v)."""
    if shape.vpp == 1:
        return min(shape.pp - stage, shape.micro_batches)
    return _interleaved_peaks(shape.pp, shape.vpp, shape.micro_batches)[stage]


@functools.lru_cache(maxsize=None)
def _interleaved_peaks(pp: int, vpp: int, micro_batches: int) -> tuple:
    from ..pipelining import orders

    return tuple(k / vpp for k in orders.peak_held(orders.interleaved(pp, vpp, micro_batches)))


def all_terms(spec: TransformerSpec, profile: DeviceProfile, shape: Shape) -> list:
    """Every stage's terms; the roles' (first, in between, last) computed once each."""
    roles: dict = {}
    out = []
    for s in range(shape.pp):
        key = (s == 0, s == shape.pp - 1)
        if key not in roles:
            roles[key] = role_terms(spec, profile, shape, *key)
        out.append(stage_terms(spec, profile, shape, s, roles[key]))
    return out


def pipeline_time(micro: list, end: list, micro_batches: int, vpp: int = 1) -> float:
    """1F1B step time from each stage's micro-batch time and end-of-step time: m micro-batches
    through the slowest stage plus the fill of the others, which interleaving cuts by vpp."""
    slowest = max(micro)
    return micro_batches * slowest + (sum(micro) - slowest) / vpp + max(end)


def evaluate(spec: TransformerSpec, profile: DeviceProfile, layout: Layout,
             memory_limit: Optional[float] = None) -> Estimate:
    """Memory, step time, bytes and MFU of `layout` (see the module's conventions)."""
    shape = layout.shape
    if len(layout.stage_layers) != shape.pp or sum(layout.stage_layers) != spec.layers:
        raise ValueError(f"stage_layers {layout.stage_layers} must split {spec.layers} layers into {shape.pp} stages")
    if any(n % shape.vpp for n in layout.stage_layers):
        raise ValueError(f"stage_layers {layout.stage_layers} must each split into vpp={shape.vpp} chunks")
    terms = all_terms(spec, profile, shape)
    nr = list(zip(layout.stage_layers, layout.recompute))
    at = lambda table, key, s: table[key].at(*nr[s]) if key in table else 0.0  # noqa: E731
    memory = [{k: at(t.memory, k, s) for k in MEMORY} for s, t in enumerate(terms)]
    peak = max(sum(m.values()) for m in memory)
    micro = [sum(v.at(*nr[s]) for v in t.micro_time.values()) for s, t in enumerate(terms)]
    end = [sum(v.at(*nr[s]) for v in t.end_time.values()) for s, t in enumerate(terms)]
    step = pipeline_time(micro, end, shape.micro_batches, shape.vpp)
    slow, last_end = max(range(shape.pp), key=micro.__getitem__), max(range(shape.pp), key=end.__getitem__)
    m = shape.micro_batches
    time = {k: m * at(terms[slow].micro_time, k, slow) for k in MICRO_TIME}
    time.update({k: at(terms[last_end].end_time, k, last_end) for k in END_TIME})
    time["bubble"] = step - sum(time.values())
    busiest = [{op: m * b.at(*nr[s]) for op, b in t.micro_bytes.items()} for s, t in enumerate(terms)]
    for s, t in enumerate(terms):
        for op, b in t.end_bytes.items():
            busiest[s][op] = busiest[s].get(op, 0.0) + b.at(*nr[s])
    bytes_per_step = max(busiest, key=lambda d: sum(d.values()))
    flops = spec.flops_per_token() * shape.global_batch * spec.seq
    mfu = flops / (shape.world * profile.peak_flops(shape.precision) * step)
    return Estimate(
        layout=layout, memory_by_stage=memory, step_time=step, time=time, bytes_per_step=bytes_per_step,
        model_flops=flops, mfu=mfu, fits=None if memory_limit is None else peak <= memory_limit,
    )
