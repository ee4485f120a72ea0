"""Training speed as users read it, step by step: tokens/s, MFU, peak memory per rank and the
share of the step this rank spent blocked in communication.

Model FLOPs come from the planner's accounting of a transformer (`describe(model)`:
6 x the matmul parameters + causal attention, per token, forward and backward), or are
given; the peak is the device profile's (`H100`, `"cpu"`, a calibrated profile file).
"""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from ..comm import get_world_size
from ..comm.log import blocked_seconds
from .cost import DeviceProfile, load_profile
from .describe import describe


def local_profile() -> str:
    """The device profile of this machine's accelerator by its name (H100, H200, A100), else
    "cpu" (a CUDA card the planner has no profile for is measured against the CPU's peak: give
    `device` yourself)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper()
        for card in ("H200", "H100", "A100"):
            if card in name:
                return card.lower()
    return "cpu"


@dataclass(frozen=True)
class StepStats:
    """One measured step of one rank."""

    seconds: float
    tokens_per_second: float  # the job's tokens over the step's time
    mfu: float  # model FLOPs per second per rank over the profile's peak
    peak_memory_bytes: int  # device memory allocated at its peak (a GPU), or the process's peak RSS
    comm_share: float  # of the step's time, blocked in transfers

    def __str__(self) -> str:
        return (f"{self.tokens_per_second:,.0f} tok/s  MFU {100 * self.mfu:.1f}%  "
                f"peak {self.peak_memory_bytes / 2**20:,.0f} MiB  comm {100 * self.comm_share:.0f}%")


class StepMeter:
    """Measures training steps: wrap each in `meter.step()`; `meter.last` is the step's
    `StepStats`, `meter.summary()` their medians over the steps after the first `warmup`.

    `tokens_per_step` counts the whole job's tokens (every data-parallel rank's batch);
    `flops_per_token` defaults to the planner's count for `model` (a transformer it can
    `describe`) at `seq` tokens per sequence.  On a GPU each step ends with a synchronize,
    so that the time is the device's.  `device`: the profile whose peak MFU is measured
    against (default: this machine's, `local_profile()`).

    >>> import torch, autopar as dist
    >>> from autopar.planner.meter import StepMeter
    >>> meter = StepMeter(tokens_per_step=4 * 16, flops_per_token=6 * 64 * 64, device="cpu")
    >>> layer = torch.nn.Linear(64, 64)
    >>> for _ in range(3):
    ...     with meter.step():
    ...         layer(torch.randn(4, 16, 64)).sum().backward()
    >>> stats = meter.summary()
    >>> stats.tokens_per_second > 0 and 0 < stats.mfu < 1 and stats.peak_memory_bytes > 0
    True
    """

    def __init__(self, tokens_per_step: int, model: Optional[torch.nn.Module] = None,
                 flops_per_token: Optional[float] = None, seq: Optional[int] = None,
                 device: Union[str, DeviceProfile, None] = None, precision: str = "fp32", warmup: int = 1):
        if flops_per_token is None:
            if model is None:
                raise ValueError("StepMeter: give the model (a transformer describe() reads) or flops_per_token")
            flops_per_token = describe(model, seq)[0].flops_per_token()
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        profile = load_profile(device or local_profile())
        self.profile, self.precision = profile.name, precision
        self.peak_flops = profile.peak_flops(precision)
        self.warmup = warmup
        self.steps: list[StepStats] = []
        self.last: Optional[StepStats] = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the block as one training step."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        blocked, start = blocked_seconds(), time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ranks = get_world_size()
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.last = StepStats(
            seconds=seconds,
            tokens_per_second=self.tokens_per_step / seconds,
            mfu=self.flops_per_token * self.tokens_per_step / (seconds * ranks * self.peak_flops),
            peak_memory_bytes=int(peak),
            comm_share=min((blocked_seconds() - blocked) / seconds, 1.0),
        )
        self.steps.append(self.last)

    def summary(self) -> StepStats:
        """The median of each figure over the steps after the warm-up (all steps if no more)."""
        steps = self.steps[self.warmup:] or self.steps
        if not steps:
            raise ValueError("StepMeter.summary: no step measured yet (wrap each step in `with meter.step():`)")

        def median(values):
            return sorted(values)[len(values) // 2]

        return StepStats(
            seconds=median([s.seconds for s in steps]),
            tokens_per_second=median([s.tokens_per_second for s in steps]),
            mfu=median([s.mfu for s in steps]),
            peak_memory_bytes=max(s.peak_memory_bytes for s in steps),
            comm_share=median([s.comm_share for s in steps]),
        )
