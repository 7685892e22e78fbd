"""`outside_graph`: run a function outside torch.compile's graph (a graph break; eager and compiled run
the same code) without importing torch's compiler when this package is imported.

`torch.compiler.disable` imports torch._dynamo (and with it triton): a second and a half on every
`import engram` and every command, most of which never compile. The wrapper applies it at the
function's first call, which under torch.compile happens while dynamo traces: the disabled function
is made there (dynamo breaks the graph at it) and runs eagerly, as it would decorated at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["outside_graph"]

F = TypeVar("F", bound=Callable[..., Any])


def outside_graph(fn: F) -> F:
    """`torch.compiler.disable(fn)`, applied when `fn` is first called."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]
