"""A correct job exits 0 every time, also under CPU load.

Gloo's threads used to abort the interpreter's teardown now and then ("terminate called
without an active exception", exit status 1 or SIGABRT) when ranks left at different times.
Starting 100 ranks through the launcher would spend minutes importing torch, so a parent that
imported torch and autopar once forks the ranks: each forked rank runs the job script and
leaves through the launcher's worker code (`autopar.launch._worker`), exactly as a launched
rank does.  Rank 0 hosts each job's store, on a port picked below the ephemeral range (see
`free_port` in the forking parent).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "launch_scripts" / "clean_exit.py"

FORKER = r'''
import json, os, random, socket, sys
import torch, autopar  # imported once: the ranks fork from here
import torch._dynamo, torch.distributed.tensor  # torch's meta kernels import these on first use
from autopar.launch import _worker

script, runs, concurrent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
EPHEMERAL = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])


def free_port():
    """A free port below the ephemeral range, which rank 0's store will listen on.  A port the
    OS picks (bind to port 0) comes from that range, and any socket opened meanwhile (a gloo
    listener or a store connection of a concurrent job) can take it before rank 0 binds it:
    the job then fails with EADDRINUSE."""
    while True:
        port = random.randrange(EPHEMERAL - 10000, EPHEMERAL)
        if abs(port - 29500) < 100:  # torchrun's and the launcher's default
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def start(port):
    """Fork the two ranks of one job; returns this rank's environment in a child, else the pids."""
    pids = []
    for rank in range(2):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        pids.append(pid)
    return pids


def run_all():
    """Every job's ranks' exit statuses (in the parent), or a rank's environment (in a child)."""
    statuses, running = [], []
    for job in range(runs):
        got = start(free_port())
        if isinstance(got, dict):
            return got
        running.append(got)
        while len(running) >= concurrent or (job == runs - 1 and running):
            statuses.append([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in running.pop(0)])
    print("STATUSES " + json.dumps(statuses))


rank_env = run_all()
if rank_env is not None:  # a forked rank: run the job, then leave the way a launched rank does
    os.environ.update(rank_env)
    with open(os.devnull, "w") as quiet:
        os.dup2(quiet.fileno(), 1)
    _worker.leave(_worker.run(script, [], module=False))
'''


def test_clean_job_exits_zero_fifty_times_under_load():
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    start = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", FORKER, str(SCRIPT), "50", "4"], cwd=REPO,
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=240)
    finally:
        for b in burners:
            b.kill()
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("STATUSES ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    statuses = json.loads(line[0][len("STATUSES "):])
    assert len(statuses) == 50
    bad = [(job, s) for job, s in enumerate(statuses) if s != [0, 0]]
    assert not bad, f"jobs with a rank exiting non-zero: {bad}\n{r.stderr[-3000:]}"
    print(f"50 jobs in {time.monotonic() - start:.1f} s")
