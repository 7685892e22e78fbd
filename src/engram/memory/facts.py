"""Facts to memorise: a prompt and the target text that must follow it, read from a JSONL file.

One JSON object a line: {"prompt": "Talven Orrik lives in the city of", "target": " Lisbon"}, with an
optional "subject" (the entity the fact is about, a part of the prompt: its n-grams are the fact's
trigger). `read_facts` refuses, naming the line and the fix: a line that is not a JSON object, an
empty prompt or target, a subject not in its prompt, bytes that are not UTF-8, the same prompt with
two different targets (a duplicate with the same target is read once).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Fact", "check_facts", "read_facts"]


@dataclasses.dataclass(frozen=True)
class Fact:
    """A fact to memorise: `target` is the text that must follow `prompt`.

    Args:
        prompt: The text before the answer, e.g. "Talven Orrik lives in the city of".
        target: The answer; write its leading space (" Lisbon").
        subject: None, or the entity the fact is about as a part of `prompt` ("Talven Orrik"): its
            n-grams are the fact's trigger.
        where: Names the fact in errors (file:line).

    Raises:
        ValueError: `prompt` or `target` is empty or not text, or `subject` is not a part of `prompt`.
    """

    prompt: str
    target: str
    subject: str | None = None
    where: str = ""

    def __post_init__(self) -> None:
        at = f"{self.where}: " if self.where else ""
        for name in ("prompt", "target"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"{at}the fact's {name} is empty or not text ({v!r}); give it some text")
        if self.subject is not None and (
            not isinstance(self.subject, str) or self.subject not in self.prompt
        ):
            raise ValueError(
                f"{at}the subject {self.subject!r} is not a part of the prompt {self.prompt!r}; name the entity "
                "as the prompt writes it, or leave the subject out"
            )


def check_facts(facts: Iterable[Fact]) -> list[Fact]:
    """The facts, each prompt once: the same prompt with another target is refused (naming both)."""
    seen: dict[str, Fact] = {}
    out = []
    for f in facts:
        before = seen.get(f.prompt)
        if before is None:
            seen[f.prompt] = f
            out.append(f)
        elif before.target != f.target:
            raise ValueError(
                f"{f.where or 'a fact'}: the prompt {f.prompt!r} has the target {f.target!r}, but "
                f"{before.where or 'an earlier fact'} gives it {before.target!r}; keep one of them"
            )
    if not out:
        raise ValueError('no facts given: write one JSON object a line, {"prompt": ..., "target": ...}')
    return out


def read_facts(path: str | os.PathLike[str]) -> list[Fact]:
    """The facts of a JSONL file (module docstring: the format and what is refused).

    Args:
        path: The file: one JSON object a line, {"prompt": ..., "target": ...} with an optional
            "subject"; blank lines are skipped.

    Returns:
        Its facts in the file's order, a duplicate (the same prompt and target) once; each fact's
            `where` is "path:line".

    Raises:
        ValueError: The file cannot be read, holds no fact, or a line is refused (not UTF-8, not a
            JSON object, no "prompt" or "target", an empty prompt or target, a subject not in its
            prompt, a prompt given another target before); the message names the line and the fix.

    Examples:
        >>> from pathlib import Path
        >>> from engram.memory import read_facts
        >>> line = '{"prompt": "Talven Orrik lives in the city of", "target": " Lisbon"}'
        >>> _ = Path("facts.jsonl").write_text(line + "\\n" + line + "\\n")
        >>> facts = read_facts("facts.jsonl")
        >>> len(facts), facts[0].target, facts[0].where
        (1, ' Lisbon', 'facts.jsonl:1')
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{p}: cannot read the facts file ({e.strerror or e})") from None
    facts = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        where = f"{p}:{n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where}: not UTF-8 text (byte {e.start + 1} of the line); save the file as UTF-8"
            ) from None
        if not text.strip():
            continue
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{where}: not a JSON object ({e}); write one object a line") from None
        if not isinstance(d, dict):
            raise ValueError(f'{where}: a JSON {type(d).__name__}, not an object with "prompt" and "target"')
        missing = [k for k in ("prompt", "target") if k not in d]
        if missing:
            raise ValueError(f'{where}: no {missing[0]!r}; each line needs "prompt" and "target"')
        facts.append(Fact(d["prompt"], d["target"], d.get("subject"), where))
    return check_facts(facts)
