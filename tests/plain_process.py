"""Run Python code in a fresh process outside any job (no rendezvous variables), as
`dist.simulate` needs: `run_plain(code)` returns its stdout, failing with its stderr."""
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
