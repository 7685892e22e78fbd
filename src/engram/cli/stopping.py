"""How a command is stopped: SIGTERM raises `Stopped` (a KeyboardInterrupt) in the main thread, so it
unwinds as Ctrl-C does. Its own module so that commands (engram serve) can tell the two apart."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Stopped", "sigterm_stops"]


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised in the main thread while a command runs: unwinds as Ctrl-C does (every `finally`
    that removes a temporary runs), and ends in the same one line."""


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM raises `Stopped` while inside (only the main thread may set a handler: elsewhere nothing
    changes); the handler there was is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stopped()

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
