"""The main job: a small GPT trained with data x tensor parallelism on 4 CPU ranks.

    python -m autopar.launch --nproc_per_node 4 examples/train_gpt.py
    python -m autopar.launch --nproc_per_node 4 examples/train_gpt.py --pp 2 --schedule 1F1B --micro-batches 4
    python -m autopar.launch --nproc_per_node 4 --log-ranks 0 examples/train_gpt.py --check --plot loss.png

The model is plain PyTorch (token + position embedding, pre-norm blocks with causal
self-attention and an MLP, a final layer norm, an untied LM head).  One annotation plan
places it on a dp x mp mesh (Megatron layout: q/k/v and fc1 by output columns, the
attention projection and fc2 by input rows, the vocabulary of the embedding and the
head split over mp); the batch is split over dp.  autopar derives the rest.

With `--pp N` the blocks are cut into N pipeline stages as well (`parallelize` with the
same Megatron plan and a pp_config): each step runs `--micro-batches` micro-batches in the
order of `--schedule` (FThenB or 1F1B; with `--static` also ZBH1, and VPP with `--vpp 2`).

Data is generated, no downloads: every sequence counts up modulo the vocabulary with its
own stride, so the next token is predictable from the context and the loss falls fast.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import autopar as dist


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.proj = torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def attention(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def megatron_plan(name: str, layer: torch.nn.Module, mesh: dist.ProcessMesh) -> None:
    """shard_fn for shard_layer: where each weight of the GPT goes on the (dp, mp) mesh."""
    col, row, rep = [dist.Replicate(), dist.Shard(0)], [dist.Replicate(), dist.Shard(1)], None
    leaf = name.rsplit(".", 1)[-1]
    plan = {"q": col, "k": col, "v": col, "fc1": col, "proj": row, "fc2": row, "head": col, "tok": col}
    placements = plan.get(leaf, rep)
    if placements is None:
        return
    for pname, p in list(layer.named_parameters(recurse=False)):
        # biases of row-parallel layers are added after the reduction: keep them replicated
        pl = placements if (pname == "weight" or placements is col) else [dist.Replicate(), dist.Replicate()]
        setattr(layer, pname, dist.shard_tensor(p, mesh, pl))


def parallel_config(args) -> dict:
    """The same Megatron layout for `parallelize`, with the blocks cut into pipeline stages."""
    col, row = dist.ColWiseParallel(), dist.RowWiseParallel()
    plan = {f"blocks.*.{name}": col for name in ("q", "k", "v", "fc1")}
    plan.update({"blocks.*.proj": row, "blocks.*.fc2": row, "head": col, "tok": row})  # tok: vocabulary rows
    pipeline = {"split_spec": "blocks", "schedule_mode": args.schedule, "accumulate_steps": args.micro_batches,
                "vpp_degree": args.vpp}
    return {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": plan}, "pp_config": pipeline}


def batches(args, steps):
    """Sequences counting up modulo vocab with a per-sequence stride: learnable, generated."""
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
        stride = torch.randint(1, 4, (args.batch, 1), generator=g)
        seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
        yield seq[:, :-1], seq[:, 1:]


def build(args, mesh):
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    if mesh is not None and "pp" in mesh.dim_names:
        return dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=args.lr), mesh, parallel_config(args))
    if mesh is not None:
        dist.shard_layer(model, mesh, megatron_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    return model, opt


def train_pipelined(args, mesh, progress=False, static=False):
    """One loss per batch, each batch in micro-batches through the pipeline stages (dynamic:
    `pipelining.build_schedule`; static: `to_static`, which reads the schedule from pp_config)."""
    model, opt = build(args, mesh)
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))  # noqa: E731
    step = dist.to_static(model, None, loss_fn, opt) if static else dist.pipelining.build_schedule(model, loss_fn)
    if progress and not static:
        print(step.format_order())
    losses = []
    meter = dist.StepMeter(args.batch * args.seq, model, seq=args.seq)
    bar = tqdm(batches(args, args.steps), total=args.steps, disable=not progress, desc="train", unit="step")
    for x, y in bar:
        with meter.step():
            if static:
                losses.append(float(step(x, y)))
            else:
                losses.append(step.step(x, target=y).item())
                opt.step()
                opt.zero_grad()
        bar.set_postfix_str(f"loss {losses[-1]:.3f}  {meter.last}")
    times = None if static else step.format_times()  # (collective: every rank)
    if progress:
        print(step.dist_main_program().split("\n")[0] if static else f"the last step, per rank:\n{times}")
    return model, losses, meter


def train(args, mesh, progress=False, static=False):
    """One loss per batch; with --merge K the optimizer steps once per K batches, on the mean
    of their gradients (dynamic: accumulated by backward; static: Strategy.gradient_merge)."""
    if mesh is not None and "pp" in mesh.dim_names:
        return train_pipelined(args, mesh, progress, static)
    model, opt = build(args, mesh)
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))  # noqa: E731
    # static: the same annotated model as a captured program (first step captured, then replayed)
    strategy = dist.Strategy({"gradient_merge": {"enable": args.merge > 1, "k_steps": args.merge, "avg": True}})
    step = dist.to_static(model, None, loss_fn, opt, strategy) if static else None
    losses = []
    meter = dist.StepMeter(args.batch * args.seq, model, seq=args.seq)
    data = batches(args, args.steps)
    bar = tqdm(data, total=args.steps, disable=not progress, desc="train", unit="step")
    for x, y in bar:
        with meter.step():
            if mesh is not None:
                x = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()])
                y = dist.shard_tensor(y, mesh, [dist.Shard(0), dist.Replicate()])
            if step is not None:
                losses.append(float(step(x, y)))
            else:
                loss = loss_fn(model(x), y)
                (loss / args.merge).backward()
                if len(losses) % args.merge == args.merge - 1:
                    opt.step()
                    opt.zero_grad()
                losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.3f}  {meter.last}")
    if step is not None and progress:
        print("static program (forward, backward, gradient reduction):", step.dist_main_program().splitlines()[0])
    return model, losses, meter


def print_plan(model, mesh):
    print(f"mesh {mesh.shape} {mesh.dim_names} ranks {mesh.process_ids}")
    for name, p in model.named_parameters():
        if ".blocks." in f".{name}" and not name.startswith("blocks.0."):
            continue
        stage = f" on ranks {p.process_mesh.process_ids}" if p.process_mesh != mesh else ""
        print(f"  {name:28s} {str(list(p.shape)):14s} {str(p.placements):32s} local {list(p.local_value().shape)}"
              f"{stage}")
    print("  (blocks.1.. as blocks.0)")


def plot_losses(path: str, losses: list, reference: list | None, title: str) -> None:
    """The loss curve (and the single-process one under --check) as an image file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label="autopar", linewidth=2)
    if reference is not None:
        ax.plot(range(1, len(reference) + 1), reference, "--", label="one process", linewidth=1)
    ax.set(xlabel="step", ylabel="cross-entropy loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(rows: list) -> str:
    """Aligned `name  value` lines under a heading."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(["summary"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, data and optimizer settings (shared with benchmarks/bench_gpt.py)."""
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mp", type=int, default=2, help="tensor-parallel degree (the rest is data parallel)")
    p.add_argument("--static", action="store_true", help="run the step as a captured program (dist.to_static)")
    p.add_argument("--merge", type=int, default=1, help="batches per optimizer step (gradient accumulation)")
    p.add_argument("--check", action="store_true", help="also run one process and compare every loss")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the blocks cut evenly)")
    p.add_argument("--schedule", default="1F1B", help="pipeline schedule: FThenB, 1F1B; static also ZBH1, VPP")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step with --pp")
    p.add_argument("--vpp", type=int, default=1, help="stages per pipeline rank (with --schedule VPP)")
    p.add_argument("--plot", metavar="PNG", help="write the loss curve to this image file (matplotlib)")
    args = p.parse_args()

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (args.mp * args.pp):
        raise SystemExit(f"--mp {args.mp} x --pp {args.pp} does not divide the world size {world}")
    dp = world // (args.mp * args.pp)
    if args.pp > 1:
        mesh = dist.ProcessMesh(torch.arange(world).reshape(args.pp, dp, args.mp).tolist(), dim_names=["pp", "dp", "mp"])
    else:
        mesh = dist.ProcessMesh(torch.arange(world).reshape(dp, args.mp).tolist(), dim_names=["dp", "mp"])
    if rank == 0:
        model, _ = build(args, mesh)
        print_plan(model, mesh)
    else:
        build(args, mesh)
    start = time.perf_counter()
    _, losses, meter = train(args, mesh, progress=rank == 0, static=args.static)
    elapsed = time.perf_counter() - start
    speed = meter.summary()
    # every rank's peak memory, read as a value of the job (collective: every rank)
    everyone = dist.ProcessMesh(list(range(world)))
    peaks = dist.unshard_dtensor(dist.dtensor_from_local(torch.tensor([speed.peak_memory_bytes]), everyone,
                                                         [dist.Shard(0)])).tolist()
    ref = train(args, None)[1] if args.check else None
    if ref is not None:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    if rank != 0:
        return
    layout = " x ".join(f"{n} {k}" for n, k in zip(mesh.dim_names, mesh.shape))
    mode = "static (to_static)" if args.static else "dynamic"
    rows = [("mesh", f"{layout} ({world} ranks), {mode}"),
            ("model", f"GPT {args.layers} layers, dim {args.dim}, vocab {args.vocab}, batch {args.batch} x {args.seq}"),
            ("steps", f"{args.steps}, {1000 * elapsed / args.steps:.0f} ms/step"),
            ("loss", f"{losses[0]:.3f} -> {losses[-1]:.3f} (uniform guess: {math.log(args.vocab):.3f})"),
            ("speed", f"{speed.tokens_per_second:,.0f} tokens/s, MFU {100 * speed.mfu:.2f}% of a {meter.profile} "
                      f"{meter.precision} peak, {100 * speed.comm_share:.0f}% of rank 0's step blocked in transfers "
                      f"(medians after the first step)"),
            ("peak memory", ", ".join(f"rank {r} {p / 2**20:,.0f} MiB" for r, p in enumerate(peaks)))]
    if ref is not None:
        rows.append(("check", f"{args.steps} losses match the single-process run"))
    if args.plot:
        plot_losses(args.plot, losses, ref, f"GPT on {layout} ({world} ranks)")
        rows.append(("plot", args.plot))
    print(summary(rows))


if __name__ == "__main__":
    main()
