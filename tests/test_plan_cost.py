"""The cost model's pure functions against the alpha-beta formulas worked by hand."""
import dataclasses
import json

import pytest

from autopar.planner import cost
from autopar.planner.cost import A100, H100, H200, collective_time, link, load_profile


def test_published_profiles():
    assert H100.peak_flops_bf16 == 989e12 and H100.memory_bytes == 80e9 and H100.hbm_bandwidth == 3.35e12
    assert H100.intra_bandwidth == 450e9 and H100.inter_bandwidth == 50e9  # NVLink per direction, 400 Gb/s IB
    assert H200.memory_bytes == 141e9 and H200.hbm_bandwidth == 4.8e12 and H200.peak_flops_bf16 == 989e12
    assert A100.peak_flops_bf16 == 312e12 and A100.intra_bandwidth == 300e9 and A100.inter_bandwidth == 25e9
    assert load_profile("h200") is H200 and load_profile(A100) is A100


@pytest.mark.parametrize("op, steps, factor", [
    ("all_reduce", 2 * 7, 2 * 7 / 8), ("all_gather", 7, 7 / 8), ("reduce_scatter", 7, 7 / 8),
    ("all_to_all", 7, 7 / 8), ("send", 1, 1.0),
])
def test_ring_collectives_inside_a_node(op, steps, factor):
    nbytes = 3e8
    want = steps * H100.intra_latency + factor * nbytes / H100.intra_bandwidth
    assert collective_time(op, nbytes, 8, H100) == pytest.approx(want, rel=1e-12)


def test_a_group_spanning_nodes_pays_the_network():
    # 8 ranks 8 apart (a data-parallel group across tp8 blocks): every hop leaves the node
    want = 2 * 7 * H100.inter_latency + 2 * 7 / 8 * 1e9 / H100.inter_bandwidth
    assert collective_time("all_reduce", 1e9, 8, H100, stride=8) == pytest.approx(want, rel=1e-12)
    assert link(H100, 4, 2) == (H100.intra_latency, H100.intra_bandwidth)  # ranks 0, 2, 4, 6
    assert link(H100, 16, 1) == (H100.inter_latency, H100.inter_bandwidth)
    assert collective_time("all_gather", 1e9, 1, H100) == 0.0


def test_unknown_collective_and_device_are_named():
    with pytest.raises(ValueError, match="'gather'"):
        collective_time("gather", 1.0, 2, H100)
    with pytest.raises(ValueError, match="'v100'"):
        load_profile("v100")


def test_compute_time_is_flops_at_efficient_peak_plus_launches():
    t = cost.matmul_time(1e15, 10, H100)
    assert t == pytest.approx(1e15 / (989e12 * 0.7) + 10 * 5e-6)
    assert cost.matmul_time(1e12, 0, H100, "fp32") == pytest.approx(1e12 / (67e12 * 0.7))
    assert cost.memory_bound_time(3.35e12, H100) == pytest.approx(1.0)


def test_fit_line_recovers_alpha_and_beta():
    xs = [2.0**k for k in range(8, 24, 2)]
    a, b = cost._fit_line(xs, [3e-9 * x + 2e-5 for x in xs])
    assert a == pytest.approx(3e-9) and b == pytest.approx(2e-5)


def test_profile_round_trips_through_json(tmp_path, monkeypatch):
    mine = dataclasses.replace(A100, name="cpu", ranks_per_node=4)
    path = tmp_path / "cpu.json"
    cost.save_profile(mine, str(path))
    assert json.loads(path.read_text())["ranks_per_node"] == 4
    assert load_profile(str(path)) == mine
    monkeypatch.setenv(cost.CPU_PROFILE_ENV, str(path))
    assert load_profile("cpu") == mine
