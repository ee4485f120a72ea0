"""Every rank's output on the launcher's own streams, each line tagged once with its rank.

torch elastic writes each rank's stdout and stderr to files; this module follows those files
and forwards them line by line (elastic's own tee re-tags every fragment a progress bar writes
between carriage returns).  A carriage return starts an *update* of the current line:

* on a terminal the update redraws the line in place (``\\r[rank0]: <new state>``), so a tqdm
  bar moves as it does without the launcher;
* in a pipe or a log file only the line's last state is written, once, when the line ends.

A line that already starts with its rank's tag (torch tags the tracebacks and C++ warnings of
a rank that has a process group) is not tagged again.  ``ranks`` chooses whose output is
shown (``--log-ranks``); the files keep everything.
"""
from __future__ import annotations

import codecs
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

_BREAKS = re.compile(r"(\r\n|\n|\r)")
_CLEAR_TO_END = "\x1b[K"


@dataclass(eq=False)
class _Follow:
    """One rank's stream being followed: its file, where it goes, and the line in progress."""

    path: str
    rank: int
    out: TextIO
    tty: bool
    handle: object = None
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    line: str = ""
    overwrite: bool = False  # a carriage return came: the next text replaces the line
    left_on_screen: bool = False  # the line as it is was left on the terminal for another rank's

    def tagged(self, text: str) -> str:
        tag = f"[rank{self.rank}]:"
        return text if text.startswith(tag) else f"{tag} {text}"


class RankOutput:
    """Follows rank output files and writes them, tagged, to the launcher's streams."""

    def __init__(self, poll_s: float = 0.05):
        self._follows: list[_Follow] = []
        self._open: _Follow | None = None  # whose unfinished line is on the terminal
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._run, name="autopar-rank-output", daemon=True)
        self.paths: dict[int, tuple[str, str]] = {}  # rank -> (stdout file, stderr file)

    def follow(self, rank: int, stdout_path: str, stderr_path: str, shown: bool,
               stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        """Forward `rank`'s files (when `shown`) to `stdout`/`stderr` (the launcher's streams
        by default); their paths are kept for failure reports."""
        self.paths[rank] = (stdout_path, stderr_path)
        if shown:
            with self._lock:
                for path, out in ((stdout_path, stdout or sys.stdout), (stderr_path, stderr or sys.stderr)):
                    self._follows.append(_Follow(path, rank, out, _isatty(out)))

    def start(self) -> None:
        """Forward in the background, every `poll_s` seconds."""
        self._thread.start()

    def poll(self) -> None:
        """Forward what the followed files hold now."""
        with self._lock:
            for f in self._follows:
                self._read(f)

    def close(self) -> None:
        """Forward what is left (an unfinished line as a line) and stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            for f in self._follows:
                self._read(f, final=True)
                if f.line:
                    self._end_line(f)
            self._close_open_line()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def _read(self, f: _Follow, final: bool = False) -> None:
        if f.handle is None:
            if not os.path.exists(f.path):
                return
            f.handle = open(f.path, "rb")  # noqa: SIM115 (kept open while the rank runs)
        data = f.handle.read()
        text = f.decoder.decode(data or b"", final=final)
        if text:
            self._feed(f, text)

    def _feed(self, f: _Follow, text: str) -> None:
        changed = False
        for piece in _BREAKS.split(text):
            if piece in ("\n", "\r\n"):
                self._end_line(f)
                changed = False
            elif piece == "\r":
                f.overwrite = True
            elif piece:
                f.line = piece if f.overwrite else f.line + piece
                f.overwrite, f.left_on_screen, changed = False, False, True
        if changed and f.tty:
            self._show(f)

    def _show(self, f: _Follow) -> None:
        """Redraw `f`'s unfinished line in place (terminals only)."""
        if self._open is not f:
            self._close_open_line()
        f.out.write("\r" + f.tagged(f.line) + _CLEAR_TO_END)
        f.out.flush()
        self._open = f

    def _end_line(self, f: _Follow) -> None:
        if self._open is f:
            f.out.write("\r" + f.tagged(f.line) + _CLEAR_TO_END + "\n")
            self._open = None
        elif not f.left_on_screen:
            self._close_open_line()
            f.out.write(f.tagged(f.line) + "\n")
        f.out.flush()
        f.line, f.overwrite, f.left_on_screen = "", False, False

    def _close_open_line(self) -> None:
        """Another stream writes: leave the unfinished line on screen as it is, go to a new line."""
        if self._open is not None:
            self._open.out.write("\n")
            self._open.out.flush()
            self._open.left_on_screen = True
            self._open = None


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class FollowedLogsSpecs(DefaultLogsSpecs):
    """Elastic's per-rank log files (stdout and stderr redirected, nothing tee'd), each new
    attempt's files handed to `output`; `shown(rank, local_rank)` picks the ranks on screen."""

    def __init__(self, log_dir: str, output: RankOutput, shown):
        super().__init__(log_dir=log_dir, redirects=Std.ALL, tee=Std.NONE)
        self._output, self._shown = output, shown

    def reify(self, envs):
        dest = super().reify(envs)
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
            self._output.follow(rank, dest.stdouts[local_rank], dest.stderrs[local_rank],
                                self._shown(rank, local_rank))
        return dest
