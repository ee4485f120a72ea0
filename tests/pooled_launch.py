"""A script run on a pooled world as `python -m autopar.launch --nproc_per_node N` runs it on
each rank: through the launcher's own rank code (`autopar.launch._worker.run`: the script as
`__main__`, its argv and sys.path[0]), without a fresh interpreter importing torch per rank.

    outputs = run_launched(script, nproc, args)   # [stdout and stderr of rank 0, 1, ...]
"""
import contextlib
import io
import sys

from autopar.launch import _worker
from distpool import run_dist


def run_launched(script: str, nproc: int, args: list) -> list:
    """[stdout and stderr of rank 0, 1, ...] of `script` with `args`; fails with a rank's
    output where its exit status is not 0 (as the launcher would exit non-zero)."""
    ranks = run_dist(_run_as_a_launched_rank, nproc, script, list(args))
    for rank, (status, out) in enumerate(ranks):
        assert status == 0, f"{script} rank {rank} exited {status}:\n{out[-6000:]}"
    return [out for _, out in ranks]


def _run_as_a_launched_rank(script: str, args: list) -> tuple:
    """This rank's run; its sys.path and argv as they were afterwards (the pool's next test
    needs them)."""
    path, argv = list(sys.path), list(sys.argv)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = _worker.run(script, args, module=False)
    finally:
        sys.path[:], sys.argv = path, argv
    return status, out.getvalue()
