"""Imported once by the test pool's forkserver, so that every forked rank shares what it
loads instead of loading it again: torch's meta kernels (the first meta-tensor op makes torch
import dynamo, inductor, sympy; about a second) and transformers' modelling core (most test
files build tiny HF models; seconds of CPU per process)."""
import torch

torch.ops.aten.add.Tensor(torch.empty(1, device="meta"), torch.empty(1, device="meta"))

try:
    import transformers.modeling_utils  # noqa: F401
except ImportError:  # an optional test dependency
    pass
