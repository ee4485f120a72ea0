"""Run Python code in a fresh process outside any job (no rendezvous variables), as
`dist.simulate` needs: `run_plain(code)` returns its stdout, failing with its stderr;
`evaluated(expr, module)` the JSON value of an expression over a test module."""
import json
import os
import subprocess
import sys

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
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys; sys.path.insert(0, %r)\n"
            "import autopar as dist, %s as t\n"
            "print(json.dumps(%s))\n" % (here, module, expr))
    return json.loads(last_line(run_plain(code, timeout=timeout)))
