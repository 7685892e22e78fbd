"""One writer a folder: `write_lock(folder, command)` holds an exclusive lock for as long as a command
writes `folder`, and refuses a second writer in one line naming the process that holds it (its pid and
command). The lock is `flock` on a small file beside the folder, `.{name}.engram-lock` (beside, not
inside: it works for a folder that does not exist yet or is replaced by a rename at the end, and never
makes an output folder non-empty); the kernel releases it when the process ends however it ends, so a
killed run never blocks the next. The file records the holder (`{"pid", "command"}`) and is removed
when the lock is released; one a killed process left is taken over by the next writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_SUFFIX", "lock_path", "write_lock"]

LOCK_SUFFIX = ".engram-lock"
_TRIES = 20  # a lock file removed by its releasing holder between our open and our lock: open again


def lock_path(folder: str | os.PathLike[str]) -> Path:
    """The lock file of `folder`: `.{name}.engram-lock` in its parent folder."""
    f = Path(os.path.abspath(folder))
    return f.parent / f".{f.name}{LOCK_SUFFIX}"


def _holder(fd: int) -> str:
    """'process PID (COMMAND)' of what the lock file records, or 'another process' (not recorded yet)."""
    try:
        record = json.loads(os.pread(fd, 65536, 0).decode())
        return f"process {int(record['pid'])} ({record['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _acquire(path: Path, folder: str | os.PathLike[str], command: str) -> int:
    """An open descriptor of `path` holding its exclusive lock, the holder recorded in it."""
    for _ in range(_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(
                f"{folder} is being written by {holder}; one command writes a folder at a time: wait for "
                f"it to end (or stop it), or give another folder (lock: {path})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # still the file at `path`? (a holder that released it removed it: ours is then stale)
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            record = json.dumps({"pid": os.getpid(), "command": command}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            return fd
        os.close(fd)
    raise RuntimeError(f"{path}: the lock file kept changing under {_TRIES} tries")  # an invariant


@contextlib.contextmanager
def write_lock(folder: str | os.PathLike[str], command: str) -> Iterator[Path]:
    """Hold `folder`'s write lock for the block (`command`, e.g. "engram train --out RUN", is recorded
    for a refused writer to read). ValueError naming the holder's pid and command when another process
    holds it. Yields the lock file's path. Not re-entrant: a process takes a folder's lock once."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, folder, command)
    try:
        yield path
    finally:
        try:  # removed first, then unlocked: a writer that opened it meanwhile sees it is stale
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)
