"""End-to-end tests of ``python -m autopar.launch`` on CPU with gloo.

Every launch is a real subprocess with a timeout, so a launcher bug fails the
test instead of hanging the suite.
"""
from __future__ import annotations

import base64
import datetime
import io
import ipaddress
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.launch import main
from autopar.launch._exits import ExitTimes
from autopar.launch._output import RankOutput

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"


LAUNCHER = [sys.executable, "-m", "autopar.launch"]


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's env with PYTHONPATH=repo and none of the variables the launcher defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "AUTOPAR_DEVICES")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def launch(*argv: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 60):
    """Run the launcher CLI to completion."""
    return subprocess.run([*LAUNCHER, *argv], cwd=cwd, env=launcher_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def rank_lines(stdout: str, marker: str) -> dict[int, str]:
    """``{rank: rest of line}`` for launcher output lines ``[rank<r>]: <marker>...``."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("[rank") and "]: " in line:
            tag, rest = line.split("]: ", 1)
            if rest.startswith(marker):
                found[int(tag[len("[rank"):])] = rest[len(marker):]
    return found


def env_of_ranks(stdout: str) -> dict[int, dict]:
    return {rank: json.loads(rest) for rank, rest in rank_lines(stdout, "ENV ").items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_all_reduce():
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "allreduce.py"))
    assert r.returncode == 0, r.stderr
    lines = rank_lines(r.stdout, "allreduce ")
    assert lines == {0: "rank=0 world=2 sum=1", 1: "rank=1 world=2 sum=1"}, r.stdout


@pytest.mark.parametrize("rank0_blocks_in", ["sleep", "barrier"])
def test_failing_rank_stops_the_job(tmp_path, rank0_blocks_in):
    pid_file = tmp_path / "rank0.pid"
    start = time.monotonic()
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "fail_rank1.py"), str(pid_file), rank0_blocks_in)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    assert elapsed < 20, f"launcher took {elapsed:.1f}s to give up"
    rank1_err = "\n".join(line for line in r.stderr.splitlines() if line.startswith("[rank1]: "))
    assert "Traceback (most recent call last)" in rank1_err, r.stderr
    assert "RuntimeError: boom from rank 1" in rank1_err, r.stderr
    assert "outlived" not in r.stdout
    # rank 0 was killed, not left running behind the launcher
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_devices_start_one_rank_per_device():
    r = launch("--devices", "0,1", str(SCRIPTS / "env_dump.py"), "--lr", "0.1")
    assert r.returncode == 0, r.stderr
    envs = env_of_ranks(r.stdout)
    assert sorted(envs) == [0, 1], r.stdout
    for rank, env in envs.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["AUTOPAR_DEVICES"] == "0,1"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["argv"] == ["--lr", "0.1"]
    assert int(envs[0]["MASTER_PORT"]) > 0


def test_module_mode_fixed_port_and_user_omp_threads():
    port = free_port()
    r = launch("--nproc_per_node", "2", "--master_port", str(port), "-m", "env_dump", "x",
               cwd=SCRIPTS, env={"OMP_NUM_THREADS": "3", "AUTOPAR_RDZV_TOKEN": "launcher only"})
    assert r.returncode == 0, r.stderr
    envs = env_of_ranks(r.stdout)
    assert sorted(envs) == [0, 1], r.stdout
    for env in envs.values():
        assert env["MASTER_PORT"] == str(port)
        assert env["OMP_NUM_THREADS"] == "3"
        assert env["AUTOPAR_RDZV_TOKEN"] is None
        assert env["AUTOPAR_DEVICES"] is None
        assert env["argv"] == ["x"]


def test_log_dir_keeps_per_rank_logs(tmp_path):
    r = launch("--nproc_per_node", "2", "--log_dir", str(tmp_path), str(SCRIPTS / "env_dump.py"))
    assert r.returncode == 0, r.stderr
    logs = sorted(tmp_path.glob("*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]
    assert all(p.read_text().startswith("ENV ") for p in logs)


def test_two_nodes_c10d_rendezvous():
    endpoint = f"127.0.0.1:{free_port()}"
    argv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", endpoint, "--rdzv_id", "test-two-nodes", str(SCRIPTS / "allreduce.py")]
    nodes = [subprocess.Popen([*LAUNCHER, *argv], cwd=REPO, env=launcher_env(AUTOPAR_RDZV_TOKEN="two-nodes-secret"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [node.communicate(timeout=60) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    lines = {}
    for out, _ in outs:
        lines.update(rank_lines(out, "allreduce "))
    assert lines == {0: "rank=0 world=2 sum=1", 1: "rank=1 world=2 sum=1"}


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: script"),
    (["--nproc_per_node", "0", "SCRIPT"], "--nproc_per_node must be >= 1"),
    (["--devices", "0,1", "--nproc_per_node", "3", "SCRIPT"], "disagrees with --devices"),
    (["--devices", "0,gpu1", "SCRIPT"], "expected comma-separated device indices"),
    (["--nnodes", "2:1", "SCRIPT"], "need 0 < MIN <= MAX"),
    (["--nnodes", "1:2", "SCRIPT"], "needs a dynamic backend"),
    (["--rdzv_backend", "c10d", "SCRIPT"], "needs --rdzv_endpoint"),
    (["--rdzv_backend", "etcd-v2", "--rdzv_endpoint", "h:1", "SCRIPT"], "etcd-v2 unpickles"),
    (["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1", "SCRIPT"], "set AUTOPAR_RDZV_TOKEN"),
    (["--join_timeout", "0", "SCRIPT"], "expected a positive number of seconds, got '0'"),
    (["--rdzv_conf", "join_timeout=5", "SCRIPT"], "unknown key 'join_timeout'"),
    (["--nproc_per_node", "2", "no_such_script.py"], "training script not found: no_such_script.py"),
    (["--log-ranks", "0,one", "SCRIPT"], "expected comma-separated ranks, got '0,one'"),
    (["--local-ranks-filter", "-1", "SCRIPT"], "ranks must be >= 0, got '-1'"),
])
def test_usage_errors(capsys, monkeypatch, argv, message):
    monkeypatch.delenv("AUTOPAR_RDZV_TOKEN", raising=False)
    argv = [str(SCRIPTS / "allreduce.py") if a == "SCRIPT" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m autopar.launch") and message in err, err


def test_usage_error_from_the_command_line():
    r = launch("--nproc_per_node", "0", str(SCRIPTS / "allreduce.py"), timeout=30)
    assert r.returncode == 2
    assert "usage: python -m autopar.launch" in r.stderr
    assert "--nproc_per_node must be >= 1" in r.stderr


def test_autopar_job_with_a_failing_rank_ends_fast_with_its_error():
    """A rank that raises while its peer waits in an autopar collective: the job ends in
    seconds, non-zero, with the failing rank's error (no rank hangs in exit barriers)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "autopar.launch", "--nproc_per_node", "2",
         os.path.join(root, "tests", "launch_scripts", "autopar_fail_rank1.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "boom from rank 1" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("code", [3, 0])
def test_rank_that_exits_ends_the_job_within_seconds(code):
    """A rank leaving (sys.exit(3), or exit(0) while its peer goes on into a collective) ends
    the job in seconds, not after AUTOPAR_TIMEOUT, non-zero, naming the rank that left."""
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "rank1_exits.py"), str(code), timeout=120)
    ended = time.time()
    assert r.returncode != 0, r.stdout + r.stderr
    left = float(rank_lines(r.stdout, "leaving at ")[1])
    assert ended - left < 12, f"the job ended {ended - left:.1f}s after rank 1 left"
    assert "rank 0 outlived rank 1" not in r.stdout
    if code:
        assert "rank 1 exited with code 3; the other ranks were stopped" in r.stderr, r.stderr
    else:
        assert re.search(r"all_gather #\d+ over ranks \[0, 1\] \(value reads\) failed on rank 0", r.stderr), r.stderr
        assert "Ranks that did not arrive: rank 1 has exited." in r.stderr, r.stderr


