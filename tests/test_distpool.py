"""Tests of tests/distpool.py: the pool of gloo rank processes behind run_dist."""
import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import distpool
from distpool import RunDistError, run_dist

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# ---- rank functions (module level: the workers import them by name) --------------------

def _allreduce_rank(scale, *, offset=0.0):
    t = torch.tensor([float(dist.get_rank())]) * scale + offset
    dist.all_reduce(t)
    return dist.get_rank(), t


def _env_view():
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")
    return ({k: os.environ.get(k) for k in keys}, torch.get_num_threads(),
            dist.get_rank(), dist.get_world_size(), dist.get_backend())


def _gather_small(n):
    out = [torch.empty(n) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.full((n,), float(dist.get_rank())))
    return torch.stack(out)


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {dist.get_rank()}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks wait here for the failed one
    return t


def _raise_everywhere():
    print(f"about to fail on {dist.get_rank()}")
    raise KeyError(f"bad key {dist.get_rank()}")


def _exit_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


def _segfault_on(bad_rank):
    if dist.get_rank() == bad_rank:
        import ctypes
        ctypes.string_at(0)
    return dist.get_rank()


def _sleep_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def _tiny():
    return dist.get_rank()


def _print_and_return(tag):
    print(f"hello {tag} from {dist.get_rank()}")
    print(f"err {dist.get_rank()}", file=sys.stderr)
    return os.getpid()


def _dirty_state():
    os.environ["DISTPOOL_LEAK"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return torch.rand(3)


def _clean_state():
    return (os.environ.get("DISTPOOL_LEAK"), torch.get_default_dtype(),
            torch.is_grad_enabled(), torch.rand(3))


def _failing_assert():
    x = dist.get_rank() + 2
    assert x == 3


def _destroy_group():
    dist.destroy_process_group()
    return os.getpid()


def _pid():
    return os.getpid()


def _nonpicklable_result():
    return lambda: 0


# ---- tests -----------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [2, 4])
def test_allreduce_results_in_rank_order(ws):
    results = run_dist(_allreduce_rank, ws, 2.0, offset=1.0)
    expected = sum(2.0 * r + 1.0 for r in range(ws))
    assert [r for r, _ in results] == list(range(ws))
    for _, t in results:
        assert torch.equal(t, torch.tensor([expected]))


def test_worker_environment():
    results = run_dist(_env_view, 4)
    ports = {env["MASTER_PORT"] for env, *_ in results}
    assert len(ports) == 1
    for rank, (env, nthreads, drank, dws, backend) in enumerate(results):
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) == str(drank)
        assert env["WORLD_SIZE"] == "4" and dws == 4
        assert env["OMP_NUM_THREADS"] == "1" and nthreads == 1
        assert backend == "gloo"


@pytest.mark.parametrize("ws", [1, 6, 8])
def test_other_world_sizes(ws):
    for res in run_dist(_gather_small, ws, 5):
        assert torch.equal(res, torch.arange(ws, dtype=torch.float32)[:, None].expand(ws, 5))


