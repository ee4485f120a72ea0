"""Run Python code in a fresh process outside any job (no rendezvous variables), as
`dist.simulate` needs: `run_plain(code)` returns its stdout, failing with its stderr (a new
interpreter: its imports and its exit are its own); `evaluated(expr, module)` the JSON value
of an expression over a test module (forked from the test pool's fork server, which has
torch, autopar and transformers loaded: seconds less per call)."""
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
    ctx = distpool._context()
    answer, sender = ctx.Pipe(duplex=False)
    env = dict({k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}, OMP_NUM_THREADS="1")
    proc = ctx.Process(target=_evaluate, args=(expr, module, env, list(sys.path), os.getcwd(), sender),
                       name="plain-process", daemon=True)
    proc.start()
    sender.close()
    try:
        if not answer.poll(timeout):
            raise AssertionError(f"{expr} over {module}: no answer within {timeout} s")
        ok, text = answer.recv()
    except EOFError:
        proc.join(5)
        raise AssertionError(f"{expr} over {module}: the process died (exit code {proc.exitcode})") from None
    finally:
        answer.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert ok, text
    return json.loads(text)


def _evaluate(expr, module, env, path, cwd, sender):
    """In the forked process: the caller's environment, sys.path and cwd, one thread, then
    (True, the value as JSON) or (False, the traceback and the output) to `sender`."""
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.chdir(cwd)
    out = io.StringIO()
    try:
        import torch

        torch.set_num_threads(1)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            import importlib

            scope = {"dist": importlib.import_module("autopar"), "t": importlib.import_module(module)}
            reply = (True, json.dumps(eval(expr, scope)))
    except BaseException:
        reply = (False, out.getvalue()[-2000:] + traceback.format_exc()[-3000:])
    sender.send(reply)
    sender.close()
