"""Checkpoints lose nothing: two jobs saving into one path at once, a path each node sees on its
own disk, a damaged checkpoint that must not pass for a missing one, and saves and loads through
a symlink.  The concurrent saves are real: a second job (a separate process) saves into the path
while the 2-rank gloo job is paused at a chosen point of its own save."""
import fcntl
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

import autopar as dist
from autopar.checkpoint import CheckpointError, CheckpointNotFoundError, load_state_dict, save_state_dict
from autopar.checkpoint import load as load_mod
from autopar.checkpoint import save as save_mod
from autopar.placement import Shard
from distpool import run_dist

TESTS = os.path.dirname(os.path.abspath(__file__))


def _sd(value, mesh=None):
    """A state dict whose every entry holds `value`; `w` is split by rows when a mesh is given."""
    w = torch.full((6, 4), float(value))
    return {"w": dist.shard_tensor(w, mesh, [Shard(0)]) if mesh is not None else w,
            "b": torch.full((3,), float(value)), "step": value}


def _value(path, mesh=None):
    """The value the checkpoint at `path` holds (every entry checked to agree)."""
    target = _sd(-1, mesh)
    load_state_dict(target, path)
    w = dist.unshard_dtensor(target["w"]) if mesh is not None else target["w"]
    assert (w == target["step"]).all() and (target["b"] == target["step"]).all()
    return target["step"]


def _mesh():
    return dist.ProcessMesh([0, 1], dim_names=["x"])


def _failure(fn, *args):
    """(message, is a FileNotFoundError) of the CheckpointError `fn` raises."""
    try:
        fn(*args)
    except CheckpointError as e:
        return str(e), isinstance(e, FileNotFoundError)
    raise AssertionError("expected a CheckpointError")