def test_failure_in_one_rank_names_it_and_pool_recovers(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TEST_GRACE", "2")
    run_dist(_tiny, 4)  # pool up, so the timing below is the failure handling only
    t0 = time.monotonic()
    with pytest.raises(RunDistError) as ei:
        run_dist(_raise_on, 4, 1)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "rank 1" in msg
    assert "ValueError: boom on rank 1" in msg
    assert "in _raise_on" in msg  # the traceback itself
    assert "rank 0 did not answer within 2s after the first failure" in msg
    assert set(ei.value.failures) == {0, 1, 2, 3}  # 1 raised, the others were stuck
    assert isinstance(ei.value.exceptions[1], ValueError)
    assert ei.value.exc_types == {1: "ValueError"}
    assert ei.value.pool_killed
    assert took < 10, took
    # the next call gets a fresh, working pool
    results = run_dist(_allreduce_rank, 4, 1.0)
    assert [t.item() for _, t in results] == [6.0] * 4


def test_ordinary_failure_on_all_ranks_keeps_pool(capsys):
    pids = run_dist(_pid, 2)
    with pytest.raises(RunDistError) as ei:
        run_dist(_raise_everywhere, 2)
    err = ei.value
    assert not err.pool_killed
    assert sorted(err.failures) == [0, 1]
    assert err.exc_types == {0: "KeyError", 1: "KeyError"}
    assert "KeyError: 'bad key 0'" in str(err) and "KeyError: 'bad key 1'" in str(err)
    assert "about to fail on 1" in str(err)  # the failing rank's output is in the error
    assert run_dist(_pid, 2) == pids  # same processes
    assert "about to fail" not in capsys.readouterr().out  # not echoed twice


def test_worker_exit_mid_task_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TEST_GRACE", "2")
    run_dist(_tiny, 4)
    t0 = time.monotonic()
    with pytest.raises(RunDistError) as ei:
        run_dist(_exit_on, 4, 2)
    assert time.monotonic() - t0 < 10
    assert "rank 2 died without answering (exit code 3)" in str(ei.value)
    assert ei.value.pool_killed
    assert [t.item() for t in run_dist(_exit_on, 4, -1)] == [4.0] * 4


def test_segfault_is_reported_with_stack():
    with pytest.raises(RunDistError) as ei:
        run_dist(_segfault_on, 2, 1)
    msg = str(ei.value)
    assert "rank 1 died without answering (killed by SIGSEGV)" in msg
    assert "Segmentation fault" in msg and "_segfault_on" in msg  # faulthandler's dump
    assert ei.value.results == {0: 0}
    assert run_dist(_tiny, 2) == [0, 1]


def test_task_deadline_dumps_stack_of_stuck_rank(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TEST_TASK_TIMEOUT", "2")
    run_dist(_tiny, 2)
    t0 = time.monotonic()
    with pytest.raises(RunDistError) as ei:
        run_dist(_sleep_on_rank0, 2)
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert "rank 0 did not answer before the task deadline" in msg
    assert "rank 0 did not answer within the 2s task deadline" in msg
    assert "_sleep_on_rank0" in msg  # faulthandler stack of the stuck rank
    assert ei.value.results == {1: 1}
    assert run_dist(_tiny, 2) == [0, 1]


def test_many_tiny_tasks_are_cheap():
    run_dist(_tiny, 4)  # pool up
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        assert run_dist(_tiny, 4) == [0, 1, 2, 3]
    dt = time.perf_counter() - t0
    print(f"\ndistpool: {n} tiny tasks on 4 ranks: {dt:.3f}s, {dt / n * 1e3:.2f} ms/task; "
          f"pool start times: { {ws: round(i['start_time'], 2) for ws, i in distpool.pool_info().items()} }")
    assert dt < 3.0


def test_output_is_echoed_with_rank_prefix(capsys):
    run_dist(_print_and_return, 2, "x")
    out = capsys.readouterr().out
    assert "[rank 0] hello x from 0" in out and "[rank 1] hello x from 1" in out
    assert "[rank 1] err 1" in out


def test_state_is_reset_between_tasks():
    dirty = run_dist(_dirty_state, 2)
    clean = run_dist(_clean_state, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)
    for leak, dtype, grad, rand in clean:
        assert leak is None and dtype == torch.float32 and grad
        assert torch.equal(rand, expected)
    assert torch.equal(dirty[0].float(), dirty[1].float())  # seeded identically


def test_asserts_in_rank_functions_are_explained():
    with pytest.raises(RunDistError) as ei:
        run_dist(_failing_assert, 2)
    assert "assert 3 == 3" not in str(ei.value)
    assert "assert 2 == 3" in str(ei.value)  # rank 0 only: x = 2
    assert sorted(ei.value.failures) == [0]


def test_destroyed_default_group_gets_a_fresh_pool():
    pids = run_dist(_destroy_group, 2)
    assert run_dist(_tiny, 2) == [0, 1]
    assert set(run_dist(_pid, 2)).isdisjoint(pids)


def test_bad_functions_and_results():
    with pytest.raises(TypeError, match="module-level"):
        run_dist(lambda: 0, 2)
    with pytest.raises(RunDistError, match="pickle"):
        run_dist(_nonpicklable_result, 2)
    assert run_dist(_tiny, 2) == [0, 1]


SUB_MODULE = """
import torch, torch.distributed as dist

class Box:
    def __init__(self, v):
        self.v = v

def _body(box):
    t = torch.tensor([box.v * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
    return Box(t.item())
"""


def test_module_only_loadable_from_its_file(tmp_path):
    # what pytest's --import-mode=importlib produces: a module whose name the workers
    # cannot import; they load it from its file instead (and the pickled Box resolves)
    path = tmp_path / "test_hidden.py"
    path.write_text(SUB_MODULE)
    name = "test_hidden_xyz"  # tmp_path is not on sys.path
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        res = run_dist(mod._body, 2, mod.Box(1.0))
        assert [type(b).__module__ for b in res] == [name, name]
        assert [b.v for b in res] == [3.0, 3.0]
    finally:
        del sys.modules[name]


def test_workers_die_with_the_test_process(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {TESTS_DIR!r})
        import distpool, multiprocessing.forkserver as fs
        import test_distpool
        pids = distpool.run_dist(test_distpool._pid, 2)
        print(*pids, fs._forkserver._forkserver_pid, distpool._POOLS[2].logdir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    *pids, logdir = proc.stdout.split()
    pids = [int(p) for p in pids]
    assert len(pids) == 3, proc.stdout + proc.stderr

    def alive(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                return "\nState:\tZ" not in f.read()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(logdir)  # the ranks removed their log files
