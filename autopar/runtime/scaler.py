"""`shard_scaler`: torch's GradScaler for training whose ranks hold different pieces.

torch's GradScaler decides per rank whether a step's gradients hold an inf or a NaN.  With
gradients sharded (ZeRO, tensor parallel) or parameters on pipeline stages, each rank sees
only its own pieces, so ranks would skip different steps and their models diverge.  A sharded
scaler unscales the local pieces of every gradient (after the optimizer's sharding has reduced
them to where they are stepped) and makes one all-reduce (max) of found-inf over the whole
job per step: every rank skips, or steps, together.  Every rank must call `scaler.step` (or
`unscale_`) the same number of times per step.  Gradients of float16 parameters that the
optimizer steps through float32 master weights (a mixed-precision policy) are unscaled too,
which torch refuses for a plain optimizer.
"""
from __future__ import annotations

import types

import torch

from ..comm import all_reduce, get_world_size
from ..placement import ReduceType
from ..tensor.convert import reshard_to
from ..tensor.dtensor import DistTensor


def shard_scaler(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """Make `scaler` agree on skipping steps across the job (Paddle's `dist.shard_scaler`):
    its unscale checks the local pieces of the gradients and reduces found-inf over every
    rank once.  Returns the same scaler; use it as usual.

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["dp"])
    >>> layer = dist.shard_layer(torch.nn.Linear(4, 2), mesh)
    >>> opt = dist.shard_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    >>> scaler = dist.shard_scaler(torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1))
    >>> scaler.scale(layer(torch.ones(2, 4)).sum()).backward()
    >>> scaler.step(opt); scaler.update(); scaler.get_scale()   # no inf anywhere: stepped, scale grows
    8.0
    """
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"shard_scaler needs a torch.amp.GradScaler, got {type(scaler).__name__}")
    scaler._unscale_grads_ = types.MethodType(_unscale_agreed, scaler)
    return scaler


def _unscale_agreed(scaler, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                    allow_fp16: bool) -> dict:
    """GradScaler._unscale_grads_ over local pieces, found-inf agreed by the whole job."""
    sharding = getattr(optimizer, "_autopar_sharding", None)
    mastered = set()
    if sharding is not None:
        sharding.prepare_grads()  # (a Partial term may overflow where the sum would not)
        mastered = {id(zp.param) for zp in sharding.masters}
    pieces: dict = {}  # (device, dtype) -> local pieces of the gradients
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.dtype == torch.float16 and not allow_fp16 and id(p) not in mastered:
                    raise ValueError(f"Attempting to unscale FP16 gradients (a parameter of shape {list(p.shape)}): "
                                     f"give shard_optimizer an mp_policy to step float32 master weights")
                if type(g) is DistTensor:
                    if g._spec.partial_dims():
                        g = p.grad = reshard_to(g.detach(), g._spec.without_partial())
                    g = g._local
                pieces.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros_like(found_inf)
        for (device, _), grads in pieces.items():
            here = torch.zeros(found_inf.shape, dtype=found_inf.dtype, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv_scale.to(device))
            found += here.to(found.device)
        found_inf.copy_(all_reduce(found, tuple(range(get_world_size())), ReduceType.MAX))
    return {found_inf.device: found_inf}
