"""The `engram` command line: every command is registered here, in this package.

`main(argv)` parses and runs one command; `build_parser()` registers them all. Each module of the
package adds its commands (`register(subparsers)`) and calls plain library functions:
`addressing` (layout, compress, hash, collisions), `checkpoint` (convert, run-layer), `train`
(demo, train, eval), `generate`, `bench`, `systems` (cache-sim); `options` holds what they share.
Library modules hold no argparse. A command's ValueError, TypeError or missing file reaches the
user as one line, `engram CMD: error: ...`, exit status 2, never as a traceback; a table a loader did
not scan (`UnscannedTableWarning`) as one line `engram CMD: note: ...`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from engram.checkpoint.integrity import UnscannedTableWarning
from engram.cli import addressing, bench, checkpoint, generate, systems
from engram.cli.train import add_training_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram", description="Engram: conditional memory for language models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    addressing.register(sub)
    checkpoint.register(sub)
    add_training_commands(sub)
    generate.register(sub)
    bench.register(sub)
    systems.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    show = warnings.showwarning

    def note(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, UnscannedTableWarning):
            print(f"engram {args.command}: note: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **kw)

    try:
        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.simplefilter("always", UnscannedTableWarning)
            warnings.showwarning = note
            return int(args.func(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"engram {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `engram ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0
