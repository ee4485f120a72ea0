"""Run one launch through torch elastic's agent and turn its outcome into an exit status.

Failure propagation is elastic's: the agent polls its workers every 0.1 s, and
as soon as one exits non-zero it SIGTERMs the process group of every other
local rank (SIGKILL after 30 s if one lingers) and raises ``ChildFailedError``. The
failing rank's traceback is forwarded onto our stderr before the summary (from its
log file, when ``--log-ranks`` hides the rank). The summary's root cause is the rank that
failed first, timed to the millisecond (:mod:`._exits`), the others are listed as stopped
after it. ``@record``
forwards an error file the worker did write (scripts decorated with elastic's
``@record``) to this launcher's own ``TORCHELASTIC_ERROR_FILE`` for schedulers;
we then print elastic's failure summary and exit 1 instead of dumping the
launcher's own Python traceback on top of the worker's.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ._cli import parse_args
from ._config import export_worker_env, launch_config, shown, worker_command
from ._exits import ExitTimes, failed_at
from ._output import RankOutput

_HIDDEN_TAIL_LINES = 30


@record
def _launch(config: LaunchConfig, executable: str, argv: list[str], output: RankOutput, exits: ExitTimes) -> None:
    try:
        elastic_launch(config, executable)(*argv)
    except ChildFailedError as e:
        _time_failures(e, output, exits)  # before @record copies the root cause's error file
        raise


def _time_failures(error: ChildFailedError, output: RankOutput, exits: ExitTimes) -> None:
    """Each failure's time: when the rank stamped its failure, else when its process ended,
    else now (see :mod:`._exits`; elastic's whole second, rounded down, could put a rank its
    agent stopped before the rank that failed)."""
    exits.close()  # every rank has ended: note the exits the watcher has not yet
    now = time.time()
    for rank, failure in error.failures.items():
        stamp = _stamp(output, rank)
        failure.timestamp = stamp[0] if stamp else exits.ended.get(failure.pid, now)


def _stamp(output: RankOutput, rank: int) -> tuple[float, int] | None:
    """What `rank` stamped as its failure in its latest attempt's log directory."""
    return failed_at(os.path.dirname(output.paths[rank][0])) if rank in output.paths else None


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-_HIDDEN_TAIL_LINES:])
    except OSError:
        return ""


def _exit_code(failure, stamp=None) -> str:
    """How the rank ended; a rank killed while it was leaving with a status it stamped says both."""
    ended = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"code {failure.exitcode}"
    if stamp and stamp[1] != failure.exitcode:
        return f"code {stamp[1]} (and was stopped by {ended} while leaving)"
    return ended


def _failure_summary(error: ChildFailedError, script: str, output: RankOutput, shown) -> str:
    """Elastic's failure report, naming the script; its root cause is the rank that failed
    first, with its exit code, pointing at its output above (or quoting the end of it when
    ``--log-ranks`` hid it); the other failed ranks are listed as stopped after it."""
    error.name = script
    root, _ = error.get_first_failure()
    for rank, failure in error.failures.items():
        if rank != root:
            failure.message = f"stopped after rank {root} failed (rank {rank} exited with {_exit_code(failure)} after it)"
        elif not os.path.isfile(failure.error_file):
            where = f"its output is prefixed [rank{rank}]: above"
            if not shown(rank, failure.local_rank) and rank in output.paths:
                where = f"its output was not shown; the end of its stderr:\n{_tail(output.paths[rank][1])}"
            failure.message = (f"rank {rank} exited with {_exit_code(failure, _stamp(output, rank))}; "
                               f"the other ranks were stopped ({where})")
    return error.format_msg()


def main(argv: Sequence[str] | None = None) -> int:
    """Launch a training script on this node; return the launcher's exit status.

    ``argv`` are the command-line options of ``python -m autopar.launch``
    (``sys.argv[1:]`` when None). Returns 0 when every rank exited 0, 1 when any
    rank failed (all others are stopped; the failure is reported on stderr), or
    128 + signal number when the launcher itself was told to stop. Usage errors
    raise ``SystemExit(2)``; a rendezvous that fails (a node that does not join within
    ``--join_timeout``) is reported on stderr and returns 1. Sets ``OMP_NUM_THREADS`` (if unset) and
    ``AUTOPAR_DEVICES`` (with ``--devices``) in this process's environment.

    Example (shell)::

        $ cat > hello.py <<'EOF'
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.tensor([dist.get_rank()])
        dist.all_reduce(x)
        print(f"rank {dist.get_rank()}/{dist.get_world_size()}: sum={x.item()}")
        dist.destroy_process_group()
        EOF
        $ python -m autopar.launch --nproc_per_node 2 hello.py
        [rank0]: rank 0/2: sum=1
        [rank1]: rank 1/2: sum=1

    The same from Python: ``main(["--nproc_per_node", "2", "hello.py"])`` returns 0.
    """
    args = parse_args(argv)
    export_worker_env(args)
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="autopar_launch_"))
        output, exits = RankOutput(), ExitTimes()
        output.start()
        exits.start()
        try:
            try:
                _launch(launch_config(args, log_dir, output), *worker_command(args), output, exits)
            finally:
                exits.close()
                output.close()
        except ChildFailedError as e:
            print(_failure_summary(e, args.script, output, shown(args)), file=sys.stderr)
            return 1
        except RendezvousError as e:
            print(f"autopar.launch: the rendezvous failed: {e}", file=sys.stderr)
            return 1
        except SignalException as e:
            return 128 + int(e.sigval)
    return 0
