"""A CPU profile records where and when it was calibrated, and on its first use in a process
checks two of its constants on this machine: one that moved warns, saying what moved and how
to calibrate."""
import dataclasses
import time
import warnings

import pytest

from autopar.planner import cost, profile_check
from autopar.planner.profile_check import ProfileMismatchWarning


def _measured_as(profile):
    return {"kernel_latency": profile.kernel_latency, "gemm_rate": profile_check._profile_constants(profile)["gemm_rate"]}


def test_a_profile_whose_constants_hold_is_quiet(monkeypatch):
    profile = dataclasses.replace(cost.CPU, calibrated_at="2026-01-02")
    monkeypatch.setattr(profile_check, "measure_constants", lambda: _measured_as(profile))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile_check.check_profile(profile) == []


def test_a_constant_that_moved_warns_once_naming_it_and_the_calibration(monkeypatch):
    profile = dataclasses.replace(cost.CPU, calibrated_on="another machine, 2 cores, 24 GiB", calibrated_at="2026-01-03")
    measured = {**_measured_as(profile), "gemm_rate": 1.6 * _measured_as(profile)["gemm_rate"]}
    monkeypatch.setattr(profile_check, "measure_constants", lambda: measured)
    with pytest.warns(ProfileMismatchWarning) as caught:
        moved = profile_check.check_profile(profile)
    assert len(moved) == 1 and moved[0].startswith("gemm_rate") and "(1.60x)" in moved[0]
    text = str(caught[0].message)
    assert "calibrated on another machine, 2 cores, 24 GiB on 2026-01-03" in text
    assert "python -m autopar.planner --calibrate cpu.json, then AUTOPAR_CPU_PROFILE=cpu.json" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile_check.check_profile(profile) == moved  # once per process


def test_a_constant_is_checked_against_the_spread_its_calibration_saw(monkeypatch):
    # this machine's per-op latency is 1.5 or 3 us by spells: a calibration whose rounds saw
    # both does not warn at either; a machine a third faster than the fastest round does
    spread = (("kernel_latency", 1.5e-6, 3.3e-6),)
    profile = dataclasses.replace(cost.CPU, kernel_latency=3.2e-6, check_spread=spread, calibrated_at="2026-01-04")
    for latency, warns in ((1.6e-6, False), (3.4e-6, False), (1.0e-6, True), (4.5e-6, True)):
        profile_check._CHECKED.clear()
        monkeypatch.setattr(profile_check, "measure_constants",
                            lambda: {**_measured_as(profile), "kernel_latency": latency})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            moved = profile_check.check_profile(profile)
        assert bool(moved) == warns == bool(caught), (latency, moved)
        if warns:
            assert "kernel_latency 3.2e-06 in the profile (its calibration's rounds 1.5e-06-3.3e-06)" in moved[0]


def test_the_check_measures_this_machine_in_well_under_a_second():
    start = time.perf_counter()
    measured = profile_check.measure_constants()
    assert time.perf_counter() - start < 1.0
    assert 1e-8 < measured["kernel_latency"] < 1e-3 and 1e8 < measured["gemm_rate"] < 1e13


def test_calibration_stamps_the_machine_and_the_day_and_profiles_of_other_devices_are_not_checked():
    stamp = cost.calibration_stamp()
    assert stamp["calibrated_on"] == cost.machine_signature() and "cores" in stamp["calibrated_on"]
    assert len(stamp["calibrated_at"]) == 10  # an ISO date
    assert profile_check.check_profile(cost.H100) == []
