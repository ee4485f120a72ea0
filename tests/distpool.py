"""Run test functions on real multi-process gloo worlds, reusing rank processes across tests.

    from distpool import run_dist
    results = run_dist(fn, world_size, *args, **kwargs)   # [fn's return value on rank 0, 1, ...]

`fn` must be a module-level function (workers import it by module name + qualname, falling
back to the module's file); args, kwargs and return values must be picklable (tensors are
fine).  Each world size gets one pool of rank processes, started on first use and kept for
the whole session (see AUTOPAR_TEST_MAX_POOLS).  Every rank runs with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set, one thread, and the default gloo
process group initialised.  Before each task every rank resets per-test state: seeds
(torch/random/numpy = 0), default dtype, grad mode, os.environ, cwd, and
`autopar._reset_for_tests()` when autopar has it.

Failures: if fn raises on any rank, run_dist raises RunDistError (an AssertionError) holding
every failing rank's traceback and output.  If every rank answered, the pool is kept (after a
one-collective health check); if some ranks are stuck (typically in a collective waiting for
a failed peer), died, or the task overran its deadline, their Python stacks are dumped, the
pool is killed and the next run_dist starts a fresh one.  Nothing waits forever.

Worker stdout/stderr (fd level) goes to a per-rank log file; after each task it is echoed to
this process's stdout prefixed with "[rank r]" (so pytest shows it under "Captured stdout",
or live-ish with -s), and failing ranks' output is included in the error.

Environment knobs (read when a pool starts / per call):
  AUTOPAR_TEST_TIMEOUT       gloo process-group timeout in the workers, seconds (60)
  AUTOPAR_TEST_TASK_TIMEOUT  overall deadline of one run_dist call, seconds (120)
  AUTOPAR_TEST_GRACE         after the first failing rank, how long to wait for the others (5)
  AUTOPAR_TEST_MAX_POOLS     keep at most this many pools alive, LRU; 0 = no limit (0)
  AUTOPAR_TEST_START_METHOD  "forkserver" (default: torch, autopar and transformers are
                             imported once, ranks fork from it) or "spawn"
  AUTOPAR_TEST_LIVE_OUTPUT   1: workers write straight to the inherited stdout/stderr
                             (live with -s) instead of log files; output is then not part of
                             the error message
"""
from __future__ import annotations

import atexit
import collections
import datetime
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

__all__ = ["run_dist", "shutdown", "RunDistError", "pool_info"]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_OUTPUT_TAIL = 8000  # chars of a failing rank's output kept in the error message


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "").strip()
    return float(v) if v else default


class RunDistError(AssertionError):
    """fn failed, died or hung on some ranks.

    Attributes: `failures` {rank: formatted traceback / reason}, `exceptions` {rank: the
    exception object when it could be pickled back, else None}, `results` {rank: return
    value} for ranks that finished, `world_size`, `pool_killed`.
    """

    def __init__(self, msg, failures, exceptions, results, world_size, pool_killed):
        super().__init__(msg)
        self.failures = failures
        self.exceptions = exceptions
        self.results = results
        self.world_size = world_size
        self.pool_killed = pool_killed

    @property
    def exc_types(self) -> dict:
        """{rank: exception class name} for the ranks that raised (not died/stuck)."""
        out = {}
        for r, tb in sorted(self.failures.items()):
            e = self.exceptions.get(r)
            if e is not None:
                out[r] = type(e).__name__
            elif tb.startswith("Traceback"):
                out[r] = _last_exc_line(tb).split(":")[0].rsplit(".", 1)[-1]
        return out


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


_LIFELINE_BLOCK = re.compile(
    r"Thread 0x[0-9a-f]+ \(most recent call first\):\n(?:  File .*\n)*?  File .* in _lifeline\n"
    r"(?:  File .*\n)*\n?")
_BOOTSTRAP_FRAMES = re.compile(r"(  File .*distpool\.py\", line \d+ in _worker_main\n)(?:  File .*\n)*")


def _tidy_dump(text: str) -> str:
    """Drop the lifeline thread and the multiprocessing bootstrap frames from faulthandler
    stack dumps in a rank's output."""
    if "most recent call first" not in text:
        return text
    return _BOOTSTRAP_FRAMES.sub("", _LIFELINE_BLOCK.sub("", text))


