"""The public API's docstrings parse as Google style, the way mkdocstrings renders them (issue 48).

The public API is every name in the `__all__` of `engram`, `engram.hf`, `engram.systems`,
`engram.distributed` and `engram.vllm`, and every public method and property that an exported class
defines in our code (not those it inherits from torch or the standard library). For each: a
docstring exists and opens with a one-line summary; griffe (mkdocstrings' parser, with its default
options) parses it as Google style without a warning; every parameter of the signature is in its
`Args:` (a class's in the class docstring), an enum's members and a NamedTuple's fields are in its
`Attributes:`, a function that returns something has `Returns:` (or `Yields:`), and every exception
the function raises by name in its own body is in `Raises:`. Every `>>>` example runs (doctest).
"""

from __future__ import annotations

import ast
import doctest
import enum
import importlib
import inspect
import io
import logging
import textwrap
from pathlib import Path

import pytest
import torch

griffe = pytest.importorskip("griffe")  # mkdocstrings' parser: the docs extra
pytest.importorskip("transformers")  # engram.hf, whose API is checked here

import engram  # noqa: E402

PACKAGES = ("engram", "engram.hf", "engram.systems", "engram.distributed", "engram.vllm", "engram.memory")
SRC = Path(engram.__file__).resolve().parent.parent
PARAMETERS = griffe.DocstringSectionKind.parameters
ATTRIBUTES = griffe.DocstringSectionKind.attributes
RETURNS = (griffe.DocstringSectionKind.returns, griffe.DocstringSectionKind.yields)
RAISES = griffe.DocstringSectionKind.raises
HOOKS = {"extra_repr"}  # torch's repr hook: nn.Module calls it, nobody else


def _ours(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "engram"


def _members(obj: object) -> list[str]:
    """An enum's members or a NamedTuple's fields: what its docstring's `Attributes:` lists."""
    if isinstance(obj, enum.EnumMeta):
        return [m.name for m in obj]
    return list(getattr(obj, "_fields", ()))


def _public_api() -> dict[str, tuple[str, str]]:
    """Test id -> (griffe path of the object, kind), over the packages' `__all__` and their classes."""
    api: dict[str, tuple[str, str]] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                path = f"{obj.__module__}.{obj.__qualname__}"
                api[f"{package}.{name}"] = (path, "class" if inspect.isclass(obj) else "function")
                wrapper = getattr(getattr(obj, "__code__", None), "co_filename", "")
                if hasattr(obj, "__wrapped__") and Path(wrapper).is_relative_to(SRC):
                    # functools.wraps in our code: the wrapper, as the source shows it to griffe, too
                    api[f"{package}.{name} (wrapper)"] = (f"{package}.{name}", "function")
            else:  # a constant: its docstring is the string under its assignment
                api[f"{package}.{name}"] = (f"{package}.{name}", "attribute")
            if not inspect.isclass(obj):
                continue
            seen: set[str] = set()
            for klass in obj.__mro__:
                if not _ours(klass):
                    continue
                for attr, value in vars(klass).items():
                    if (attr.startswith("_") and attr != "__call__") or attr in seen or attr in HOOKS:
                        continue
                    seen.add(attr)
                    if isinstance(value, staticmethod | classmethod):
                        value = value.__func__
                    if isinstance(value, property):
                        kind = "property"
                    elif inspect.isfunction(value):
                        kind = "method"
                    else:  # enum members, class constants, dataclass field defaults
                        continue
                    if isinstance(obj, enum.EnumMeta) and klass is not obj:
                        continue  # an enum's inherited helpers are documented on their own class
                    api.setdefault(
                        f"{klass.__module__}.{klass.__qualname__}.{attr}",
                        (f"{klass.__module__}.{klass.__qualname__}.{attr}", kind),
                    )
    return api


API = _public_api()


@pytest.fixture(scope="module")
def tree():
    """The engram package as griffe loads it from the source mkdocstrings reads (no import)."""
    return griffe.load("engram", search_paths=[str(SRC)], docstring_parser="google", allow_inspection=False)


def _lookup(tree, path: str):
    obj = tree[path.removeprefix("engram.")] if path != "engram" else tree
    return obj.final_target if obj.is_alias else obj


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _parse(obj) -> tuple[list, list[str]]:
    """griffe's Google-style sections of obj's docstring and what it logged while parsing them."""
    handler = _Warnings()
    logger = logging.getLogger("griffe")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # "Possible section skipped" (a missing blank line) is a debug message
    try:
        sections = griffe.parse_google(obj.docstring)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    # only the docstring's own messages ("path:line: ..."), not griffe resolving torch base classes
    prefix = f"{obj.relative_filepath}:"
    return sections, [m for m in handler.messages if m.startswith(prefix)]


def _always_raises(function) -> bool:
    """Whether a function only raises (an interface method, a refusal): no `return value`, ends in raise."""
    tree = ast.parse(textwrap.dedent(function.source)).body[0]
    returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(tree))
    return not returns and isinstance(tree.body[-1], ast.Raise)


