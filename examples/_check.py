"""What the four strategy examples (data, tensor, pipeline, hybrid parallel) share: their
command line and the --check against one process."""
from __future__ import annotations

import argparse

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


def example_args(doc: str, batch: int = 4) -> argparse.Namespace:
    """The guide's sizes by default (hidden 1024, ffn 4096, 128 tokens); --check compares."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static", action="store_true",
                   help="run the distributed steps as a captured program (dist.to_static)")
    p.add_argument("--check", action="store_true", help="also run one process and compare")
    return p.parse_args()


def run_steps(model, opt, inputs, static: bool = False) -> list[float]:
    """One training step per input, loss = mean(model(x)): the dynamic loop, or with `static`
    the same annotated model as a `to_static` program (the guide's section 4.5)."""
    if static:
        dist_model = dist.to_static(model, None, torch.mean, opt)
        dist_model.train()
        return [float(dist_model(x)) for x in inputs]
    losses = []
    for x in inputs:
        loss = torch.mean(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def finish(args, model, losses, reference) -> None:
    """Print the losses on rank 0; with --check run `reference()` (the single-process
    program, returning (model, losses)) and fail unless everything matches."""
    if dist.get_rank() == 0:
        print("losses", [round(v, 6) for v in losses])
    if args.check:
        ref, ref_losses = reference()
        compare(losses, ref_losses, dict(model.named_parameters()), dict(ref.named_parameters()))
