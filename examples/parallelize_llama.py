"""Paddle's parallelize API: a tiny Llama trained on 8 ranks, dp2 x mp2 x pp2, with one config.

    python -m autopar.launch --nproc_per_node 8 examples/parallelize_llama.py --check

The model is plain PyTorch, shaped like the Llama of Paddle's parallelize docs: token and
position embeddings, decoder layers (RMSNorm, attention with a fused qkv_proj and an o_proj,
RMSNorm, an MLP with a fused gate_up_proj and a down_proj) and an LM head whose weight is
used as x @ w.  The docs' plan places it: Megatron tensor parallel over "mp" (qkv/gate_up by
columns, o/down by rows, the LM head by vocabulary), sequence parallel between the layers
(activations [s, b, h] split on s, gathered around attention and the MLP), the layers cut
into two pipeline stages over "pp" that run each step as `--micro-batches` micro-batches in
1F1B order, the batch split over "dp" with ZeRO-1.  autopar derives the rest.
"""
import argparse

import torch
import torch.nn.functional as F

import autopar as dist
from _check import finish


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv_proj = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        # q, k, v of a head side by side: a column split of qkv_proj keeps whole heads together
        qkv = self.qkv_proj(x).view(b, s, self.heads, 3 * h // self.heads).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class LlamaMLP(torch.nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        # gate and up interleaved: a column split of gate_up_proj keeps each pair together
        gate, up = self.gate_up_proj(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, hidden, ffn, heads):
        super().__init__()
        self.self_attn = LlamaAttention(hidden, heads)
        self.mlp = LlamaMLP(hidden, ffn)
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(torch.nn.Module):
    def __init__(self, vocab, hidden, ffn, heads, layers, seq):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.position_embedding = torch.nn.Embedding(seq, hidden)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(hidden, ffn, heads) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        x = self.embed_tokens(input_ids) + self.position_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaLMHead(torch.nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden, vocab) * hidden**-0.5)

    def forward(self, x):
        return x @ self.weight


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, vocab, hidden, ffn, heads, layers, seq):
        super().__init__()
        self.llama = LlamaModel(vocab, hidden, ffn, heads, layers, seq)
        self.lm_head = LlamaLMHead(hidden, vocab)

    def forward(self, input_ids):
        return self.lm_head(self.llama(input_ids))


def parallel_config(sharding_level=1, micro_batches=2):
    """The parallelize docs' config: tensor + sequence parallel, pipeline over the layers (1F1B over
    `micro_batches` micro-batches per step), ZeRO."""
    plan = {
        "llama.embed_tokens": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
        "llama.position_embedding": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
        "llama.layers.*.self_attn.qkv_proj": dist.ColWiseParallel(),
        "llama.layers.*.self_attn.o_proj": dist.RowWiseParallel(),
        "llama.layers.*.self_attn": dist.SequenceParallelDisable(),
        "llama.layers.*.mlp.gate_up_proj": dist.ColWiseParallel(),
        "llama.layers.*.mlp.down_proj": dist.RowWiseParallel(),
        # Paddle's docs say need_transpose=False here, and it trains to the same numbers; but a torch
        # Linear flattens [s, b, h] to [s*b, h], which with the batch split over dp on dim 1
        # costs an all-to-all over dp each way: transposing back to [b, s, h] (a local copy)
        # halves this example's bytes per step (722 KB -> 386 KB on dp2 x mp2)
        "llama.layers.*.mlp": dist.SequenceParallelDisable(),
        "llama.norm": dist.SequenceParallelEnable(),
        "lm_head.weight": dist.ColWiseParallel(),
        "lm_head": dist.SequenceParallelEnd(),
    }
    return {
        "dp_config": {"sharding_level": sharding_level},
        "mp_config": {"parallelize_plan": plan},
        "pp_config": {"split_spec": "llama.layers", "schedule_mode": "1F1B", "accumulate_steps": micro_batches},
    }


def batches(args):
    """Sequences counting up modulo the vocabulary with a per-sequence stride (learnable)."""
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
        stride = torch.randint(1, 4, (args.batch, 1), generator=g)
        seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
        yield seq[:, :-1], seq[:, 1:]


def train(args, mesh=None, config=None, static=False):
    """Train from `args.seed`; with a mesh, parallelized by `config` (default: the docs'), its
    steps in micro-batches through the pipeline (`pipelining.build_schedule`, which reads the
    schedule from pp_config), and with `static` as a captured program (`to_static`: the first
    micro-batch's step is recorded and cut into the stages, then replayed in 1F1B order)."""
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(args.vocab, args.hidden, args.ffn, args.heads, args.layers, args.seq)
    # eps above the rounding noise of gradients that cancel to ~0 (causal attention has
    # some): Adam would turn such noise into a full step of random sign, on any machine
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
    if mesh is not None:
        config = config or parallel_config(micro_batches=args.micro_batches)
        model, opt = dist.parallelize(model, opt, mesh, config)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1))

    if static:
        step = dist.to_static(model, None, loss_fn, opt)
        return model, [float(step(x, y)) for x, y in batches(args)]
    pipelined = mesh is not None and "schedule_mode" in config.get("pp_config", {})
    schedule = dist.pipelining.build_schedule(model, loss_fn) if pipelined else None
    losses = []
    for x, y in batches(args):
        if schedule is not None:
            loss = schedule.step(x, target=y)  # forward and backward of every micro-batch
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (1F1B over the pp stages)")
    p.add_argument("--static", action="store_true", help="run the steps as a captured program (dist.to_static)")
    p.add_argument("--check", action="store_true", help="also run one process and compare")
    args = p.parse_args()
    if dist.get_world_size() != 8:
        raise SystemExit("the parallelize example runs on 8 ranks (dp2 x mp2 x pp2)")
    # the docs' mesh: "pp" is the last dim, so stage 0 is ranks 0, 2, 4, 6
    mesh = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "mp", "pp"])
    model, losses = train(args, mesh, static=args.static)
    if dist.get_rank() == 0:
        for name in ("llama.embed_tokens.weight", "llama.layers.0.self_attn.qkv_proj.weight",
                     "llama.layers.1.mlp.down_proj.weight", "lm_head.weight"):
            p = model.get_parameter(name)
            placed = dict(zip(p.process_mesh.dim_names, p.placements))
            print(f"{name:42s} {str(list(p.shape)):12s} ranks {p.process_mesh.process_ids} {placed}")
        mine = sum(p.local_value().numel() for p in model.parameters())
        print(f"rank 0 holds {mine} of the {sum(p.numel() for p in model.parameters())} parameter values")
    finish(args, model, losses, lambda: train(args))


if __name__ == "__main__":
    main()
