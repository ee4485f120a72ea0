"""Imported once by the test pool's forkserver: the first meta-tensor op makes torch import
its meta kernels (dynamo, inductor, sympy; about a second), which forked ranks then share."""
import torch

torch.ops.aten.add.Tensor(torch.empty(1, device="meta"), torch.empty(1, device="meta"))