def _exit_str(code) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _last_exc_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln and not ln.startswith(" ")]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------

_CACHED_FNS: dict = {}


def _is_test_file(path) -> bool:
    base = os.path.basename(path or "")
    return base.endswith(".py") and (base.startswith("test_") or base.endswith("_test.py"))


def _load_module(modname: str, filename: str | None):
    mod = sys.modules.get(modname)
    if mod is not None:
        return mod
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    if filename is not None and (origin is None or not os.path.isfile(origin)
                                 or os.path.realpath(origin) != os.path.realpath(filename)):
        # pytest importmode=importlib, or a module not on sys.path: load it from its file
        spec = importlib.util.spec_from_file_location(modname, filename)
    elif spec is None or not _is_test_file(origin):
        return importlib.import_module(modname)
    if _is_test_file(spec.origin):
        mod = _exec_rewritten(modname, spec, spec.origin)
        if mod is not None:
            return mod
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return mod


def _exec_rewritten(modname, spec, path):
    """Import a test module with pytest's assert rewriting (asserts in rank functions then
    explain their operands).  Returns None if pytest's rewriter is unavailable."""
    try:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts

        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path)
        code = compile(tree, path, "exec", dont_inherit=True)
    except Exception:
        return None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return mod


def _resolve(ref):
    fn = _CACHED_FNS.get(ref)
    if fn is None:
        kind = ref[0]
        if kind == "ref":
            _, modname, qualname, filename = ref
            obj = _load_module(modname, filename)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            fn = obj
        else:  # pickled callable (functools.partial, callable instance, ...)
            return pickle.loads(ref[1])
        _CACHED_FNS[ref] = fn
    return fn


class _State:
    """Per-test global state restored before each task."""

    def __init__(self):
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.autopar_tried = False

    def reset(self):
        import torch

        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        torch.manual_seed(0)
        random.seed(0)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(0)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        ap = sys.modules.get("autopar")
        if ap is None and not self.autopar_tried:
            self.autopar_tried = True
            try:
                ap = importlib.import_module("autopar")
            except ImportError:
                ap = None
        reset = getattr(ap, "_reset_for_tests", None) if ap is not None else None
        if reset is not None:
            reset()


def _lifeline(conn, log_path):
    """Exit when the test process goes away (its end of `conn` closes)."""
    try:
        conn.recv_bytes()
    except BaseException:
        pass
    if log_path:  # the test process may have been killed: clean up after it
        try:
            os.unlink(log_path)
            os.rmdir(os.path.dirname(log_path))  # succeeds for the last rank out
        except OSError:
            pass
    os._exit(70)


def _redirect_output(log_path):
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for std in (sys.stdout, sys.stderr):
        try:
            std.flush()
        except Exception:
            pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # text streams on the (new) fds 1/2, line-buffered so little is lost if the rank dies
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")


def _worker_main(rank, world_size, port, conn, lifeline, log_path, pg_timeout, environ):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is handled by the test process
    threading.Thread(target=_lifeline, args=(lifeline, log_path), daemon=True,
                     name="distpool-lifeline").start()
    if log_path:
        _redirect_output(log_path)
    else:
        for std in (sys.stdout, sys.stderr):
            try:
                std.reconfigure(line_buffering=True)
            except Exception:
                pass
    faulthandler.enable(all_threads=True)  # segfault -> Python stacks in the output
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)  # stack dump on hang
    if _TESTS_DIR not in sys.path:
        sys.path.append(_TESTS_DIR)

    # the test process's environment when the pool started (a forkserver child would
    # otherwise see the fork server's, from when it was first started)
    os.environ.clear()
    os.environ.update(environ)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    os.environ.update(env)
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
    except BaseException:
        conn.send_bytes(pickle.dumps((-1, False, traceback.format_exc(), None, False)))
        return
    try:  # pay the library's import cost at pool start, not in the first test
        importlib.import_module("autopar")
    except Exception:
        pass
    state = _State()
    conn.send_bytes(pickle.dumps((-1, True, os.getpid(), None, True)))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        _, task_id, ref, payload, syspath = msg
        if syspath is not None:  # import modules the way the test process does
            sys.path[:] = list(syspath) + [p for p in sys.path if p not in syspath]
        try:
            state.reset()
            fn = _resolve(ref)
            args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            reply = pickle.dumps((task_id, True, result, None, dist.is_initialized()))
        except BaseException as e:
            tb_obj = e.__traceback__
            if tb_obj is not None and tb_obj.tb_next is not None:
                tb_obj = tb_obj.tb_next  # drop this loop's own frame
            tb = "".join(traceback.format_exception(type(e), e, tb_obj))
            try:
                exc = pickle.dumps(e)
                pickle.loads(exc)
            except BaseException:
                exc = None
            reply = pickle.dumps((task_id, False, tb, exc, dist.is_initialized()))
        for std in (sys.stdout, sys.stderr):
            try:
                std.flush()
            except Exception:
                pass
        try:
            conn.send_bytes(reply)
        except OSError:
            break
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        pass
    for std in (sys.stdout, sys.stderr):
        try:
            std.flush()
        except Exception:
            pass
    os._exit(0)  # skip interpreter teardown (slow, and nothing left to do)


