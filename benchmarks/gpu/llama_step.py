"""A Llama-shaped model on one GPU: plain torch against autopar on the same card, same weights
and batches, in bf16 with HF's sdpa attention (on a GPU: the flash kernel).

    python benchmarks/gpu/llama_step.py                # about 1B parameters, 2048 tokens a sequence
    python benchmarks/gpu/llama_step.py --dry-run      # toy size on this machine's CPU (the suite runs it)

Variants, each stepped `--steps` times after a warm-up step (AdamW, loss.backward, step):
  plain      : the model as it is.
  autopar    : the same model on a 1-rank mesh (shard_layer + shard_optimizer): every op goes
               through autopar's dispatch; its overhead over plain is the point of the check.
  simulated  : rank 0 of a dp 4 x mp 2 job (`dist.simulate`, Megatron plan through
               `parallelize`): the GPU computes that rank's pieces, the collectives are recorded
               and not sent; its step must send nothing for attention.
Prints one line per variant: tokens/s, MFU against the card's peak, peak memory, and
autopar's step time over plain's; exits non-zero if a loss differs from plain's beyond bf16
rounding or the simulated rank gathers for attention.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import autopar as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
from hf_llama import mp_plan  # noqa: E402


def config(dry_run: bool):
    from transformers import LlamaConfig

    if dry_run:
        sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    else:  # 1.0 B parameters: TinyLlama's shape with 16 layers
        sizes = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=4)
    return LlamaConfig(**sizes, max_position_embeddings=4096, attn_implementation="sdpa")


def build(cfg, device, dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype)


def batches(cfg, n: int, batch: int, seq: int, device) -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device) for _ in range(n)]


def run(model, opt, data, meter) -> list:
    losses = []
    for ids in data:
        with meter.step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="toy size, on the CPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    seq = 32 if args.dry_run else args.seq
    cfg = config(args.dry_run)
    precision = "bf16" if dtype is torch.bfloat16 else "fp32"
    data = batches(cfg, args.steps + 1, args.batch, seq, device)
    tokens = args.batch * seq
    rows, losses = {}, {}

    # rank 0 of a dp 4 x mp 2 job: its pieces computed on this device, nothing sent (first: a
    # simulation runs in a process that belongs to no job, and the 1-rank mesh below makes one)
    with dist.simulate(8, 0):
        mesh = dist.ProcessMesh([[0, 1], [2, 3], [4, 5], [6, 7]], dim_names=["dp", "mp"])
        model = build(cfg, device, dtype)
        meter = dist.StepMeter(tokens * 4, model, seq=seq, precision=precision)
        model, opt = dist.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), mesh,
                                      {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": mp_plan()}})
        with dist.comm_log() as log:
            for ids in data[:2]:
                with meter.step():
                    ids = dist.shard_tensor(torch.cat([ids] * 4), mesh, [dist.Shard(0), dist.Replicate()])
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        simulated = meter.steps[-1]

    for variant in ("plain", "autopar"):
        model = build(cfg, device, dtype)
        meter = dist.StepMeter(tokens, model, seq=seq, precision=precision)
        if variant == "autopar":
            model = dist.shard_layer(model, dist.ProcessMesh([0], dim_names=["dp"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if variant == "autopar":
            opt = dist.shard_optimizer(opt)
        losses[variant] = run(model, opt, data, meter)
        rows[variant] = meter.summary()
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    rows["simulated"] = simulated

    card = torch.cuda.get_device_name() if cuda else "CPU"
    params = sum(p.numel() for p in build(cfg, "meta", dtype).parameters())
    print(f"{card}: Llama {params / 1e9:.2f} B parameters, {cfg.num_hidden_layers} layers, batch {args.batch} x {seq}, "
          f"{precision}, {args.steps} steps after a warm-up")
    for name, stats in rows.items():
        ratio = f"  {stats.seconds / rows['plain'].seconds:.3f}x plain's step" if name == "autopar" else ""
        print(f"  {name:10s} {stats}{ratio}")
    gathered = [r for r in log if r.op == "all_gather" and len(r.shape) == 4]  # (batch, heads, seq, head dim)
    tolerance = 2e-2 if dtype is torch.bfloat16 else 1e-5
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses["autopar"], losses["plain"]))
    print(f"  losses: autopar against plain, worst relative difference {worst:.2e} (tolerance {tolerance:g}); "
          f"simulated rank: {len(log)} collectives, {len(gathered)} attention gathers")
    if worst > tolerance or gathered:
        print("FAILED: " + ("losses differ" if worst > tolerance else "the simulated rank gathers attention inputs"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
