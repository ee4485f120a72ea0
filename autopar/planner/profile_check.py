"""Whether a CPU profile describes the machine it is used on.

A profile is a measurement of one machine (`python -m autopar.planner --calibrate`); on
another, or on the same one changed, every prediction made with it is off by what moved.
It records where and when it was calibrated, and on its first use in a process two of its
constants are measured again (the GEMM rate at 128 x 128, cache-cold as calibrated, and the
per-op latency: under a tenth of a second); one that moved by more than TOLERANCE beyond
the spread the calibration saw over its rounds gives a `ProfileMismatchWarning` saying what
moved, where the profile was made, and how to calibrate this machine.  The spread counts:
on a shared machine the per-op latency is 1.5 or 3 us by spells lasting from a tenth of a
second to seconds, so one timing against one value warned on the very machine calibrated.
"""
from __future__ import annotations

import warnings

from .cost import (CHECKED_GEMM, CPU_PROFILE_ENV, DeviceProfile, _cold_call, _one_thread, _per_call,
                   checked_gemm_rate, machine_signature)

TOLERANCE = 0.3  # a constant more than 30% beyond its calibrated spread no longer describes the machine
_CHECKED: dict = {}  # profile -> the problems found, once per process


class ProfileMismatchWarning(UserWarning):
    """The device profile's measured constants do not hold on this machine."""


def measure_constants() -> dict:
    """The constants the check compares, measured now as `calibrate` measures them: the
    per-op latency and the GEMM rate at 128 x 128 (FLOP/s)."""
    import torch

    with _one_thread():
        a, b = torch.ones(1), torch.ones(1)
        op = _per_call(lambda: torch.add(a, b))
        n = CHECKED_GEMM
        seconds = _cold_call(lambda: (torch.randn(n, n), torch.randn(n, n)), torch.mm, 8 * n * n, 1 << 25)
    return {"kernel_latency": op, "gemm_rate": checked_gemm_rate(seconds, op)}


def _profile_constants(profile: DeviceProfile) -> dict:
    from .predict import flop_rate

    return {"kernel_latency": profile.kernel_latency, "gemm_rate": flop_rate(2.0 * CHECKED_GEMM**3, profile)}


def moved_constants(profile: DeviceProfile, measured: dict) -> list[str]:
    """The constants of `profile` that `measured` (from `measure_constants`) puts more than
    TOLERANCE beyond the lowest and highest its calibration measured (`check_spread`; a
    profile without one: its value), each as 'name: profile's value, measured value'."""
    moved, spread = [], {name: (low, high) for name, low, high in profile.check_spread}
    for name, want in _profile_constants(profile).items():
        low, high = spread.get(name, (want, want))
        low, high = min(low, want), max(high, want)
        got = measured[name]
        if got < low * (1 - TOLERANCE) or got > high * (1 + TOLERANCE):
            seen = f" (its calibration's rounds {low:.3g}-{high:.3g})" if high > low else ""
            moved.append(f"{name} {want:.3g} in the profile{seen}, {got:.3g} measured ({got / want:.2f}x)")
    return moved


def check_profile(profile: DeviceProfile) -> list[str]:
    """On the first use of a CPU profile in this process, measure its constants again and warn
    (`ProfileMismatchWarning`) if one moved; the problems found (none: it holds).  Profiles of
    other devices (datasheet figures) are not checked: this machine cannot measure them."""
    if profile.name != "cpu":
        return []
    if profile not in _CHECKED:
        moved = moved_constants(profile, measure_constants())
        _CHECKED[profile] = moved
        if moved:
            where = (f"calibrated on {profile.calibrated_on or 'an unrecorded machine'}"
                     f"{' on ' + profile.calibrated_at if profile.calibrated_at else ''}")
            warnings.warn(
                f"the cpu profile does not describe this machine ({machine_signature()}): {'; '.join(moved)}. "
                f"It was {where}; predictions made with it are off by as much.  Calibrate this machine: "
                f"python -m autopar.planner --calibrate cpu.json, then {CPU_PROFILE_ENV}=cpu.json",
                ProfileMismatchWarning, stacklevel=3)
    return _CHECKED[profile]
