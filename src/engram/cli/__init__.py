"""The `engram` command line: every command is registered here, in this package.

`main(argv)` parses and runs one command; `build_parser()` registers them all. Each module of the
package adds its commands (`register(subparsers)`) and calls plain library functions:
`addressing` (layout, compress, hash, collisions), `checkpoint` (convert, run-layer), `train`
(demo, train, eval), `generate`, `bench`, `systems` (profile, cache-sim, plan memory / plan-memory,
plan train: `plan_train`), `study`, `serve`, `gguf` (hf-from-gguf), `hf` (hf-train, hf-eval),
`quantise` (quantise-check), `memory` (memorize, train-reader, patch info / check); `options` holds what they share.
Library modules hold no argparse. A command's ValueError, OSError (a path refused), TypeError of our
own argument checks, a JSON file too deep to parse or an allocation that fails reaches the user as one
line, `engram CMD: error: ...`, exit status 2, never as a traceback; other errors (bugs: a TypeError the
interpreter raised inside our code, a RuntimeError) keep their traceback, with a note asking for a
report. A table a loader did not scan (`UnscannedTableWarning`), or memory patches that share rows
(`PatchOverlapWarning`), is one line `engram CMD: note: ...`; an Engram part on another base model than
it was trained on (`BaseModelWarning`) one line `engram CMD: warning: ...`. Ctrl-C (SIGINT) and
SIGTERM stop a command with one line, `engram CMD: stopped by ...` (for a run that resumes: what is kept
and the command line that continues it), exit status 130 (`INTERRUPTED`): `main` raises `Stopped` from a
SIGTERM handler it installs for the command's duration, then restores the handler there was.
"""

from __future__ import annotations

import argparse
import dis
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import engram
from engram.cli import addressing, bench, checkpoint, generate, gguf, memory, quantise, serve, study, systems
from engram.cli.hf import register as register_hf
from engram.cli.stopping import Stopped, sigterm_stops
from engram.cli.train import add_training_commands
from engram.storage.integrity import UnscannedTableWarning

__all__ = ["INTERRUPTED", "Stopped", "build_parser", "main"]

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C or SIGTERM (the shells' 128 + SIGINT)


def _stopped_line(args: argparse.Namespace, argv: Sequence[str], e: KeyboardInterrupt) -> str:
    """The line a stopped command prints: what stopped it and, for a run that resumes (`--resume` and
    `--out`), what is kept and the command line that continues it."""
    line = f"engram {args.command}: stopped by {'SIGTERM' if isinstance(e, Stopped) else 'Ctrl-C'}"
    out = getattr(args, "out", None)
    if not hasattr(args, "resume") or out is None:
        return line
    again = [a for a in argv if a not in ("--resume", "--resume-if-possible")]
    if args.command == "train":
        from engram.apps.lm.run_checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(out) if os.path.isdir(out) else None
        if ckpt is None:
            return f"{line}; no checkpoint was written yet in {out}: start it again"
        return (
            f"{line}; the last checkpoint in {out} ({ckpt.name}) is intact: continue with "
            f"`{shlex.join(['engram', *again, '--resume'])}`"
        )
    return (
        f"{line}; what it saved for {out} is kept: continue with "
        f"`{shlex.join(['engram', *again, '--resume-if-possible'])}` (from its last checkpoint, if it "
        "wrote one)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram", description="Engram: conditional memory for language models."
    )
    parser.add_argument("--version", action="version", version=f"engram {engram.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    addressing.register(sub)
    checkpoint.register(sub)
    add_training_commands(sub)
    generate.register(sub)
    bench.register(sub)
    systems.register(sub)
    study.register(sub)
    serve.register(sub)
    register_hf(sub)
    gguf.register(sub)
    quantise.register(sub)
    memory.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    show = warnings.showwarning

    def note(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
        base = sys.modules.get("engram.hf.base")  # imported by whatever warned of another base model
        io = sys.modules.get("engram.hf.io")  # imported by whatever read an older HF folder
        patches = sys.modules.get("engram.memory.apply")  # imported by whatever applied a memory patch
        if (
            issubclass(category, UnscannedTableWarning)
            or (io is not None and issubclass(category, io.OlderFolderWarning))
            or (patches is not None and issubclass(category, patches.PatchOverlapWarning))
        ):
            print(f"engram {args.command}: note: {message}", file=sys.stderr)
        elif base is not None and issubclass(category, base.BaseModelWarning):
            print(f"engram {args.command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **kw)

    try:
        with warnings.catch_warnings(), sigterm_stops():  # restore showwarning and SIGTERM afterwards
            warnings.simplefilter("always", UnscannedTableWarning)
            warnings.showwarning = note
            return int(args.func(args))
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (Stopped): the `finally`s ran on the way out
        print(_stopped_line(args, argv, e), file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:  # `engram ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except Exception as e:
        message = _refusal(e)
        if message is None:  # not a refusal of the input: a bug, shown with its traceback
            e.add_note(
                f"engram {args.command}: internal error (a bug in engram, not in your input); please "
                "report it with the command line and this traceback"
            )
            raise
        print(f"engram {args.command}: error: {message}", file=sys.stderr)
        return 2


# What the system's refusals of a path mean for the person who gave it.
_OS_FIXES: dict[type[OSError], str] = {
    FileNotFoundError: "no such file or folder; check the path",
    IsADirectoryError: "a folder where a file is expected; give a file",
    NotADirectoryError: "a file where a folder is expected; give a folder",
    FileExistsError: "a file is in the way; give another path",
    PermissionError: "permission denied; give a path you may use (or fix its permissions)",
}


def _refusal(e: BaseException) -> str | None:
    """The one line a command's exception becomes; None: not a refusal of its input (a bug: re-raise).

    A ValueError / OSError of our own already names the value and the fix; so does a TypeError that one
    of engram's checks raised (`_raised_by_engram`), while one the interpreter or a library raised
    inside our code (an operand of the wrong type, a call with a wrong argument) is a bug. The system's
    OSErrors name the path; RecursionError is a JSON file nested too deep for Python's parser;
    MemoryError and torch's allocation failures are a size asked for that does not fit.
    """
    if isinstance(e, OSError) and e.filename is not None:
        fix = next((f for t, f in _OS_FIXES.items() if isinstance(e, t)), e.strerror or str(e))
        return f"{e.filename}: {fix}"
    if isinstance(e, RecursionError):  # a RuntimeError too: before the check below
        return "input nested too deeply to read (a damaged JSON file?); check the files given"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "allocate" in str(e)):
        return f"out of memory ({type(e).__name__}): a size asked for does not fit; ask for less"
    if isinstance(e, ValueError | OSError) or (isinstance(e, TypeError) and _raised_by_engram(e)):
        return str(e)
    return None  # a RuntimeError, an interpreter's TypeError, a KeyError, ...: a bug


_RAISE = dis.opmap["RAISE_VARARGS"]


def _raised_by_engram(e: BaseException) -> bool:
    """Whether `e` comes from a `raise` statement in an engram module: an argument check, whose message
    was written for the user. The frame it started in is the traceback's innermost one; its current
    instruction is RAISE_VARARGS for a `raise` statement and another one (BINARY_OP, CALL,
    BINARY_SUBSCR, ...) where the interpreter or a library raised it."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    if module != "engram" and not module.startswith("engram."):
        return False
    code = tb.tb_frame.f_code.co_code
    return 0 <= tb.tb_lasti < len(code) and code[tb.tb_lasti] == _RAISE
