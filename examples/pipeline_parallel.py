"""Pipeline parallel: w0 lives on mesh0, w1 on mesh1; an explicit reshard moves the
activation from stage 0 to stage 1 (and its gradient back in backward).  Section 4.3 of
Paddle's auto-parallel training guide.

    python -m autopar.launch --nproc_per_node 8 examples/pipeline_parallel.py --check

Every rank runs the whole program: a rank skips the ops of the stage it is not in, and
`loss.backward()` on every rank drives the backward across the meshes.
"""
import torch

import autopar as dist
from _check import example_args, finish, run_steps


class MlpModel(torch.nn.Module):
    def __init__(self, hidden, ffn, mesh0=None, mesh1=None):
        super().__init__()
        self.mesh1 = mesh1
        w0 = torch.nn.Parameter(torch.randn(hidden, ffn) * hidden**-0.5)
        w1 = torch.nn.Parameter(torch.randn(ffn, hidden) * ffn**-0.5)
        if mesh0 is not None:
            w0 = dist.shard_tensor(w0, mesh0, [dist.Replicate()])
            w1 = dist.shard_tensor(w1, mesh1, [dist.Replicate()])
        self.w0, self.w1 = w0, w1

    def forward(self, x):
        y = torch.matmul(x, self.w0)
        if self.mesh1 is not None:
            # reshard: send stage 0's result to stage 1
            y = dist.reshard(y, self.mesh1, [dist.Replicate()])
        z = torch.matmul(y, self.w1)
        return z


def train(meshes, args):
    torch.manual_seed(args.seed)
    model = MlpModel(args.hidden, args.ffn, *meshes)
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    if meshes[0] is not None:
        opt = dist.shard_optimizer(opt)
    inputs = (torch.rand(args.batch, args.seq, args.hidden) for _ in range(args.steps))
    return model, run_steps(model, opt, inputs, static=args.static and meshes[0] is not None)


def main():
    args = example_args(__doc__)
    world = dist.get_world_size()
    if world % 2:
        raise SystemExit(f"the pipeline example needs an even number of ranks, got {world}")
    mesh0 = dist.ProcessMesh(list(range(world // 2)), dim_names=["x"])
    mesh1 = dist.ProcessMesh(list(range(world // 2, world)), dim_names=["x"])
    model, losses = train((mesh0, mesh1), args)
    if dist.get_rank() == 0:
        print(f"stage 0 {mesh0.process_ids}, stage 1 {mesh1.process_ids}")
    finish(args, model, losses, lambda: train((None, None), args))


if __name__ == "__main__":
    main()