def _pool_health():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


# --------------------------------------------------------------------------------------
# test-process side
# --------------------------------------------------------------------------------------

_POOLS: "collections.OrderedDict[int, _Pool]" = collections.OrderedDict()
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        method = os.environ.get("AUTOPAR_TEST_START_METHOD", "forkserver").strip() or "forkserver"
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            # torch, autopar and what _warm_torch loads are imported once in the fork server;
            # ranks fork from it (a fresh interpreter importing torch per rank costs ~1.3 s of
            # CPU each, transformers seconds more).
            ctx.set_forkserver_preload(["torch", "torch.distributed", "_pytest.assertion.rewrite", "_warm_torch",
                                        "autopar"])
            with _single_thread_env(), _this_sys_path():
                from multiprocessing import forkserver

                forkserver.ensure_running()
        _CTX = ctx
    return _CTX


class _single_thread_env:
    """While starting processes: set the thread-count env vars (so the fork server's
    torch/BLAS import and the ranks come up single-threaded), and keep multiprocessing from
    re-running the __main__ script in the children (ranks never need it; under the `pytest`
    console script it would re-import pytest, in an unguarded script it would recurse)."""

    KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

    def __enter__(self):
        from multiprocessing import spawn

        self.saved = {k: os.environ.get(k) for k in self.KEYS}
        for k in self.KEYS:
            os.environ[k] = "1"
        self.spawn = spawn
        self.orig = spawn.get_preparation_data

        def get_preparation_data(name, _orig=self.orig):
            data = _orig(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = get_preparation_data

    def __exit__(self, *exc):
        self.spawn.get_preparation_data = self.orig
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _this_sys_path:
    """While starting the fork server: PYTHONPATH = this process's sys.path, so that it finds
    the preloaded modules (tests/_warm_torch, autopar) where this process does.  Python 3.11's
    fork server is sent sys.path but does not apply it: without this, _warm_torch was never
    found (an ImportError the fork server ignores) and every rank paid for it."""

    def __enter__(self):
        self.saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self.saved


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_ref(fn):
    modname = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if modname and qualname and "<" not in qualname:
        mod = sys.modules.get(modname)
        obj = mod
        try:
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            obj = None
        if obj is fn:
            if modname == "__main__":
                raise TypeError("run_dist: fn must live in an importable module, not __main__")
            return ("ref", modname, qualname, getattr(mod, "__file__", None))
    if qualname and "<" in qualname:
        raise TypeError(
            f"run_dist needs a module-level function (workers import it by name); "
            f"got {modname}.{qualname}")
    try:
        return ("pickle", pickle.dumps(fn))
    except Exception as e:
        raise TypeError(f"run_dist: cannot send {fn!r} to the workers: {e}") from e


def _fn_name(ref):
    return f"{ref[1]}.{ref[2]}" if ref[0] == "ref" else "<pickled callable>"


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.pg_timeout = _env_float("AUTOPAR_TEST_TIMEOUT", 60.0)
        self.live = os.environ.get("AUTOPAR_TEST_LIVE_OUTPUT", "") not in ("", "0")
        self.dead = False
        self.tasks = 0
        self.logdir = tempfile.mkdtemp(prefix=f"distpool-ws{world_size}-")
        self.logs = [None if self.live else os.path.join(self.logdir, f"rank{r}.log")
                     for r in range(world_size)]
        self.procs, self.conns, self.lifelines = [], [], []
        t0 = time.perf_counter()
        ctx = _context()
        self.port = _free_port()
        self.sent_syspath = None
        environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        try:
            with _single_thread_env():
                for r in range(world_size):
                    parent_end, child_end = ctx.Pipe(duplex=True)
                    life_r, life_w = ctx.Pipe(duplex=False)
                    p = ctx.Process(
                        target=_worker_main,
                        args=(r, world_size, self.port, child_end, life_r, self.logs[r],
                              self.pg_timeout, environ),
                        name=f"distpool-ws{world_size}-rank{r}", daemon=True)
                    p.start()
                    child_end.close()
                    life_r.close()
                    self.procs.append(p)
                    self.conns.append(parent_end)
                    self.lifelines.append(life_w)
            deadline = time.monotonic() + self.pg_timeout + 60
            answers, dead, pending = self._collect(-1, deadline, grace=0.5)
        except BaseException:
            self.kill()
            raise
        bad = {r: a[1] for r, a in answers.items() if not a[0]}
        if bad or dead or pending:
            out = self.kill(dump=pending)
            failures = dict(bad)
            for r, code in dead.items():
                failures[r] = f"rank {r} died during pool start ({_exit_str(code)})"
            for r in pending:
                failures[r] = f"rank {r} did not finish init_process_group (stack dumped in its output)"
            raise _PoolStartError(self._message(
                f"distpool: starting a {world_size}-rank gloo pool failed", failures, out),
                failures)
        self.start_time = time.perf_counter() - t0

    # -- plumbing ----------------------------------------------------------------------

    def alive(self) -> bool:
        return not self.dead and all(p.is_alive() for p in self.procs)

    def _collect(self, task_id, deadline, grace):
        """Wait for one reply per rank.  Returns (answers {rank: (ok, value, exc, pg_ok)},
        dead {rank: exitcode}, pending set).  Stops waiting `grace` s after the first
        failure/death, or at `deadline`."""
        n = self.world_size
        answers, dead = {}, {}
        pending = set(range(n))
        first_bad = None
        by_obj = {}
        for r in range(n):
            by_obj[self.conns[r]] = ("conn", r)
            by_obj[self.procs[r].sentinel] = ("proc", r)

        def take(r):
            try:
                tid, ok, value, exc, pg_ok = pickle.loads(self.conns[r].recv_bytes())
            except (EOFError, OSError):
                return False
            except Exception:
                ok, value, exc, pg_ok = (False, "could not unpickle rank %d's reply:\n%s"
                                         % (r, traceback.format_exc()), None, False)
                tid = task_id
            if tid != task_id:  # stale reply; cannot happen with the kill policy
                return True
            answers[r] = (ok, value, exc, pg_ok)
            pending.discard(r)
            return True

        while pending:
            now = time.monotonic()
            limit = deadline if first_bad is None else min(deadline, first_bad + grace)
            if now >= limit:
                break
            objs = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            ready = multiprocessing.connection.wait(objs, timeout=limit - now)
            for obj in sorted(ready, key=lambda o: by_obj[o][0] == "proc"):  # conns first
                kind, r = by_obj[obj]
                if r not in pending:
                    continue
                if kind == "conn":
                    if take(r):
                        if not answers[r][0] and first_bad is None:
                            first_bad = time.monotonic()
                        continue
                # process ended (or its pipe closed) without a reply
                if self.conns[r].poll(0) and take(r):
                    continue
                self.procs[r].join(1.0)
                dead[r] = self.procs[r].exitcode
                pending.discard(r)
                self.dead = True
                if first_bad is None:
                    first_bad = time.monotonic()
        return answers, dead, pending

    def _read_output(self, r) -> str:
        path = self.logs[r]
        if path is None:
            return ""
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data:
                os.truncate(path, 0)
        except OSError:
            return ""
        return _tidy_dump(data.decode("utf-8", "replace"))

    def _echo(self, outputs):
        for r in sorted(outputs):
            text = outputs[r]
            if text:
                if not text.endswith("\n"):
                    text += "\n"
                sys.stdout.write("".join(f"[rank {r}] {ln}" for ln in text.splitlines(True)))
        try:
            sys.stdout.flush()
        except Exception:
            pass

    def kill(self, dump=()):
        """Kill every rank; `dump` ranks first get SIGUSR1 (faulthandler stack dump).
        Returns {rank: output} read after the dump."""
        self.dead = True
        dump = [r for r in dump if r < len(self.procs) and self.procs[r].is_alive()]
        for r in dump:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        if dump:
            time.sleep(0.5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        outputs = {r: self._read_output(r) for r in range(len(self.procs))}
        self._close_handles()
        return outputs

    def close(self, send_stop=True):
        """Graceful: ask ranks to leave the process group and exit; kill stragglers."""
        if self.dead:
            self._echo(self.kill())
            return
        self.dead = True
        if send_stop:
            self.send_stop()
        t_end = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, t_end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._echo({r: self._read_output(r) for r in range(len(self.procs))})
        self._close_handles()

    def send_stop(self):
        """Ranks 1.. first, rank 0 once they are gone (or 5 s): rank 0 holds the job's store,
        and a rank that outlives it has torch log its exit watchdog's broken wait."""
        self._send_stop(self.conns[1:])
        t_end = time.monotonic() + 5
        for p in self.procs[1:]:
            p.join(max(0.0, t_end - time.monotonic()))
        self._send_stop(self.conns[:1])

    @staticmethod
    def _send_stop(conns):
        for c in conns:
            try:
                c.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass

    def _close_handles(self):
        for c in self.conns + self.lifelines:
            try:
                c.close()
            except OSError:
                pass
        self.conns, self.lifelines = [], []
        for p in self.procs:
            try:
                p.close()
            except ValueError:
                pass
        self.procs = []
        shutil.rmtree(self.logdir, ignore_errors=True)

    def _message(self, head, failures, outputs, order=None):
        parts = [head]
        order = list(order) if order is not None else sorted(failures)
        groups = collections.OrderedDict()  # identical tracebacks are shown once
        for r in order:
            groups.setdefault(failures[r], []).append(r)
        for tb, ranks in groups.items():
            parts.append(f"\n===== {_ranks(ranks)} =====\n{tb.rstrip()}")
        for r in order:
            text = (outputs or {}).get(r, "")
            if text:
                if len(text) > _OUTPUT_TAIL:
                    text = "...\n" + text[-_OUTPUT_TAIL:]
                parts.append(f"\n----- rank {r} output -----\n{text.rstrip()}")
        return "\n".join(parts)

    # -- one task ------------------------------------------------------------------------

    def run(self, ref, payload):
        self.tasks += 1
        __tracebackhide__ = True
        task_id = self.tasks
        n = self.world_size
        t_start = time.monotonic()
        deadline = t_start + _env_float("AUTOPAR_TEST_TASK_TIMEOUT", 120.0)
        grace = _env_float("AUTOPAR_TEST_GRACE", 5.0)
        syspath = tuple(sys.path)
        if syspath == self.sent_syspath:
            syspath = None
        else:
            self.sent_syspath = syspath
        msg = pickle.dumps(("task", task_id, ref, payload, syspath))
        try:
            sent_fail = {}
            for r in range(n):
                try:
                    self.conns[r].send_bytes(msg)
                except OSError as e:
                    sent_fail[r] = e
            answers, dead, pending = self._collect(task_id, deadline, grace)
        except BaseException:  # ^C or an internal error: the ranks' state is unknown
            self._echo(self.kill(dump=range(n)))
            raise
        for r in sent_fail:
            if r not in answers and r not in dead:
                dead[r] = self.procs[r].exitcode
                pending.discard(r)

        ok = not dead and not pending and all(a[0] for a in answers.values())
        if ok:
            self._echo({r: self._read_output(r) for r in range(n)})
            if not all(a[3] for a in answers.values()):
                self.close()  # the default process group is gone on some rank
            return [answers[r][1] for r in range(n)]

        failures, exceptions = {}, {}
        for r, (a_ok, value, exc, _) in answers.items():
            if not a_ok:
                failures[r] = value
                try:
                    exceptions[r] = pickle.loads(exc) if exc is not None else None
                except Exception:
                    exceptions[r] = None
        for r, code in dead.items():
            failures[r] = (f"rank {r} died without answering ({_exit_str(code)}); "
                           "see its output below")
            exceptions[r] = None
        timed_out = bool(pending) and time.monotonic() >= deadline
        for r in sorted(pending):
            failures[r] = (f"rank {r} did not answer "
                           + (f"within the {deadline - t_start:.0f}s task deadline "
                              "(AUTOPAR_TEST_TASK_TIMEOUT)" if timed_out else
                              f"within {grace:.0f}s after the first failure (AUTOPAR_TEST_GRACE)")
                           + "; probably stuck in a collective. Its Python stack is in its output below.")
            exceptions[r] = None
        results = {r: a[1] for r, a in answers.items() if a[0]}

        killed = bool(dead or pending)
        if killed:
            outputs = self.kill(dump=sorted(pending))
        else:
            outputs = {r: self._read_output(r) for r in range(n)}
            if not all(a[3] for a in answers.values()) or not self._healthy():
                extra = self.kill()  # default group gone, or the world is out of step
                outputs = {r: outputs[r] + extra.get(r, "") for r in outputs}
                killed = True
        # failing ranks' output goes into the error; the others' is echoed as usual
        self._echo({r: text for r, text in outputs.items() if r not in failures})
        raised = sorted(r for r, a in answers.items() if not a[0])
        what = []
        if raised:
            what.append(f"{_ranks(raised)} raised")
        if dead:
            what.append(f"{_ranks(dead)} died")
        if pending:
            what.append(f"{_ranks(pending)} did not answer"
                        + (" before the task deadline" if timed_out else
                           " (stuck, probably in a collective)"))
        head = (f"run_dist({_fn_name(ref)}, world_size={n}): " + "; ".join(what)
                + (". The pool was killed; the next run_dist starts a fresh one." if killed
                   else "."))
        order = raised + sorted(dead) + sorted(pending)
        raise RunDistError(self._message(head, failures, outputs, order), failures,
                           exceptions, results, n, killed)

    def _healthy(self) -> bool:
        """After an ordinary failure on some ranks: is the world still in step?"""
        self.tasks += 1
        task_id = self.tasks
        msg = pickle.dumps(("task", task_id, ("ref", __name__, "_pool_health", __file__),
                            pickle.dumps(((), {})), None))
        try:
            for c in self.conns:
                c.send_bytes(msg)
            answers, dead, pending = self._collect(task_id, time.monotonic() + 10, 0.0)
        except OSError:
            return False
        if dead or pending:
            return False
        return all(a[0] and a[1] == self.world_size for a in answers.values())


class _PoolStartError(RuntimeError):
    def __init__(self, msg, failures):
        super().__init__(msg)
        self.failures = failures


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive():
        _POOLS.pop(world_size)
        pool.kill()
        pool = None
    if pool is None:
        max_pools = int(_env_float("AUTOPAR_TEST_MAX_POOLS", 0))
        while max_pools > 0 and len(_POOLS) >= max_pools:
            _, old = _POOLS.popitem(last=False)
            old.close()
        for attempt in range(3):
            try:
                pool = _Pool(world_size)
                break
            except _PoolStartError as e:
                text = "\n".join(e.failures.values()).lower()
                if attempt == 2 or "address already in use" not in text:
                    raise
        _POOLS[world_size] = pool
    _POOLS.move_to_end(world_size)
    return pool


def run_dist(fn, world_size: int, *args, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on every rank of a `world_size`-rank gloo world; return the
    per-rank results (index = rank).  Raises RunDistError if any rank fails."""
    __tracebackhide__ = True
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_dist: world_size must be a positive int, got {world_size!r}")
    ref = _fn_ref(fn)
    payload = pickle.dumps((args, kwargs))
    pool = _get_pool(world_size)
    try:
        return pool.run(ref, payload)
    finally:
        if pool.dead and _POOLS.get(world_size) is pool:
            _POOLS.pop(world_size)


def pool_info() -> dict:
    """{world_size: {"pids": [...], "start_time": s, "tasks": n}} of the live pools."""
    return {ws: {"pids": [p.pid for p in pool.procs], "start_time": pool.start_time,
                 "tasks": pool.tasks} for ws, pool in _POOLS.items()}


def shutdown(world_size: int | None = None) -> None:
    """Close the pool of `world_size` (all pools if None); the next run_dist starts anew."""
    sizes = list(_POOLS) if world_size is None else [world_size]
    pools = [_POOLS.pop(ws) for ws in sizes if ws in _POOLS]
    for pool in pools:  # stop them all in parallel, then wait
        if not pool.dead:
            pool.send_stop()
    for pool in pools:
        pool.close(send_stop=False)


atexit.register(shutdown)
