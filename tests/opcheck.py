"""Check an op (or any function) on distributed inputs against the single-process run.

Call `check` inside a rank function of `distpool.run_dist`: it runs `fn` on plain tensors
and on distributed copies (given placements), compares the global outputs and, with
`grad=True`, the gradients of every floating input, all at fp32 rtol 1e-5.
"""
from __future__ import annotations

import torch

import autopar as dist
from autopar.api.tensors import full_value


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _leaves(o)]
    return []


def check(fn, inputs, placements, mesh, grad=True, rtol=1e-5, atol=1e-5, seed=1234):
    """Returns (distributed outputs, comm_log of the forward)."""
    if not isinstance(mesh, dist.ProcessMesh):
        mesh = dist.ProcessMesh(mesh)
    wants = [grad and x.is_floating_point() for x in inputs]
    ref_in = [x.detach().clone().requires_grad_(w) for x, w in zip(inputs, wants)]
    ref_out = _leaves(fn(*ref_in))
    dist_in = [
        dist.shard_tensor(x.detach().clone(), mesh, p, stop_gradient=not w) if p is not None else x.detach().clone()
        for x, p, w in zip(inputs, placements, wants)
    ]
    with dist.comm_log() as log:
        out = fn(*dist_in)
    outs = _leaves(out)
    assert len(outs) == len(ref_out), f"{len(outs)} outputs vs {len(ref_out)} in the reference"
    for i, (o, r) in enumerate(zip(outs, ref_out)):
        got = full_value(o) if dist.is_dist_tensor(o) else o
        assert got.shape == r.shape, f"output {i}: shape {tuple(got.shape)} vs {tuple(r.shape)}"
        torch.testing.assert_close(got.detach(), r.detach(), rtol=rtol, atol=atol, msg=lambda m: f"output {i}: {m}")
    if grad and any(wants):
        gen = torch.Generator().manual_seed(seed)
        weights = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for r in ref_out if r.is_floating_point()]
        floats_ref = [r for r in ref_out if r.is_floating_point() and r.requires_grad]
        floats_out = [o for o, r in zip(outs, ref_out) if r.is_floating_point() and r.requires_grad]
        if floats_ref:
            sum((r * w).sum() for r, w in zip(floats_ref, weights)).backward()
            # through a copy: a Partial output reduced for the loss keeps its own placements
            # (reducing a view reduces the tensor it views)
            sum((o.clone() * w).sum() for o, w in zip(floats_out, weights)).backward()
            for i, (x, d, w) in enumerate(zip(ref_in, dist_in, wants)):
                if not w:
                    continue
                assert d.grad is not None, f"input {i} got no gradient"
                g = full_value(d.grad) if dist.is_dist_tensor(d.grad) else d.grad
                torch.testing.assert_close(g, x.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad of input {i}: {m}")
    return out, log
