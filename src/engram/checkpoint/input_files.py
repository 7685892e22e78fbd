"""The files and folders a command reads as its input (a config, a text, a corpus, a profile, a
checkpoint folder), each checked with one `os.stat` before anything opens it.

Opening a FIFO blocks until a writer comes (for good, if none does), and a device or socket is no
input file either: `input_file` accepts a regular file only (after symlinks), `input_folder` a
folder only, `input_file_or_folder` either; `read_text_file` reads a checked file as UTF-8. Every
refusal is a FileNotFoundError or ValueError naming the path, what it is, and the fix. The files
inside a checkpoint have their own, stricter rule (`engram.checkpoint.files.member_file`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["input_file", "input_file_or_folder", "input_folder", "path_kind", "read_text_file"]

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def path_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is, in words ("a file", "a folder", "a named pipe (FIFO)", ...; symlinks followed),
    or None when nothing is there. Only `os.stat` touches it: nothing is opened."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file on the way: nothing under it)
        return None
    except (OSError, ValueError) as e:  # a link loop, a name too long, a NUL byte, a folder we may not search
        return f"a path that cannot be looked at ({getattr(e, 'strerror', None) or e})"
    return next((what for test, what in _KINDS if test(mode)), "neither a file nor a folder")


def _checked(path: str | os.PathLike[str], allowed: tuple[str, ...], what: str) -> Path:
    kind = path_kind(path)
    if kind is None:
        raise FileNotFoundError(f"{path}: no such file or folder; check the path (give {what})")
    if kind not in allowed:
        why = " (reading one waits for a writer, for good if none comes)" if "FIFO" in kind else ""
        raise ValueError(f"{path} is {kind}{why}; give {what}")
    return Path(path)


def input_file(path: str | os.PathLike[str], what: str = "a regular file") -> Path:
    """`path` as a Path if it is a regular file (symlinks followed); else FileNotFoundError (nothing
    there) or ValueError (a folder, a FIFO, a device, a socket), naming the path and `what` is wanted."""
    return _checked(path, ("a file",), what)


def input_folder(path: str | os.PathLike[str], what: str = "a folder") -> Path:
    """`path` as a Path if it is a folder; else FileNotFoundError or ValueError naming it."""
    return _checked(path, ("a folder",), what)


def input_file_or_folder(path: str | os.PathLike[str], what: str = "a file or a folder") -> Path:
    """`path` as a Path if it is a regular file or a folder; else FileNotFoundError or ValueError."""
    return _checked(path, ("a file", "a folder"), what)


def read_text_file(path: str | os.PathLike[str], what: str = "a text file") -> str:
    """The UTF-8 text of regular file `path` (checked by `input_file` first); bytes that are not
    UTF-8 are a ValueError naming the file and the first bad byte's offset."""
    try:
        return input_file(path, what).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}); give {what} in UTF-8") from None
