"""The `engram` command line: every command is registered here, in this package."""

from engram.cli.commands import main

__all__ = ["main"]