def _raised(function) -> set[str]:
    """The exception classes a function raises by name in its own body (not in nested functions)."""
    source = textwrap.dedent(function.source)
    names: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        if not top and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            return
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id[:1].isupper():
                names.add(exc.id)
        for child in ast.iter_child_nodes(node):
            visit(child, False)

    for node in ast.parse(source).body:
        visit(node, True)
    return names


@pytest.mark.parametrize("name", sorted(API))
def test_docstring(tree, name: str) -> None:
    path, kind = API[name]
    obj = _lookup(tree, path)
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{name} ({path}) has no docstring"
    lines = obj.docstring.value.strip().splitlines()
    assert len(lines) == 1 or not lines[1].strip(), (
        f"{name}: the docstring must open with a one-line summary and a blank line, not {lines[:2]}"
    )

    sections, messages = _parse(obj)
    assert not messages, f"griffe on {name} ({obj.relative_filepath}:{obj.docstring.lineno}): {messages}"

    documented = {p.name for s in sections if s.kind is PARAMETERS for p in s.value}
    if kind in ("class", "function", "method"):
        signature = obj.parameters if kind != "class" or "__init__" in obj.all_members else []
        wanted = [
            ("*" + p.name if p.kind.value == "variadic positional" else "**" + p.name)
            if p.kind.value in ("variadic positional", "variadic keyword")
            else p.name
            for p in signature
            if p.name not in ("self", "cls")
        ]
        if kind == "class" and "__init__" in obj.members and obj.members["__init__"].docstring:
            init_sections, _ = _parse(obj.members["__init__"])
            documented |= {p.name for s in init_sections if s.kind is PARAMETERS for p in s.value}
        missing = [p for p in wanted if p not in documented]
        assert not missing, f"{name}: Args: does not document {missing}"

    if kind == "class":
        module, _, qualname = path.rpartition(".")
        members = _members(getattr(importlib.import_module(module), qualname))
        listed = {a.name for s in sections if s.kind is ATTRIBUTES for a in s.value}
        missing = [m for m in members if m not in listed]
        assert not missing, f"{name}: Attributes: does not document {missing}"

    if kind in ("function", "method"):
        returns = obj.returns
        gives = returns is not None and str(returns) not in ("None", "NoReturn", "Never", "Self")
        has_returns = any(s.kind in RETURNS for s in sections)
        if gives and obj.name != "__init__" and not _always_raises(obj):
            assert has_returns, f"{name} returns {returns} but has no Returns: section"
        if str(returns) == "None":
            assert not has_returns, f"{name} returns None but has a Returns: section"
        for section in sections:  # one item, unnamed: a "word: ..." line would read as a named value
            if section.kind in RETURNS:
                assert [r.name for r in section.value] == [""], (
                    f"{name}: Returns:/Yields: must be one unnamed item (indent continuation lines), "
                    f"got {[(r.name, r.description[:40]) for r in section.value]}"
                )
        raised = _raised(obj)
        listed = {str(r.annotation).split(".")[-1] for s in sections if s.kind is RAISES for r in s.value}
        assert raised <= listed, f"{name} raises {sorted(raised - listed)} without saying so in Raises:"


def test_examples_run(tree, tmp_path, monkeypatch) -> None:
    """Every `>>>` example in those docstrings runs and prints what it shows (doctest).

    In a scratch folder (an example may write a file there), on a fork of torch's generator (the
    examples draw random tables; the tests after them see the generator as it was).
    """
    monkeypatch.chdir(tmp_path)
    parser, failures, ran = doctest.DocTestParser(), [], 0
    for name, (path, _) in sorted(API.items()):
        obj = _lookup(tree, path)
        if obj.docstring is None or ">>>" not in obj.docstring.value:
            continue
        test = parser.get_doctest(obj.docstring.value, {}, name, str(obj.filepath), obj.docstring.lineno)
        out = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        with torch.random.fork_rng(devices=[]):
            result = runner.run(test, out=out.write)
        ran += 1
        if result.failed:
            failures.append(out.getvalue())
    assert not failures, "\n".join(failures)
    assert ran > 0
