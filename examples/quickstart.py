"""Quickstart: the seed's tensor-parallel MLP (section 4.2), trained on N CPU ranks.

    python -m autopar.launch --nproc_per_node 4 examples/quickstart.py --check

w0 is sharded by columns and w1 by rows; autopar derives everything else (the hidden
activation stays column-sharded, the output comes out Partial and is reduced once by the
non-linear loss).  With --check each rank also runs the single-process program with the
same seed and the job fails unless every loss and the final weights match (fp32, rtol 1e-5; weights also atol 1e-5: Adam amplifies
summation-order noise in near-zero gradients).
"""
import argparse

import torch

import autopar as dist


class MlpModel(torch.nn.Module):
    def __init__(self, hidden, ffn, mesh=None):
        super().__init__()
        w0 = torch.nn.Parameter(torch.randn(hidden, ffn) * hidden**-0.5)
        w1 = torch.nn.Parameter(torch.randn(ffn, hidden) * ffn**-0.5)
        # mark the parameters: w0 split by columns, w1 by rows
        self.w0 = dist.shard_tensor(w0, mesh, [dist.Shard(1)]) if mesh else w0
        self.w1 = dist.shard_tensor(w1, mesh, [dist.Shard(0)]) if mesh else w1

    def forward(self, x):
        y = torch.matmul(x, self.w0)
        z = torch.matmul(torch.relu(y), self.w1)
        return z


def train(mesh, args):
    torch.manual_seed(args.seed)
    model = MlpModel(args.hidden, args.ffn, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(args.steps):
        x = torch.rand(args.batch, args.seq, args.hidden)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--check", action="store_true", help="compare with the single-process run")
    args = p.parse_args()

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    model, losses = train(mesh, args)
    if rank == 0:
        print(f"mesh {mesh.process_ids}: w0 {model.w0.placements} local {tuple(model.w0.local_value().shape)}, "
              f"w1 {model.w1.placements} local {tuple(model.w1.local_value().shape)}")
        for i, loss in enumerate(losses):
            print(f"step {i}  loss {loss:.6f}")
    if args.check:
        ref_model, ref_losses = train(None, args)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name in ("w0", "w1"):
            got = dist.unshard_dtensor(getattr(model, name).detach())
            torch.testing.assert_close(got, getattr(ref_model, name).detach(), rtol=1e-5, atol=1e-5)
        if rank == 0:
            print(f"check: {args.steps} losses and final weights match the single-process run (rtol 1e-5)")


if __name__ == "__main__":
    main()