def _wait_for(filename, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(filename):
        assert time.monotonic() < deadline, f"timed out waiting for {filename}"
        time.sleep(0.02)


# -- a second job saving into the same path ----------------------------------------------------------
def _other_job(path, value, signals, no_exchange):
    """A one-process job: once told to go, save `value` into `path`, check it loads, report.
    Run in its own process by `_OtherJob`; it writes `at_swap` just before its swap."""
    def ready(name):
        open(os.path.join(signals, name), "w").close()

    if no_exchange:
        save_mod._exchange = lambda a, b: False
    save_mod._crash_point = lambda at: ready("at_swap") if at == "metadata_written" else None
    ready("ready")
    _wait_for(os.path.join(signals, "go"), timeout=300)
    save_state_dict(_sd(value), path)
    loaded = _value(path)
    with open(os.path.join(signals, "done"), "w") as f:
        f.write(str(loaded))


class _OtherJob:
    """The second job, started (torch imported) before the 2-rank job so that it saves promptly
    when the 2-rank job's rank 0 tells it to."""

    def __init__(self, tmp_path, path, value, no_exchange=False):
        self.signals = str(tmp_path / "signals")
        os.makedirs(self.signals)
        code = (f"import sys; sys.path[:0] = {[TESTS, os.path.dirname(TESTS)]!r}\n"
                f"import test_checkpoint_safety as t\n"
                f"t._other_job({path!r}, {value!r}, {self.signals!r}, {no_exchange!r})\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        self.log = open(tmp_path / "other_job.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(env, OMP_NUM_THREADS="1"))
        _wait_for(os.path.join(self.signals, "ready"), timeout=300)

    def finish(self) -> int:
        """Wait for it; the value it loaded right after its own save."""
        try:
            self.proc.wait(timeout=300)
        finally:
            self.proc.kill()  # a no-op once it ended; a failed test must not leave it waiting
            self.log.close()
        output = open(self.log.name).read()
        assert self.proc.returncode == 0, output[-3000:]
        return int(open(os.path.join(self.signals, "done")).read())


def _paused_save(path, signals, stage):
    """Save 1, then save 2 with rank 0 letting the other job save in the middle, at `stage`:
    "before_rank0_writes" (rank 1's piece is on disk, rank 0's not yet), "files_written" (both
    pieces on disk, metadata not yet) or "old_moved_away" (no exchange: rank 0 moved the old
    checkpoint aside and holds the swap; the other job reaches its own swap meanwhile)."""
    mesh = _mesh()
    save_state_dict(_sd(1, mesh), path)
    go, done, at_swap = (os.path.join(signals, n) for n in ("go", "done", "at_swap"))
    rank = dist.get_rank()
    original_write, original_point, original_exchange = (
        save_mod._write_rank_file, save_mod._crash_point, save_mod._exchange)

    def let_other_job_save():
        open(go, "w").close()
        _wait_for(done)

    def write_after_rank1_wrote(tensors, filename):
        parent, base = os.path.split(path)
        _wait_for_glob(os.path.join(parent, f".{base}.tmp-*", "rank00001.safetensors"))
        let_other_job_save()
        original_write(tensors, filename)

    def point(at):
        if at == stage == "files_written":
            let_other_job_save()
        elif at == stage == "old_moved_away":
            open(go, "w").close()
            _wait_for(at_swap)
            time.sleep(0.5)  # the other job is now at its swap, waiting for this one's

    if rank == 0:
        if stage == "before_rank0_writes":
            save_mod._write_rank_file = write_after_rank1_wrote
        save_mod._crash_point = point
        if stage == "old_moved_away":
            save_mod._exchange = lambda a, b: False
    try:
        save_state_dict(_sd(2, mesh), path)
    finally:
        save_mod._write_rank_file, save_mod._crash_point, save_mod._exchange = (
            original_write, original_point, original_exchange)
    return "saved"


def _wait_for_glob(pattern, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not glob.glob(pattern):
        assert time.monotonic() < deadline, f"timed out waiting for {pattern}"
        time.sleep(0.02)


def _load_2(path):
    return _value(path, _mesh())


@pytest.mark.parametrize("stage,later", [
    ("before_rank0_writes", 2),  # was: the other job removed the temp dir, rank 0 recreated it: rank 1's file lost
    ("files_written", 2),        # was: the other job removed the temp dir: "No such file" naming its own temp dir
    ("old_moved_away", 9),       # without exchange: the other job's swap waits for this one's, then wins
])
def test_two_jobs_saving_into_one_path_both_complete_later_swap_wins(tmp_path, stage, later):
    path = str(tmp_path / "ckpt")
    other = _OtherJob(tmp_path, path, 9, no_exchange=stage == "old_moved_away")
    try:
        assert run_dist(_paused_save, 2, path, other.signals, stage) == ["saved"] * 2
    finally:
        open(os.path.join(other.signals, "go"), "w").close()
        loaded = other.finish()
    assert loaded == 9  # the other job's checkpoint was complete when it was in place
    assert run_dist(_load_2, 2, path) == [later] * 2
    files = sorted(os.listdir(path))
    if later == 2:
        assert files == ["metadata.json", "rank00000.safetensors", "rank00001.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "other_job.log", "signals"]  # no temporary names left


# -- a live save's leftovers are kept, a dead one's removed ---------------------------------------------
def _lock_file(parent, base, token, host):
    lock = os.path.join(parent, f".{base}.lock-{token}")
    with open(lock, "w") as f:
        json.dump({"token": token, "host": host, "pid": 1, "started": time.time()}, f)
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    os.mkdir(tmp)
    open(os.path.join(tmp, "rank00003.safetensors"), "wb").close()
    return lock, tmp


def test_leftovers_removed_only_when_their_save_is_provably_over(tmp_path):
    path = str(tmp_path / "ckpt")
    save_state_dict(_sd(1), path)
    live = _lock_file(str(tmp_path), "ckpt", "aaaaaaaaaaaa", socket.gethostname())
    held = open(live[0], "r+")
    fcntl.flock(held, fcntl.LOCK_EX)  # a save in flight on this host holds its lock
    dead = _lock_file(str(tmp_path), "ckpt", "bbbbbbbbbbbb", socket.gethostname())  # crashed here
    foreign = _lock_file(str(tmp_path), "ckpt", "cccccccccccc", "another-node")  # its lock proves nothing
    legacy = os.path.join(str(tmp_path), ".ckpt.tmp-dddddddddddd")  # no lock file at all
    os.mkdir(legacy)
    save_state_dict(_sd(2), path)
    assert _value(path) == 2
    assert all(os.path.exists(p) for p in live + foreign + (legacy,))
    assert not any(os.path.exists(p) for p in dead)
    held.close()  # the live save ended without cleaning up; the others grew old
    old = time.time() - 2 * save_mod.claim.STALE_S
    for p in foreign + (legacy,):
        os.utime(p, (old, old))
    save_state_dict(_sd(3), path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and _value(path) == 3


# -- files that vanish under a save ------------------------------------------------------------------------
def _lose_a_file(path, how):
    """Save 1, then save 2 while rank 1's data file is lost or cut short before the swap."""
    mesh = _mesh()
    save_state_dict(_sd(1, mesh), path)
    parent, base = os.path.split(path)
    gone = os.path.join(os.path.dirname(parent), "removed")
    original = save_mod._crash_point

    def point(at):
        if at != "files_written" or dist.get_rank() != 1:
            return
        tmp, = glob.glob(os.path.join(parent, f".{base}.tmp-*"))
        if how == "temp_dir_removed":  # at once, whatever rank 0 is doing
            os.rename(tmp, gone)
        elif how == "file_removed":
            os.remove(os.path.join(tmp, "rank00001.safetensors"))
        else:
            with open(os.path.join(tmp, "rank00001.safetensors"), "r+b") as f:
                f.truncate(10)

    save_mod._crash_point = point
    try:
        failure = _failure(save_state_dict, _sd(2, mesh), path)
    finally:
        save_mod._crash_point = original
    if dist.get_rank() == 1:
        shutil.rmtree(gone, ignore_errors=True)
    return failure, _value(path, mesh), sorted(os.listdir(parent))  # the load: a barrier


@pytest.mark.parametrize("how,needles", [
    ("file_removed", ["rank00001.safetensors", "missing"]),
    ("truncated", ["rank00001.safetensors", "10 bytes"]),
    ("temp_dir_removed", ["removed by another process"]),
])
def test_a_file_lost_before_the_swap_fails_every_rank_old_checkpoint_kept(tmp_path, how, needles):
    (tmp_path / "job").mkdir()
    results = run_dist(_lose_a_file, 2, str(tmp_path / "job" / "ckpt"), how)
    assert len({msg for (msg, _), _, _ in results}) == 1  # the same error everywhere
    for (msg, not_found), value, listing in results:
        assert not not_found and "unchanged" in msg, msg
        assert all(n in msg for n in needles), msg
        assert "No such file" not in msg, msg
        assert value == 1 and listing == ["ckpt"]


# -- a path each node sees on its own disk ------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True])  # (asynchronous: the thread checks, wait() raises)
def test_path_not_shared_between_nodes_fails_every_rank_before_writing(tmp_path, async_save):
    results = run_dist(_unshared_save, 2, str(tmp_path), async_save)
    messages = {msg for (msg, _), _ in results}
    assert len(messages) == 1, messages
    for (msg, not_found), written in results:
        assert not not_found
        assert "[rank 1]" in msg and "shared by all ranks" in msg and "nothing was written" in msg, msg
        assert written == []  # nothing written on either node, no temporary name left
    assert sorted(os.listdir(tmp_path)) == ["node0", "node1"]


def _unshared_save(root, async_save):
    rank = dist.get_rank()
    own = os.path.join(root, f"node{rank}")
    os.makedirs(own, exist_ok=True)
    os.chdir(own)
    writes = []
    original = save_mod._write_rank_file
    save_mod._write_rank_file = lambda *a: (writes.append(a[1]), original(*a))
    try:
        failure = _failure(lambda: save_state_dict(_sd(1, _mesh()), "ckpt", async_save=async_save).wait()
                           if async_save else save_state_dict(_sd(1, _mesh()), "ckpt"))
    finally:
        save_mod._write_rank_file = original
    assert writes == []  # no rank began writing its pieces
    return failure, sorted(os.listdir(own))


def _unshared_load(root):
    os.chdir(os.path.join(root, f"node{dist.get_rank()}"))
    return _failure(_value, "ckpt", _mesh())


def test_checkpoint_only_some_nodes_see_is_an_error_not_a_missing_checkpoint(tmp_path):
    for rank in (0, 1):
        os.makedirs(tmp_path / f"node{rank}")
    save_state_dict(_sd(4), str(tmp_path / "node0" / "ckpt"))  # on rank 0's disk only
    results = run_dist(_unshared_load, 2, str(tmp_path))
    assert len({msg for msg, _ in results}) == 1
    for msg, not_found in results:
        assert not not_found, msg  # `except FileNotFoundError: start fresh` must not fire
        assert "[rank 1]" in msg and "rank 0 found it" in msg and "shared by all ranks" in msg, msg


# -- damaged is not missing -----------------------------------------------------------------------------------
def _save_2(path):
    save_state_dict(_sd(1, _mesh()), path)


def _load_failure_2(path):
    return _failure(_value, path, _mesh())


@pytest.mark.parametrize("how,needle", [
    ("file_removed", "missing"),
    ("truncated", "truncated"),
    ("metadata_removed", "no metadata.json"),  # its data files are there: a damaged checkpoint
])
def test_damaged_checkpoint_is_a_checkpoint_error_not_file_not_found(tmp_path, how, needle):
    path = str(tmp_path / "ckpt")
    run_dist(_save_2, 2, path)
    data = os.path.join(path, "rank00001.safetensors")
    if how == "file_removed":
        os.remove(data)
    elif how == "truncated":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    else:
        os.remove(os.path.join(path, "metadata.json"))
    for msg, not_found in run_dist(_load_failure_2, 2, path):
        assert not not_found and needle in msg, msg
    msg, not_found = _failure(_value, path)  # one process, no group
    assert not not_found and needle in msg, msg


def test_unreadable_metadata_is_a_checkpoint_error(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    save_state_dict(_sd(1), path)

    def unreadable(directory):
        raise PermissionError(13, "Permission denied", os.path.join(directory, "metadata.json"))

    monkeypatch.setattr(load_mod, "read_metadata", unreadable)
    msg, not_found = _failure(_value, path)
    assert not not_found and "Permission denied" in msg, msg


def test_only_no_directory_or_no_metadata_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        _value(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no metadata.json"):
        _value(str(tmp_path / "empty"))


# -- symlinks --------------------------------------------------------------------------------------------------
def _through_link(root):
    mesh = _mesh()
    save_state_dict(_sd(10, mesh), os.path.join(root, "step_10"))
    if dist.get_rank() == 0:
        os.symlink("step_10", os.path.join(root, "latest"))
    latest = os.path.join(root, "latest")
    _wait_for(latest)
    before = _value(latest, mesh)
    save_state_dict(_sd(11, mesh), latest)  # replaces the directory the link points to
    return before, _value(latest, mesh), _value(os.path.join(root, "step_10"), mesh)


def test_save_and_load_through_a_symlink_replace_the_directory_it_points_to(tmp_path):
    assert run_dist(_through_link, 2, str(tmp_path)) == [(10, 11, 11)] * 2
    assert os.readlink(tmp_path / "latest") == "step_10"  # the link is kept
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_10"]
    assert sorted(os.listdir(tmp_path / "step_10")) == [
        "metadata.json", "rank00000.safetensors", "rank00001.safetensors"]


def test_symlink_on_another_directory_level_and_dangling_and_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "ckpts").symlink_to("real")  # a symlinked parent: the temporary dir goes next to the target
    save_state_dict(_sd(1), str(tmp_path / "ckpts" / "a"))
    assert sorted(os.listdir(tmp_path / "real")) == ["a"] and _value(str(tmp_path / "ckpts" / "a")) == 1
    (tmp_path / "next").symlink_to("real/b")  # dangling: the save creates what it points to
    save_state_dict(_sd(2), str(tmp_path / "next"))
    assert (tmp_path / "next").is_symlink() and _value(str(tmp_path / "real" / "b")) == 2
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    (tmp_path / "to_data").symlink_to("data")
    with pytest.raises(CheckpointError, match=r"refusing to replace .*data.*to_data links to it"):
        save_state_dict(_sd(3), str(tmp_path / "to_data"))
    assert os.listdir(tmp_path / "data") == ["precious.txt"]
