"""The temporary files a writer stages its output in: `.{name}.tmp-{pid}` beside the file it becomes
(`temporary_path`), removed by the writer when its write fails (`removed_on_failure`) and, when its
process was killed instead, by the next writer of the folder (`clear_dead_temporaries`: those whose
process is gone, `pid_alive`). Knows names and processes, nothing of what the files hold.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["clear_dead_temporaries", "pid_alive", "removed_on_failure", "temporary_path"]

_TMP_RE = re.compile(r"^\..+\.tmp-(\d{1,10})$")  # a pid (not the uuid token of engram.distributed.hf.part)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (signal 0 checks, sends nothing)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # not a pid at all
        return False
    return True


def temporary_path(path: str | os.PathLike[str]) -> Path:
    """Where this process stages `path`: `.{name}.tmp-{pid}` in the same folder (renamed over `path`)."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def removed_on_failure(*paths: Path) -> Iterator[None]:
    """Remove `paths` (files or folders, where they exist) if the block raises, whatever it raises (a
    full disk, Ctrl-C), then let the error go on."""
    try:
        yield
    except BaseException:
        for p in paths:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)
        raise


def clear_dead_temporaries(folder: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """Remove the temporaries `.{name}.tmp-{pid}` (files or folders) in `folder` whose process is gone:
    what a writer killed mid-write (SIGKILL, power loss) left. A live process's are left alone (it may
    still be writing them). Returns [(path, why)]."""
    d = Path(folder)
    try:
        entries = sorted(d.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    removed: list[tuple[Path, str]] = []
    for p in entries:
        m = _TMP_RE.match(p.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append((p, f"left by process {m.group(1)}, which is gone (a write interrupted)"))
    return removed
