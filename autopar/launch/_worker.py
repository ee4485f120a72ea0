"""What each rank of ``python -m autopar.launch`` runs: the script, then a quick, certain exit.

The script runs as ``__main__`` (``python script.py`` semantics: ``sys.argv``, ``sys.path[0]``).
A failure (an exception, a non-zero status) is time-stamped for the launcher's summary
(see :mod:`._exits`) before anything else.  The rank then waits for the script's non-daemon
threads, runs the atexit handlers (autopar's tears its process groups down), flushes its
streams and leaves through ``os._exit`` with the script's exit status, as torch's
multiprocessing workers do.  The interpreter's own teardown would destroy gloo's objects and
threads in no defined order (now and then aborting a correct job with "terminate called
without an active exception") and takes seconds with torch loaded.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

from ..comm.faults import leaving_with
from ._exits import stamp_failure


def _status(exit: SystemExit) -> int:
    """The process exit status `sys.exit(code)` asks for (a message means 1, as in Python)."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _from_script(tb, script: str):
    """The traceback from the script's first frame on (runpy's frames are noise)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != script:
        first = first.tb_next
    return first or tb


def run(target: str, args: list[str], module: bool) -> int:
    """Run `target` (a script path, or a module name with `module`) as ``__main__`` with
    ``sys.argv[1:] == args``; returns its exit status (an uncaught exception is reported
    through ``sys.excepthook`` and gives 1, or 130 for a KeyboardInterrupt, as a shell shows)."""
    if module:
        sys.argv = [target, *args]
        runner = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        target = os.path.abspath(target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(target)
        runner = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    try:
        runner()
    except SystemExit as e:
        return _status(e)
    except BaseException:
        kind, value, tb = sys.exc_info()
        tb = _from_script(tb, target)
        sys.excepthook(kind, value.with_traceback(tb), tb)
        return 130 if isinstance(value, KeyboardInterrupt) else 1
    return 0


def leave(status: int) -> None:
    """Wait for non-daemon threads (as the interpreter does), run the atexit handlers, flush,
    and end the process with `status`."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        leaving_with(status)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream: nothing more can reach it
                pass
        os._exit(status)


if __name__ == "__main__":
    module = sys.argv[1] == "-m"
    rest = sys.argv[2:] if module else sys.argv[1:]
    status = run(rest[0], rest[1:], module)
    if status:
        stamp_failure(status)  # before leaving: its peers fail only once it has left
    leave(status)
