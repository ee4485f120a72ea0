"""Pipeline orders are pure: every rank's order, checked without processes."""
import pytest

from autopar.pipelining.orders import Action, fthenb, format_orders, interleaved, one_f_one_b, peak_held, simulate, zbh1, zbvpp

SIZES = [(1, 1), (2, 2), (2, 8), (4, 4), (4, 8), (3, 7)]


def _kinds(orders):
    return {a.kind for row in orders for a in row}


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("build", [fthenb, one_f_one_b, zbh1])
def test_every_action_once_on_its_stage_in_micro_batch_order(build, p, m):
    orders = build(p, m)
    kinds = "FIW" if build is zbh1 else "FB"
    assert _kinds(orders) == set(kinds)
    for r, row in enumerate(orders):
        assert sorted(row) == sorted(Action(k, r, i) for k in kinds for i in range(m))
        for k in kinds:  # a stage edge's messages are made in the order the next stage takes them
            assert [a.mb for a in row if a.kind == k] == list(range(m))
    simulate(orders, p)  # no rank waits forever


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 9)])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("build, kinds", [(interleaved, "FB"), (zbvpp, "FIW")])
def test_virtual_stages_place_stage_k_on_rank_k_mod_p(build, kinds, p, v, m):
    """Interleaved 1F1B and its zero-bubble form: every action once, on its rank, each kind
    of a stage in micro-batch order, and no rank waits forever; ZBVPP with one stage per
    rank is ZB-H1."""
    orders = build(p, v, m)
    for r, row in enumerate(orders):
        assert sorted(row) == sorted(Action(k, s, i) for k in kinds for s in range(r, p * v, p) for i in range(m))
        for s in range(r, p * v, p):
            for k in kinds:
                assert [a.mb for a in row if a.kind == k and a.stage == s] == list(range(m))
    simulate(orders, p * v)
    if build is zbvpp and v == 1:
        assert orders == zbh1(p, m)


@pytest.mark.parametrize("p,v,m", [(2, 2, 8), (4, 2, 8), (4, 2, 16), (4, 3, 8)])
def test_zero_bubble_over_virtual_stages_against_interleaved_1f1b(p, v, m):
    """With I = W = F (B = 2F): about a third of interleaved 1F1B's bubble, and no rank holds
    more activations than interleaved 1F1B's first rank."""
    zb = simulate(zbvpp(p, v, m), p * v, costs={"F": 1, "I": 1, "W": 1})
    vpp = simulate(interleaved(p, v, m), p * v, costs={"F": 1, "B": 2})
    assert zb.bubble < 0.4 * vpp.bubble
    assert max(peak_held(zbvpp(p, v, m))) <= peak_held(interleaved(p, v, m))[0]


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_bubbles_and_memory(p, m):
    """With B = 2F: FThenB and 1F1B idle (p-1)/(m+p-1); ZB-H1 with F = I = W idles (p-1) units
    instead of 3(p-1); interleaving over v stages per rank cuts the bubble about v times."""
    gpipe, ofob, zb = simulate(fthenb(p, m), p), simulate(one_f_one_b(p, m), p), simulate(zbh1(p, m), p)
    assert gpipe.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert ofob.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert zb.makespan == 3 * m + p - 1
    vpp = simulate(interleaved(p, 2, m), 2 * p, costs={"F": 0.5, "B": 1.0})
    assert vpp.bubble < ofob.bubble * 0.65
    assert gpipe.peak_in_flight == {s: m for s in range(p)}
    assert ofob.peak_in_flight == {s: p - s for s in range(p)}  # 1F1B: at most num_stages - stage_index
    assert max(zb.peak_in_flight.values()) == p  # ZB-H1: 1F1B's peak (stage 0's) everywhere


def test_an_inconsistent_order_is_refused():
    orders = one_f_one_b(2, 2)
    orders[1] = [Action("B", 1, 0), Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 1)]
    with pytest.raises(ValueError, match=r"rank 1 waits at Action\(kind='B', stage=1, mb=0\)"):
        simulate(orders, 2)


def test_format_orders_names_the_stage_when_a_rank_holds_several():
    assert format_orders(one_f_one_b(2, 2)) == "rank 0: F0 F1 B0 B1\nrank 1: F0 B0 F1 B1"
    assert format_orders(interleaved(2, 2, 2)).splitlines()[1] == "rank 1: F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 B0s1 B1s1"
