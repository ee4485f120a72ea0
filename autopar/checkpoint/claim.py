"""Which names next to a checkpoint path belong to a save still running, so that concurrent
saves of one path (a second job, a relaunch while the old job still writes) never remove each
other's work.

A save of `<dir>/<name>` with token T owns, in `<dir>`:

    .<name>.lock-T   its lock file, created by rank 0 before anything else and flock-ed until
                     the save ends; it holds {"token", "host", "pid", "started"}, and every
                     other rank reads it to prove it sees rank 0's directory
    .<name>.tmp-T    the checkpoint being written (after an exchange, the one it replaced)
    .<name>.old-T    the replaced checkpoint, between the two renames where there is no exchange

and, while it swaps, `.<name>.swap-lock` (one swap at a time per path: without an atomic
exchange a swap is two renames, and two interleaved swaps would lose a checkpoint).

A leftover - the names of another token - is removed only when its save is provably over:
its lock file can be flock-ed and says it was written on this host (between the processes of
one host flock is exact, and the kernel drops the lock of a process that dies).  Where the lock
was written on another host, or a directory has no lock file (an older autopar wrote it), a
free lock proves nothing - flock may be node-local on a shared filesystem - so the leftover
must also be older than STALE_S.  On a filesystem without flock nothing is ever removed.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import time

try:
    import fcntl
except ImportError:  # no flock: saves still work, leftovers stay
    fcntl = None

STALE_S = 6 * 3600  # far longer than a save runs


def names(parent: str, base: str, token: str) -> tuple[str, str, str]:
    """(lock file, temporary directory, old directory) of the save `token` of `parent/base`."""
    stem = os.path.join(parent, f".{base}.")
    return stem + f"lock-{token}", stem + f"tmp-{token}", stem + f"old-{token}"


def _flock(fd: int, wait: bool) -> bool:
    """Take an exclusive flock on `fd`; False when another holds it or flock is unsupported."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


class Claim:
    """Rank 0's hold on the names of one save: its lock file (held until `release`) and its
    temporary directory, created in that order so no moment shows the directory unclaimed."""

    def __init__(self, parent: str, base: str, token: str):
        self.lock, self.tmp, self.old = names(parent, base, token)
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _flock(self.fd, wait=True)  # a leftover removal may look at it this very moment
            owner = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
            os.write(self.fd, json.dumps(owner).encode())
            os.fsync(self.fd)
            os.mkdir(self.tmp)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """The save failed: remove its temporary directory, then its lock file.  An old
        directory (a failed swap could not put the old checkpoint back) is kept, and with it
        the lock file, for load_state_dict to fall back to."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if not os.path.exists(self.old):
            self.finish()
        self.release()

    def finish(self) -> None:
        """The save is over and its directories are gone: remove the lock file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock)
        self.release()

    def release(self) -> None:
        """Drop the lock (also what the process's death does)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def unseen(parent: str, base: str, token: str) -> str | None:
    """Why this rank does not see the lock file and temporary directory rank 0 just created
    (so the path is not on a filesystem all ranks share), or None when it does."""
    lock, tmp, _ = names(parent, base, token)
    try:
        with open(lock, encoding="utf-8") as f:
            seen = json.load(f).get("token")
    except FileNotFoundError:
        seen = None
    except (OSError, ValueError, AttributeError) as e:
        seen = f"{type(e).__name__}: {e}"
    if seen == token and os.path.isdir(tmp):
        return None
    detail = "" if seen is None else f" (its lock file holds {seen!r})"
    return (f"cannot see {lock} and {tmp}, which rank 0 created for this save{detail}: "
            f"{os.path.join(parent, base)} must be on a filesystem shared by all ranks, since every rank "
            f"writes its own pieces into it")


@contextlib.contextmanager
def swap_lock(parent: str, base: str):
    """Hold `.<base>.swap-lock` while swapping; the file is removed on the way out, so a waiter
    that then gets the lock of the removed file retries on a fresh one."""
    path = os.path.join(parent, f".{base}.swap-lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _flock(fd, wait=True)
        try:
            current = not locked or os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def remove_leftovers(parent: str, base: str, own: str) -> None:
    """Remove the names of every save of `parent/base` other than `own` that is provably over."""
    stem = os.path.join(parent, f".{base}.")
    tokens = set()
    for kind in ("tmp", "old", "lock"):
        prefix = stem + kind + "-"
        tokens.update(p[len(prefix):] for p in glob.glob(glob.escape(prefix) + "*"))
    for token in tokens - {own}:
        _remove_if_over(*names(parent, base, token))


def _remove_if_over(lock: str, tmp: str, old: str) -> None:
    dirs = [d for d in (tmp, old) if os.path.lexists(d)]
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # written by an autopar without lock files, or its lock removed by hand
        if all(_age(d) > STALE_S for d in dirs):
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        return
    except OSError:
        return
    try:
        if not _flock(fd, wait=False):
            return  # the save is running (or flock is unsupported: it may be)
        try:
            host = json.loads(os.pread(fd, 4096, 0)).get("host")
        except (ValueError, AttributeError):
            host = None  # its save is still writing it (or died doing so)
        if host != socket.gethostname() and _age(lock) <= STALE_S:
            return
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
    finally:
        os.close(fd)


def _age(path: str) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0
