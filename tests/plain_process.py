"""Run Python code in a fresh process outside any job (no rendezvous variables), as
`dist.simulate` needs: `run_plain(code)` returns its stdout, failing with its stderr (a new
interpreter: its imports and its exit are its own); `run_forked(code)` the same from a process
forked from the test pool's fork server, which has torch, autopar and transformers loaded
(seconds less per call); `evaluated(expr, module)` (forked) the JSON value of an expression
over a test module."""
import contextlib
import io
import json
import os
import subprocess
import sys
import traceback

import distpool

JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_plain(code: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(env, OMP_NUM_THREADS="1"), timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def last_line(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def evaluated(expr: str, module: str, timeout: int = 600):
    """The JSON value of `expr`, evaluated in a fresh plain process with the tests' `module`
    imported as `t` (and autopar as `dist`)."""
    code = "import json\nimport autopar as dist, %s as t\nprint(json.dumps(%s))\n" % (module, expr)
    return json.loads(last_line(run_forked(code, timeout=timeout)))


def run_forked(code: str, timeout: int = 600) -> str:
    """The stdout of `code` run as `__main__` in a process forked from the test pool's fork
    server with this process's environment (less the job's variables), sys.path and cwd, and
    one thread; fails with its output and traceback."""
    ctx = distpool._context()
    answer, sender = ctx.Pipe(duplex=False)
    env = dict({k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}, OMP_NUM_THREADS="1")
    proc = ctx.Process(target=_run, args=(code, env, list(sys.path), os.getcwd(), sender),
                       name="plain-process", daemon=True)
    proc.start()
    sender.close()
    try:
        if not answer.poll(timeout):
            raise AssertionError(f"no answer within {timeout} s from:\n{code}")
        ok, out = answer.recv()
    except EOFError:
        proc.join(5)
        raise AssertionError(f"the process died (exit code {proc.exitcode}) running:\n{code}") from None
    finally:
        answer.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert ok, out[-5000:]
    return out


def _run(code, env, path, cwd, sender):
    """In the forked process: (True, stdout) or (False, stdout, stderr and the traceback) to
    `sender`."""
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    try:
        import torch

        torch.set_num_threads(1)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(code, "<plain process>", "exec"), {"__name__": "__main__"})
        reply = (True, out.getvalue())
    except BaseException:
        reply = (False, out.getvalue()[-2000:] + err.getvalue()[-2000:] + traceback.format_exc())
    sender.send(reply)
    sender.close()
