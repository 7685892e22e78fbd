"""MkDocs hook: the command-line reference, made from the argument parsers at build time.

docs/reference/cli.md holds a line `<!-- cli-reference -->`; this hook puts in its place every
`engram` command and subcommand, in the order `engram.cli.build_parser()` registers them: a table of
the commands with their one-line summaries, then for each its `--help` text (usage, description,
options). Nothing is written by hand, so the page cannot drift from the parsers; a command added to
`engram.cli` appears on the next build. `cli_markdown()` is what tests/test_docs_site.py checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.cli_reference")

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
WIDTH = 100  # the --help text's width: fixed, so the page does not depend on the terminal that built it
SRC = Path(__file__).resolve().parents[2] / "src"


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(command path, its parser, its one-line summary) of every command under `parser`, depth first, in
    the order they were registered."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        summaries = {a.dest: a.help or "" for a in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:  # an alias of a command already listed
                continue
            seen.add(id(sub))
            yield (*path, name), sub, summaries.get(name, "")
            yield from commands(sub, (*path, name))


def _help(parser: argparse.ArgumentParser) -> str:
    was = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse reads the width from here
    try:
        return parser.format_help().rstrip()
    finally:
        if was is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = was


def _anchor(path: tuple[str, ...]) -> str:
    """`engram-plan-memory` for `engram plan-memory`, `engram-plan--memory` for `engram plan memory`."""
    return "engram-" + "--".join(path)


def cli_markdown() -> str:
    """The generated part of the page: the command table, then each command's `--help`."""
    if str(SRC) not in sys.path:  # this checkout's commands, as mkdocstrings reads this checkout's src/
        sys.path.insert(0, str(SRC))
    from engram.cli import build_parser

    parser = build_parser()
    found = list(commands(parser))
    lines = ["| Command | What it does |", "| --- | --- |"]
    for path, _, summary in found:
        name = " ".join(("engram", *path))
        summary = " ".join(summary.split()).replace("|", "\\|")
        lines.append(f"| [`{name}`](#{_anchor(path)}) | {summary} |")
    lines += ["", "## `engram`", "", "```text", _help(parser), "```", ""]
    for path, sub, _ in found:
        name = " ".join(("engram", *path))
        level = "#" * min(2 + len(path) - 1, 6)
        lines += [f"{level} `{name}` {{#{_anchor(path)}}}", "", "```text", _help(sub), "```", ""]
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        log.warning("%s: the line %s is missing: the command reference has nowhere to go", PAGE, MARKER)
        return markdown
    return markdown.replace(MARKER, cli_markdown(), 1)