def test_worker_keeps_python_script_semantics(tmp_path):
    """Ranks run the script as __main__ with its own directory on sys.path and its argv; its
    non-daemon threads finish, then its atexit handlers run; its exit status (a sys.exit
    message gives 1) is the rank's."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "main.py").write_text(
        "import atexit, sys, threading, time, helper_mod\n"
        "print('SEM', __name__, helper_mod.VALUE, sys.argv[1:])\n"
        "atexit.register(lambda: print('SEM atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('SEM thread'))).start()\n"
        "sys.exit('bad argument' if sys.argv[1] == 'fail' else 0)\n")
    ok = launch("--nproc_per_node", "1", str(tmp_path / "main.py"), "fine")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == ["[rank0]: SEM __main__ 7 ['fine']", "[rank0]: SEM thread", "[rank0]: SEM atexit"]
    bad = launch("--nproc_per_node", "1", str(tmp_path / "main.py"), "fail")
    assert bad.returncode == 1 and "[rank0]: bad argument" in bad.stderr, bad.stderr


def test_a_progress_bar_is_one_line_tagged_once_in_a_log():
    """tqdm redraws its bar after carriage returns: a log (a pipe here) shows each rank's
    bar once, in its last state, tagged once; ordinary lines are tagged once too."""
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "progress.py"))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank0]: end rank 0", "[rank0]: start rank 0",
                                             "[rank1]: end rank 1", "[rank1]: start rank 1"], r.stdout
    bars = [line for line in r.stderr.splitlines() if line.startswith("[rank")]
    assert sorted(bars) == ["[rank0]: train 5/5", "[rank1]: train 5/5"], r.stderr
    assert "\r" not in r.stderr


def test_a_traceback_is_tagged_once():
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "autopar_fail_rank1.py"), timeout=120)
    assert r.returncode != 0
    assert "[rank1]: RuntimeError: boom from rank 1" in r.stderr.splitlines(), r.stderr
    assert "[rank1]: [rank1]:" not in r.stderr


@pytest.mark.parametrize("option, rank", [("--log-ranks", 0), ("--local-ranks-filter", 1)])
def test_chosen_ranks_only(option, rank):
    r = launch("--nproc_per_node", "2", option, str(rank), str(SCRIPTS / "progress.py"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"[rank{rank}]: start rank {rank}", f"[rank{rank}]: end rank {rank}"]
    assert [line for line in r.stderr.splitlines() if line.startswith("[rank")] == [f"[rank{rank}]: train 5/5"]


def test_a_hidden_rank_that_fails_is_quoted_in_the_summary(tmp_path):
    r = launch("--nproc_per_node", "2", "--log-ranks", "0", str(SCRIPTS / "fail_rank1.py"),
               str(tmp_path / "pid"), "sleep")
    assert r.returncode == 1
    assert r.stderr.count("its output was not shown; the end of its stderr:") == 1, r.stderr
    shown, summary = r.stderr.split("its output was not shown; the end of its stderr:")
    assert "rank 1 exited with code 1; the other ranks were stopped (" in shown[-200:]
    assert "[rank1]" not in r.stdout + shown
    assert "RuntimeError: boom from rank 1" in summary


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_carriage_return_redraws_the_line(tmp_path):
    out, err = _Terminal(), _Terminal()
    output = RankOutput()
    (tmp_path / "o").write_text("")
    (tmp_path / "e").write_text("")
    output.follow(0, str(tmp_path / "o"), str(tmp_path / "e"), True, out, err)
    output.follow(1, str(tmp_path / "o1"), str(tmp_path / "e1"), False, out, err)  # hidden: never read
    with open(tmp_path / "e", "a") as bar, open(tmp_path / "o", "a") as text:
        for chunk in ["\rstep 1", "\rstep 2"]:
            bar.write(chunk)
            bar.flush()
            output.poll()
        text.write("a line\n")
        text.flush()
        output.poll()
        bar.write("\rstep 3\n")
        bar.flush()
        output.close()
    # another stream's line leaves the bar on screen and goes on below it
    assert err.getvalue() == "\r[rank0]: step 1\x1b[K\r[rank0]: step 2\x1b[K\n[rank0]: step 3\n"
    assert out.getvalue() == "[rank0]: a line\n"


def test_main_job_prints_a_clean_summary_and_plots_the_loss(tmp_path):
    png = tmp_path / "loss.png"
    r = launch("--nproc_per_node", "4", "--log-ranks", "0", "examples/train_gpt.py", "--steps", "4", "--check",
               "--plot", str(png), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert all(line.startswith("[rank0]: ") and not line.startswith("[rank0]: [rank0]") for line in lines), r.stdout
    summary = lines[lines.index("[rank0]: summary"):]
    assert [line.split()[1] for line in summary[1:]] == ["mesh", "model", "steps", "loss", "speed", "peak", "check",
                                                          "plot"], summary
    assert "dp 2 x mp 2 (4 ranks)" in summary[1] and summary[-1].endswith(str(png))
    assert re.search(r"speed +[\d,]+ tokens/s, MFU \d+\.\d+% of a cpu fp32 peak, \d+% of rank 0's step blocked", summary[5])
    assert re.fullmatch(r".*peak memory +rank 0 [\d,]+ MiB, rank 1 [\d,]+ MiB, rank 2 [\d,]+ MiB, rank 3 [\d,]+ MiB",
                        summary[6]), summary[6]
    bars = [line for line in r.stderr.splitlines() if line.startswith("[rank0]: train:")]
    assert len(bars) == 1 and "4/4" in bars[0] and "tok/s" in bars[0] and "MFU" in bars[0], r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_correct_job_whose_ranks_leave_seconds_apart_exits_zero():
    """Rank 1 leaves while rank 0 still works (past the exit handler's 3 s wait for peers):
    rank 0's groups lose their peer while idle, and the job still exits 0."""
    r = launch("--nproc_per_node", "2", str(SCRIPTS / "clean_exit.py"), "5", timeout=120)
    assert r.returncode == 0, r.stderr
    assert rank_lines(r.stdout, "sum ") == {0: "12.0", 1: "12.0"}


# -- network exposure ------------------------------------------------------------------------
def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process `pid` listens on, read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                    found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _other_addresses() -> set[str]:
    """This machine's addresses that are not loopback (its hostname's, and its routes' out)."""
    found = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    for family, probe in ((socket.AF_INET, "192.0.2.123"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found.add(s.getsockname()[0])
        except OSError:  # no route of that family
            pass
    return {a for a in found if not ipaddress.ip_address(a.split("%")[0]).is_loopback}


def _wait_for(paths, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written within {timeout} s: {[str(p) for p in paths]}"
        for proc in procs:
            assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)


class _Evil:
    """Unpickling this touches a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _attack(port: int, pick, marker: Path) -> list[str]:
    """Connect to the store on `port` as any local process can, and write a pickle that runs
    code into every key `pick` chooses (as elastic's c10d backend stores state, and raw)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    payload = pickle.dumps(_Evil(marker))
    keys = [k for k in store.list_keys() if pick(k)]
    for i, key in enumerate(keys):
        store.set(key, base64.b64encode(payload) if i % 2 == 0 else payload)
    return keys


def test_a_single_node_job_listens_on_loopback_only(tmp_path):
    """The launcher's stores listen on 127.0.0.1 only: no other address of this machine
    connects, and what a local process writes into the rendezvous keys is never loaded."""
    marker = tmp_path / "code_ran"
    proc = subprocess.Popen([*LAUNCHER, "--nproc_per_node", "2", str(SCRIPTS / "wait_for_go.py"), str(tmp_path)],
                            cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([tmp_path / "ready0", tmp_path / "ready1"], 60, [proc])
        listening = listening_sockets(proc.pid)
        assert listening and all(address == "127.0.0.1" for address, _ in listening), listening
        for address in _other_addresses():
            for _, port in listening:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((address, port), timeout=5).close()
        assert _attack(listening[0][1], lambda key: "rendezvous" in key, marker)
        time.sleep(1)
    finally:
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(rank_lines(out, "sum=").values()) == ["1", "1"]
    assert not marker.exists()


def test_an_unsigned_rendezvous_state_is_refused_and_the_job_goes_on(tmp_path):
    """A two-node c10d job: while it runs, a client of its rendezvous store overwrites the
    rendezvous state with a pickle that would run code. The launchers never unpickle it
    (its HMAC does not verify), say so, and the job finishes."""
    marker = tmp_path / "code_ran"
    port = free_port()
    argv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
            f"127.0.0.1:{port}", "--rdzv_id", "attacked", str(SCRIPTS / "wait_for_go.py"), str(tmp_path)]
    nodes = [subprocess.Popen([*LAUNCHER, *argv], cwd=REPO, env=launcher_env(AUTOPAR_RDZV_TOKEN="s3cret"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        _wait_for([tmp_path / "ready0", tmp_path / "ready1"], 90, nodes)
        assert _attack(port, lambda key: key == "torch.rendezvous.attacked", marker)
        time.sleep(3)  # the agents read the state every second while the job runs
        (tmp_path / "go").touch()
        outs = [node.communicate(timeout=60) for node in nodes]
    finally:
        (tmp_path / "go").touch()
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert not marker.exists()
    assert any("refused a rendezvous state in the store at 127.0.0.1:" in err for _, err in outs), outs
    assert sorted(line for out, _ in outs for line in out.splitlines()) == ["[rank0]: sum=1", "[rank1]: sum=1"]


# -- nodes that never join -------------------------------------------------------------------
@pytest.mark.parametrize("backend, node_rank, message", [
    ("static", 0, "expected 2 nodes (--nnodes 2); node(s) 1 did not join within 3 s (--join_timeout); joined: node(s) 0"),
    ("static", 1, "node 0's store at 127.0.0.1:{port} did not answer within 3 s (--join_timeout)"),
    ("c10d", 0, "did not complete within 3 s (--join_timeout): expected 2 nodes, 1 joined: "),
])
def test_a_node_that_never_joins_is_named_within_the_join_timeout(backend, node_rank, message):
    """Only one node of two starts: the launcher fails within --join_timeout (plus its own
    start), naming what is missing (static used to wait silently for good, c10d 600 s)."""
    port = free_port()
    nodes = ["--nnodes", "2", "--node_rank", str(node_rank), "--master_port", str(port)] if backend == "static" else [
        "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    start = time.monotonic()
    r = launch(*nodes, "--join_timeout", "3", str(SCRIPTS / "allreduce.py"), env={"AUTOPAR_RDZV_TOKEN": "t"})
    elapsed = time.monotonic() - start
    assert r.returncode == 1
    assert message.format(port=port) in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert elapsed < 3 + 20, f"the launcher took {elapsed:.1f} s"


# -- the root cause of a failure -------------------------------------------------------------
@pytest.mark.parametrize("how", ["sys_exit", "os_exit", "linger"])
def test_the_rank_that_failed_first_is_the_root_cause(how):
    """On 4 ranks rank 2 leaves with status 3 while the others wait in a collective with it.
    The summary's root cause is rank 2, and every other rank is listed as stopped after it.
    "linger": after its sys.exit rank 2 closes its groups and stays alive until the others
    have failed and ended: they end first (elastic named one of them), yet rank 2 failed first."""
    r = launch("--nproc_per_node", "4", str(SCRIPTS / "one_rank_exits.py"), "2", "3", how, timeout=180)
    assert r.returncode == 1
    others, root = r.stderr.split("Failures:")[1].split("Root Cause (first observed failure):")
    assert "rank      : 2 (local_rank: 2)" in root, r.stderr[-3000:]
    # a rank stopped while it was still leaving says so (always so when it lingers)
    expected = "rank 2 exited with code 3"
    if how == "linger":
        expected += " (and was stopped by signal SIGTERM while leaving); the other ranks were stopped"
    assert expected in root, root
    listed = re.findall(r"rank      : (\d) ", others)
    assert set(listed) <= {"0", "1", "3"} and listed, others
    assert others.count("stopped after rank 2 failed") == len(listed), others


def test_exit_times_are_noted_when_a_child_ends_not_when_it_is_reaped():
    """The launcher's clock for ranks that wrote no stamp (os._exit, a signal)."""
    exits = ExitTimes()
    exits.start()
    try:
        start = time.time()
        first, second = (subprocess.Popen(["sleep", s]) for s in ("0.2", "0.8"))
        time.sleep(1.5)  # neither is reaped meanwhile
        first.wait()
        second.wait()
        time.sleep(0.1)
    finally:
        exits.close()
    assert exits.ended[first.pid] - start == pytest.approx(0.2, abs=0.25)
    assert exits.ended[second.pid] - start == pytest.approx(0.8, abs=0.25)
    assert exits.ended[first.pid] < exits.ended[second.pid]


@pytest.mark.parametrize("master_addr, message", [
    ("0.0.0.0", "refusing to host a store on '0.0.0.0': it would listen on every interface"),
    ("192.0.2.200", "cannot host a store on 192.0.2.200:{port} (192.0.2.200): Cannot assign requested address"),
])
def test_node_0_hosts_its_store_on_an_address_of_its_own_only(master_addr, message):
    port = free_port()
    r = launch("--nnodes", "2", "--master_addr", master_addr, "--master_port", str(port), "--join_timeout", "3",
               str(SCRIPTS / "allreduce.py"))
    assert r.returncode == 1
    assert message.format(port=port) in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
