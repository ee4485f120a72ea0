"""``--max_restarts``: a job whose rank dies restarts every rank and resumes from its checkpoint.

Every launch is a real subprocess with a timeout. The training script
(launch_scripts/train_resume.py) saves model, optimizer, random number generator and step
counter after every step and resumes from them; a resumed job's losses are compared with an
uninterrupted run's.
"""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from test_launch import LAUNCHER, REPO, SCRIPTS, listening_sockets, free_port, launch, launcher_env

TRAIN = str(SCRIPTS / "train_resume.py")
STEPS = 6


def losses(path) -> list[tuple[int, int, int, str]]:
    """``(attempt, step, world size, repr of the loss)`` per line rank 0 logged."""
    rows = []
    for line in path.read_text().splitlines():
        attempt, step, world, loss = line.split()
        rows.append((int(attempt), int(step), int(world), loss))
    return rows


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    """``{step: loss}`` of a 2-rank run that nothing interrupts."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    r = launch("--nproc_per_node", "2", TRAIN, str(tmp / "ckpt"), str(tmp / "losses"), str(STEPS), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = losses(tmp / "losses")
    assert [(a, s, w) for a, s, w, _ in rows] == [(0, s, 2) for s in range(STEPS)]
    return {step: loss for _, step, _, loss in rows}


def test_a_killed_rank_restarts_and_resumes_with_identical_losses(tmp_path, uninterrupted):
    """Rank 1 is SIGKILLed at step 3 of the first attempt: with --max_restarts 1 every rank
    restarts, resumes at step 3 from the checkpoint, and the losses are bit for bit those of
    the uninterrupted run (dropout draws included: the generator state is restored)."""
    r = launch("--nproc_per_node", "2", "--max_restarts", "1", TRAIN, str(tmp_path / "ckpt"),
               str(tmp_path / "losses"), str(STEPS), "3", "1", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "autopar.launch: restarting every rank (restart 1)" in r.stderr
    rows = losses(tmp_path / "losses")
    assert [(a, s) for a, s, _, _ in rows] == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)], rows
    assert {step: loss for _, step, _, loss in rows} == uninterrupted


def test_without_restarts_the_killed_rank_ends_the_job(tmp_path):
    r = launch("--nproc_per_node", "2", TRAIN, str(tmp_path / "ckpt"), str(tmp_path / "losses"),
               str(STEPS), "1", "1", timeout=300)
    assert r.returncode == 1
    assert "restarting" not in r.stderr
    assert "rank 1 exited with signal SIGKILL; the other ranks were stopped" in r.stderr, r.stderr[-3000:]
    assert [s for _, s, _, _ in losses(tmp_path / "losses")] == [0]


def test_a_plain_torch_job_restarts_on_a_fresh_store():
    """torch's agent shared one workers' store between attempts: the restarted process group
    read the dead attempt's addresses (connectFullMesh failed, or hung for minutes)."""
    start = time.monotonic()
    r = launch("--nproc_per_node", "2", "--max_restarts", "1", str(SCRIPTS / "plain_restart.py"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(line for line in r.stdout.splitlines() if "sum=" in line) == [
        "[rank0]: attempt 1 sum=4.0", "[rank1]: attempt 1 sum=4.0"], r.stdout
    assert time.monotonic() - start < 60


def test_a_lost_node_resumes_on_a_smaller_world(tmp_path, uninterrupted):
    """Two nodes (launchers) of one rank each, elastic --nnodes 1:2: at step 3 one node is
    lost for good (its launcher and its rank SIGKILLed). The other node restarts, the
    rendezvous completes with it alone once the lost node's heartbeats expire, and its one
    rank resumes the 2-rank checkpoint (resharded on load) and finishes: the same losses
    (rtol 1e-5: one rank sums the batch in another order than two). The node lost is the one
    that does not host the rendezvous store, which must outlive it."""
    port = free_port()
    argv = ["--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "shrink", "--max_restarts", "1",
            "--rdzv_conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2",
            "--join_timeout", "120", TRAIN, str(tmp_path / "ckpt"), str(tmp_path / "losses"), str(STEPS), "3", "node"]
    lose = tmp_path / "lose_launcher"
    env = launcher_env(AUTOPAR_RDZV_TOKEN="shrink-secret", TRAIN_LOSE_LAUNCHER=str(lose))
    nodes = [subprocess.Popen([*LAUNCHER, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        host = _store_host(nodes, port, 60)
        kept, lost = nodes[host], nodes[1 - host]
        lose.write_text(str(lost.pid))
        out, err = kept.communicate(timeout=300)
        _, lost_err = lost.communicate(timeout=30)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert lost.returncode == -signal.SIGKILL, (err[-3000:], lost_err[-3000:])
    assert kept.returncode == 0, err[-3000:]
    rows = losses(tmp_path / "losses")
    assert [(a, s, w) for a, s, w, _ in rows] == [(0, 0, 2), (0, 1, 2), (0, 2, 2), (1, 3, 1), (1, 4, 1), (1, 5, 1)], rows
    for _, step, _, loss in rows:
        assert float(loss) == pytest.approx(float(uninterrupted[step]), rel=1e-5), step


def _store_host(nodes, port: int, timeout: float) -> int:
    """Which of the launchers `nodes` listens on `port` (hosts the rendezvous store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, node in enumerate(nodes):
            assert node.poll() is None, node.communicate()
            if any(p == port for _, p in listening_sockets(node.pid)):
                return i
        time.sleep(0.1)
    raise AssertionError(f"no launcher listens on port {port} after {timeout} s")
