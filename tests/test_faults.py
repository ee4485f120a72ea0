"""What a rank is told when the job goes wrong: a bad AUTOPAR_TIMEOUT, a collective some ranks
never reach, a value read made on some ranks only (and not when the peer died), and mismatched
collectives under AUTOPAR_DEBUG_COLLECTIVES=1; and that value reads made by every rank stay right."""
import datetime
import os
import time

import pytest
import torch

import autopar as dist
from autopar import comm
from autopar.comm import collectives, exits, faults
from autopar.comm.backend import timeout_seconds
from distpool import run_dist


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_autopar_timeout_must_be_a_positive_number_of_seconds(monkeypatch, value):
    monkeypatch.setenv("AUTOPAR_TIMEOUT", value)
    with pytest.raises(ValueError) as e:
        timeout_seconds()
    assert f"AUTOPAR_TIMEOUT={value!r}" in str(e.value)
    assert "expected a positive number of seconds" in str(e.value)


def test_autopar_timeout_accepts_seconds(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TIMEOUT", "0.5")
    assert timeout_seconds() == 0.5
    monkeypatch.delenv("AUTOPAR_TIMEOUT")
    assert timeout_seconds() == 300


def _short_timeout_groups():
    """Sub-groups made from now on (every rank calls this) time out after 2 s."""
    os.environ["AUTOPAR_TIMEOUT"] = "2"
    comm.reset_groups()


def _caught(fn) -> str | None:
    try:
        fn()
    except dist.CommError as e:
        return str(e)
    return None


def _stuck_in_different_collectives():
    """Rank 0 waits in its 2nd all_reduce over [0, 1]; rank 1 made only one and waits in an
    all_reduce over [1, 2] that rank 2 never joins."""
    _short_timeout_groups()
    me = dist.get_rank()
    for ranks in [(0, 1), (1, 2)]:
        if me in ranks:
            comm.group_for(ranks)
    msg = None
    if me < 2:
        comm.all_reduce(torch.ones(3), (0, 1))
        msg = _caught(lambda: comm.all_reduce(torch.ones(3), (0, 1) if me == 0 else (1, 2)))
    # rank 2 keeps its side of [1, 2] until the others have timed out: torn down at once, it
    # could close the group while rank 1 is still connecting to it
    torch.distributed.barrier()
    comm.reset_groups()  # every rank: drop the broken groups
    return msg


def test_a_timeout_names_the_op_the_group_and_the_ranks_that_did_not_arrive():
    msgs = run_dist(_stuck_in_different_collectives, 3)
    assert msgs[0].startswith("all_reduce #2 over ranks [0, 1] failed on rank 0: "), msgs[0]
    assert ("Ranks that did not arrive: rank 1 entered only 1 collective(s) on this group and waits in "
            "all_reduce #1 over ranks [1, 2].") in msgs[0], msgs[0]
    assert "AUTOPAR_TIMEOUT=2 s" in msgs[0]
    assert msgs[1].startswith("all_reduce #1 over ranks [1, 2] failed on rank 1: "), msgs[1]
    assert "Ranks that did not arrive: rank 2 sent no report" in msgs[1], msgs[1]
    assert msgs[2] is None


def _lone_read(unshard=False):
    """Rank 0 reads a value alone (`if rank == 0: print(loss.item())`); rank 1 goes on to its
    next training collective, an all-gather of the same size that the read used to pair with."""
    _short_timeout_groups()
    mesh = dist.ProcessMesh([0, 1])
    t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    msg = None
    if dist.get_rank() == 0:
        msg = _caught(lambda: dist.unshard_dtensor(t * 10) if unshard else t.sum().item())
    elif dist.get_rank() == 1:
        msg = _caught(lambda: dist.reshard(t * 10, mesh, [dist.Replicate()]))
    comm.reset_groups()
    return msg


def test_a_value_read_on_some_ranks_only_fails_naming_the_read():
    msgs = run_dist(_lone_read, 3)
    assert msgs[0] is not None and "over ranks [0, 1] (value reads) failed on rank 0" in msgs[0], msgs[0]
    assert "This collective belongs to a value read (.item()): value reads are collective over the job" in msgs[0]
    assert "rank 1 entered only 0 collective(s) on this group and waits in all_gather #1 over ranks [0, 1]" in msgs[0]
    assert msgs[1] is not None and msgs[1].startswith("all_gather #1 over ranks [0, 1] failed on rank 1"), msgs[1]
    assert "over ranks [0, 1] (value reads)" in msgs[1], msgs[1]


def test_unshard_dtensor_on_some_ranks_only_fails_naming_the_read():
    # (2 ranks: on 3 the read also sends to rank 2 on the world group, whose timeout is the
    # test pool's 60 s, not the 2 s of the groups made for the test)
    msgs = run_dist(_lone_read, 2, True)
    assert "This collective belongs to a value read (unshard_dtensor)" in msgs[0], msgs[0]
    assert msgs[1] is not None and msgs[1].startswith("all_gather #1 over ranks [0, 1] failed on rank 1"), msgs[1]


def _read_while_a_peer_is_gone():
    """Rank 0 reads a value while rank 1 has died (its exit handler recorded it): the read's
    failure names the dead rank and says nothing about reads made on some ranks only."""
    _short_timeout_groups()
    mesh = dist.ProcessMesh([0, 1])
    t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
    msg = None
    if dist.get_rank() == 1:
        faults._store().set(faults._key("left", 1), "failed")  # what `_leave` records for it
    else:
        msg = _caught(lambda: t.sum().item())
    torch.distributed.barrier()
    comm.reset_groups()
    return msg


def test_a_value_read_whose_peer_died_names_it_without_the_value_read_hint():
    msg = run_dist(_read_while_a_peer_is_gone, 2)[0]
    assert msg is not None and "over ranks [0, 1] (value reads) failed on rank 0" in msg, msg
    assert "Ranks that did not arrive: rank 1 has died of an exception." in msg, msg
    assert "value reads are collective" not in msg, msg


def _peer_left_with_sockets_open(how):
    """Rank 0 waits in all_reduce #1 over [0, 1]; then rank 1 records that it left, as a
    leaving rank's exit handler does, and stays away with its sockets open (what an exited NCCL
    peer looks like: nothing fails): rank 0 must fail within a slice of its wait, not at
    AUTOPAR_TIMEOUT.  Then rank 1 joins that all_reduce late, so that nothing is left in flight."""
    os.environ["AUTOPAR_TIMEOUT"] = "60"
    comm.reset_groups()
    me = dist.get_rank()
    comm.group_for((0, 1))  # (the group made: both ranks' watchdogs watch before rank 1 leaves)
    torch.distributed.barrier()
    store, key = faults._store(), f"test/left-with-sockets-open/{how}/{comm.backend._GENERATION[0]}"
    msg = seconds = None
    if me == 1:
        store.wait([key + "/posted"], datetime.timedelta(seconds=60))
        faults.record_left(store, how)
        store.wait([key + "/done"], datetime.timedelta(seconds=60))
        comm.all_reduce(torch.ones(3), (0, 1))
    else:
        msg, seconds = _all_reduce_timed(lambda *args: store.set(key + "/posted", ""))
        store.set(key + "/done", "")
    torch.distributed.barrier()
    comm.reset_groups()
    return msg, seconds


def _all_reduce_timed(on_wait) -> tuple:
    """(the error message or None, seconds) of an all_reduce over [0, 1], calling
    `on_wait(work, ranks, ...)` as each posted collective starts to be waited for."""
    wait_for = collectives.wait_for
    collectives.wait_for = lambda *args: (on_wait(*args), wait_for(*args))[1]
    try:
        start = time.monotonic()
        msg = _caught(lambda: comm.all_reduce(torch.ones(3), (0, 1)))
        return msg, time.monotonic() - start
    finally:
        collectives.wait_for = wait_for


@pytest.mark.parametrize("how,named", [("failed", "has died of an exception"), ("exited", "has exited")])
def test_a_peer_that_left_is_seen_through_the_store_within_seconds(how, named):
    """Its watchdog wakes on the exit announced in the store and the waiting rank raises,
    naming the rank, within a slice of its wait (a quarter second) whether the rank failed
    or left cleanly: it left before it entered this collective; AUTOPAR_TIMEOUT is 60 s."""
    msg, seconds = run_dist(_peer_left_with_sockets_open, 2, how)[0]
    assert msg is not None and msg.startswith(
        "all_reduce #1 over ranks [0, 1] failed on rank 0: rank 1 left the program (its exit was announced in the "
        "store) before it entered this collective"), msg
    assert f"Ranks that did not arrive: rank 1 {named}." in msg, msg
    assert seconds < 2, seconds


def _entering_after_a_peer_left():
    """Rank 1 announces a clean exit having entered nothing on the group; rank 0, once its
    watchdog has seen it, enters all_reduce #1 over [0, 1]: it fails there, posting nothing."""
    os.environ["AUTOPAR_TIMEOUT"] = "60"
    comm.reset_groups()
    me = dist.get_rank()
    comm.group_for((0, 1))
    torch.distributed.barrier()
    msg = seconds = None
    if me == 1:
        faults.record_left(faults._store(), "exited")
    else:
        deadline = time.monotonic() + 30
        while exits._GONE.get(1, (None,))[0] != comm.backend._GENERATION[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        posted = []
        msg, seconds = _all_reduce_timed(lambda *args: posted.append(args))
        assert not posted, posted
    torch.distributed.barrier()
    comm.reset_groups()
    return msg, seconds


def test_a_collective_entered_after_a_peer_left_before_it_fails_at_once():
    """It fails where it is entered: nothing is posted, nothing waited for."""
    msg, seconds = run_dist(_entering_after_a_peer_left, 2)[0]
    assert msg is not None and msg.startswith(
        "all_reduce #1 over ranks [0, 1] failed on rank 0: rank 1 left the program (its exit was announced in the "
        "store) before it entered this collective"), msg
    assert "Ranks that did not arrive: rank 1 has exited." in msg, msg
    assert seconds < 2, seconds


def _peer_left_after_entering_it(delay):
    """Rank 1 announces a clean exit having entered all_reduce #1, then sends its part `delay`
    seconds late (a starved rank's collective still completing after its peer left): rank 0's
    wait for #1 must complete with the sum, not fail on the exit."""
    os.environ["AUTOPAR_TIMEOUT"] = "60"
    comm.reset_groups()
    me = dist.get_rank()
    comm.group_for((0, 1))
    torch.distributed.barrier()
    start = time.monotonic()
    if me == 1:
        exits.announce(faults._store(), 1, "exited", {"ranks [0, 1]": 1})
        time.sleep(delay)
    out = comm.all_reduce(torch.full((3,), float(me + 1)), (0, 1))
    seconds = time.monotonic() - start
    torch.distributed.barrier()
    comm.reset_groups()
    return out, seconds, dict(exits._GONE)


def test_a_peer_that_left_after_entering_a_collective_does_not_fail_it():
    """The verdict is a count, not a clock: the first version marked a cleanly leaving rank
    gone 3 s after its exit and failed any wait on it still going on then, so a correct job
    whose last collective completed late on a starved rank failed.  The delay here is longer
    than that grace."""
    out, seconds, gone = run_dist(_peer_left_after_entering_it, 2, 3.5)[0]
    assert torch.equal(out, torch.full((3,), 3.0)), out
    assert seconds >= 3.5, seconds
    assert 1 in gone and gone[1][1:] == ("exited", {"ranks [0, 1]": 1}), gone


class _LateWork:
    """A gloo work that completes `after` seconds from now (its timed waits raise until then)."""

    def __init__(self, after):
        self.done_at = time.monotonic() + after

    def is_completed(self):
        return time.monotonic() >= self.done_at

    def wait(self, timeout=None):
        if timeout is not None and not self.is_completed():
            time.sleep(min(timeout.total_seconds(), max(0.0, self.done_at - time.monotonic())))
            if not self.is_completed():
                raise RuntimeError("Operation timed out!")
        return True


@pytest.mark.parametrize("entered,fails", [(0, True), (1, False), (2, False)])
def test_a_sliced_wait_fails_only_on_a_rank_gone_before_entering_it(monkeypatch, entered, fails):
    """`exits.wait_for` for collective #1 over ranks [0, 1], rank 1 gone having entered
    `entered` collectives on the group: it raises within a slice when rank 1 never entered #1,
    and waits for the work however late it completes otherwise."""
    monkeypatch.setitem(exits._STATE, "sliced", True)
    monkeypatch.setattr(exits, "_GONE", {1: (comm.backend._GENERATION[0], "exited", {"ranks [0, 1]": entered})})
    start = time.monotonic()
    if fails:
        with pytest.raises(RuntimeError, match="rank 1 left the program .* before it entered this collective"):
            exits.wait_for(_LateWork(5.0), (0, 1), 1)
        assert time.monotonic() - start < 1.0
    else:
        exits.wait_for(_LateWork(0.8), (0, 1), 1)
        assert time.monotonic() - start >= 0.8


def _reads_between_training_collectives():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    torch.manual_seed(0)
    x = dist.shard_tensor(torch.randn(4, 6), mesh, [dist.Shard(0), dist.Shard(1)])
    y = dist.reshard(x * 2, mesh, [dist.Replicate(), dist.Shard(0)])
    total = (y.sum() + x.mean()).item()
    rows = y.tolist()
    text = repr(x)
    z = dist.reshard(y + 1, mesh, [dist.Shard(1), dist.Replicate()])
    return total, rows, text, float(z.max()), bool((z > 0).all()), dist.unshard_dtensor(z)


def test_value_reads_by_every_rank_are_right_between_training_collectives():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    y = x * 2
    for total, rows, text, top, positive, z in run_dist(_reads_between_training_collectives, 4):
        assert total == pytest.approx((y.sum() + x.mean()).item(), rel=1e-5)
        torch.testing.assert_close(torch.tensor(rows), y, rtol=1e-5, atol=0)
        assert text.startswith("DistTensor(tensor([[") and "placements=[Shard(0), Shard(1)]" in text
        assert top == pytest.approx((y + 1).max().item(), rel=1e-5)
        assert positive == bool((y + 1 > 0).all())
        torch.testing.assert_close(z, y + 1, rtol=1e-5, atol=0)


def _mismatched(kind):
    os.environ["AUTOPAR_DEBUG_COLLECTIVES"] = "1"
    me = dist.get_rank()
    if kind == "shape":
        return _caught(lambda: comm.all_reduce(torch.ones(4 - me), (0, 1)))
    if kind == "lone read":
        mesh = dist.ProcessMesh([0, 1])
        t = dist.shard_tensor(torch.arange(4.0), mesh, [dist.Shard(0)])
        return _caught(lambda: t.tolist() if me == 0 else dist.reshard(t, mesh, [dist.Replicate()]))
    mesh = dist.ProcessMesh([0, 1])
    t = dist.shard_tensor(torch.arange(6.0).reshape(2, 3), mesh, [dist.Shard(1)])
    return (t * 2).sum().item(), dist.reshard(t, mesh, [dist.Shard(0)]).tolist()


def test_debug_mode_names_a_shape_mismatch():
    msgs = run_dist(_mismatched, 2, "shape")
    for msg in msgs:
        assert msg == ("mismatched collective over ranks [0, 1] (AUTOPAR_DEBUG_COLLECTIVES=1): "
                       "rank 0: all_reduce of shape [4] torch.float32; rank 1: all_reduce of shape [3] torch.float32")


def test_debug_mode_names_a_lone_value_read():
    for msg in run_dist(_mismatched, 2, "lone read"):
        assert msg is not None and "(AUTOPAR_DEBUG_COLLECTIVES=1)" in msg, msg
        assert "rank 0: all_gather (a value read) of shape" in msg and "rank 1: all_gather of shape" in msg, msg


def test_debug_mode_leaves_a_correct_program_right():
    for total, rows in run_dist(_mismatched, 2, "none"):
        assert total == 30.0 and rows == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
