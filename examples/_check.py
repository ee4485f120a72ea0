"""--check support for the examples: run the single-process program and compare."""
from __future__ import annotations

import torch

import autopar as dist


def compare(losses, ref_losses, params: dict, ref_params: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Every step's loss (rtol) and every final parameter (rtol, atol for near-zero entries) match."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    for name, p in params.items():
        got = dist.unshard_dtensor(p.detach()) if dist.is_dist_tensor(p) else p.detach()
        torch.testing.assert_close(got, ref_params[name].detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    if dist.get_rank() == 0:
        print(f"check: {len(losses)} losses and {len(params)} parameters match the single-process run")
