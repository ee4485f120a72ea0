"""Tensor parallel: w0 sharded by columns, w1 by rows; nothing else marked (section 4.2 of
Paddle's auto-parallel training guide).

    python -m autopar.launch --nproc_per_node 4 examples/tensor_parallel.py --check
"""
import torch

import autopar as dist
from _check import example_args, finish, run_steps


class MlpModel(torch.nn.Module):
    def __init__(self, hidden, ffn, mesh=None):
        super().__init__()
        w0 = torch.nn.Parameter(torch.randn(hidden, ffn) * hidden**-0.5)
        w1 = torch.nn.Parameter(torch.randn(ffn, hidden) * ffn**-0.5)
        if mesh is not None:
            # mark the parameters: w0 along dim 1 (columns), w1 along dim 0 (rows)
            w0 = dist.shard_tensor(w0, mesh, [dist.Shard(1)])
            w1 = dist.shard_tensor(w1, mesh, [dist.Shard(0)])
        self.w0, self.w1 = w0, w1

    def forward(self, x):
        y = torch.matmul(x, self.w0)
        z = torch.matmul(y, self.w1)
        return z


def train(mesh, args):
    torch.manual_seed(args.seed)
    model = MlpModel(args.hidden, args.ffn, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    inputs = (torch.rand(args.batch, args.seq, args.hidden) for _ in range(args.steps))
    return model, run_steps(model, opt, inputs, static=args.static and mesh is not None)


def main():
    args = example_args(__doc__)
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["x"])
    model, losses = train(mesh, args)
    if dist.get_rank() == 0:
        print(f"w0 {model.w0.placements} local {tuple(model.w0.local_value().shape)}; "
              f"w1 {model.w1.placements} local {tuple(model.w1.local_value().shape)}")
    finish(args, model, losses, lambda: train(None, args))


if __name__ == "__main__":
    main()
