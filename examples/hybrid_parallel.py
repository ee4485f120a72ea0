"""3-D hybrid: data parallel on mesh dim "x", tensor parallel on "y", pipeline across two
2x2 meshes; the dataloader puts inputs on the first mesh, labels on the last.  Section 4.4
of Paddle's auto-parallel training guide.

    python -m autopar.launch --nproc_per_node 8 examples/hybrid_parallel.py --check
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
        input = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        label = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return input, label

    def __len__(self):
        return self.num_samples


class MlpModel(torch.nn.Module):
    def __init__(self, hidden, ffn, mesh0=None, mesh1=None):
        super().__init__()
        self.mesh1 = mesh1
        w0 = torch.nn.Parameter(torch.randn(hidden, ffn) * hidden**-0.5)
        w1 = torch.nn.Parameter(torch.randn(ffn, hidden) * ffn**-0.5)
        if mesh0 is not None:
            w0 = dist.shard_tensor(w0, mesh0, [dist.Replicate(), dist.Shard(1)])  # tensor parallel, columns
            w1 = dist.shard_tensor(w1, mesh1, [dist.Replicate(), dist.Shard(0)])  # tensor parallel, rows
        self.w0, self.w1 = w0, w1

    def forward(self, x):
        y = torch.matmul(x, self.w0)
        if self.mesh1 is not None:
            y = dist.reshard(y, self.mesh1, [dist.Shard(0), dist.Shard(2)])  # pipeline
        z = torch.matmul(y, self.w1)
        return z


def train(meshes, args):
    torch.manual_seed(args.seed)
    model = MlpModel(args.hidden, args.ffn, *meshes)
    dataset = RandomDataset(args.seq, args.hidden, num_samples=args.batch * args.steps)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    if meshes[0] is not None:
        dataloader = dist.shard_dataloader(dataloader, meshes=list(meshes), shard_dims="x")
        opt = dist.shard_optimizer(opt)
        batches = dataloader()
    else:
        batches = iter(dataloader)
    data = (inputs[0] for inputs in batches)
    return model, run_steps(model, opt, data, static=args.static and meshes[0] is not None)


def main():
    args = example_args(__doc__, batch=2)
    if dist.get_world_size() != 8:
        raise SystemExit("the 3-D hybrid example runs on 8 ranks (two 2x2 meshes)")
    mesh0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    mesh1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])
    model, losses = train((mesh0, mesh1), args)
    finish(args, model, losses, lambda: train((None, None), args))


if __name__ == "__main__":
    main()
