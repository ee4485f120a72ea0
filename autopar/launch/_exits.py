"""When each rank failed, to the millisecond, so that the failure summary names the first.

Elastic stamps a failure with the whole second its agent noticed it (its poll, every 0.1 s),
and ties go to the lowest rank: on 4 ranks the victims of a failure (ranks stopped by the
agent, or failing in a collective with the dead rank) were often named as its cause. Two
clocks replace that stamp:

* the rank's own: the launcher's worker writes the time the script failed (an exception or a
  non-zero exit status), and that status, into ``failed_at`` beside its error file, before it starts leaving
  (a rank that leaves slowly is still first: its peers fail only because it left);
* the launcher's: :class:`ExitTimes` watches the launcher's child processes (the ranks) and
  notes when each one ended (``os._exit``, a signal, the OOM killer: nothing the rank wrote).
"""
from __future__ import annotations

import glob
import os
import select
import threading
import time

FAILED_AT = "failed_at"


def stamp_failure(status: int) -> None:
    """In a rank: record now as the time this rank failed with `status` (next to elastic's
    error file)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(os.path.join(os.path.dirname(error_file), FAILED_AT), "w") as f:
                f.write(f"{time.time()!r} {status}")
        except OSError:  # the log directory is gone: the launcher's clock still counts
            pass


def failed_at(rank_log_dir: str) -> tuple[float, int] | None:
    """``(time, status)`` a rank whose logs are in `rank_log_dir` stamped as its failure, if it did."""
    try:
        with open(os.path.join(rank_log_dir, FAILED_AT)) as f:
            when, status = f.read().split()
            return float(when), int(status)
    except (OSError, ValueError):
        return None


class ExitTimes:
    """Notes when each child process of this process ends (Linux: pidfds; elsewhere nothing).

    Children are found in ``/proc/<pid>/task/*/children`` every `poll_s` seconds; an exit
    wakes the watcher at once (a pidfd turns readable when its process ends, before it is
    reaped), so ``ended[pid]`` is the time of the exit to within a few milliseconds. Exits
    the watcher had not noted yet when it is closed are noted then: late, never early."""

    def __init__(self, poll_s: float = 0.02):
        self.ended: dict[int, float] = {}  # pid -> when it ended
        self._fds: dict[int, int] = {}  # pidfd -> pid, of the children still running
        self._poll_s = poll_s
        self._poller = select.poll() if hasattr(os, "pidfd_open") else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autopar-exit-times", daemon=True)

    def start(self) -> None:
        if self._poller is not None:
            self._thread.start()

    def close(self) -> None:
        """Stop watching (idempotent), noting the exits not noted yet."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._fds:
            self._note(0)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, fd in self._find_children():
                self._fds[fd] = pid
                self._poller.register(fd, select.POLLIN)
            self._note(self._poll_s)

    def _note(self, timeout_s: float) -> None:
        ready = self._poller.poll(timeout_s * 1000)
        now = time.time()
        for fd, _ in ready:
            self.ended[self._fds.pop(fd)] = now
            self._poller.unregister(fd)
            os.close(fd)

    def _find_children(self) -> list[tuple[int, int]]:
        """``(pid, pidfd)`` of the children not watched yet."""
        watched = set(self._fds.values())
        found = []
        for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            try:
                with open(path) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                continue
            for pid in pids:
                if pid not in watched and pid not in self.ended:
                    try:
                        found.append((pid, os.pidfd_open(pid)))
                        watched.add(pid)
                    except OSError:  # already reaped
                        pass
        return found
