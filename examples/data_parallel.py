"""Data parallel: only the input is marked (Shard(0) on the batch dim), as in section 4.1 of
Paddle's auto-parallel training guide.

    python -m autopar.launch --nproc_per_node 4 examples/data_parallel.py --check

The weights stay plain Parameters; autopar treats them as Replicate where they meet the
sharded input, and their gradients come back reduced (plain tensors) for the optimizer.
"""
import numpy as np
import torch

import autopar as dist
from _check import example_args, finish, run_steps


class RandomDataset(torch.utils.data.Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        super().__init__()
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng(index)
        return rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")

    def __len__(self):
        return self.num_samples


class MlpModel(torch.nn.Module):
    def __init__(self, hidden, ffn, mesh=None):
        super().__init__()
        self.mesh = mesh
        self.w0 = torch.nn.Parameter(torch.randn(hidden, ffn) * hidden**-0.5)
        self.w1 = torch.nn.Parameter(torch.randn(ffn, hidden) * ffn**-0.5)

    def forward(self, x):
        if self.mesh is not None:
            # mark the data as sharded (the program's only annotation)
            x = dist.shard_tensor(x, self.mesh, [dist.Shard(0)])
        y = torch.matmul(x, self.w0)
        z = torch.matmul(y, self.w1)
        return z


def train(mesh, args):
    torch.manual_seed(args.seed)
    model = MlpModel(args.hidden, args.ffn, mesh)
    dataset = RandomDataset(args.seq, args.hidden, num_samples=args.batch * args.steps)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    if mesh is not None:
        opt = dist.shard_optimizer(opt)
    return model, run_steps(model, opt, loader, static=args.static and mesh is not None)


def main():
    args = example_args(__doc__)
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["x"])
    model, losses = train(mesh, args)
    finish(args, model, losses, lambda: train(None, args))


if __name__ == "__main__":
    main()
