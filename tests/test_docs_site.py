"""The documentation site (mkdocs.yml, docs/hooks/): the command reference lists every registered
command; links that leave docs/ are checked and shown as paths; and, where the docs extra is installed,
`mkdocs build --strict` passes and the API reference shows every name the packages export."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from engram.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "docs" / "hooks"
# The packages whose `__all__` the reference documents, and their pages.
REFERENCE = {
    "engram": "engram",
    "engram.hf": "hf",
    "engram.systems": "systems",
    "engram.distributed": "distributed",
    "engram.vllm": "vllm",
    "engram.memory": "memory",
}


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _registered(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*path, name))
                out += _registered(sub, (*path, name))
    return out


def test_the_cli_reference_shows_every_registered_command():
    page = _hook("cli_reference").cli_markdown()
    commands = _registered(build_parser())
    assert len(commands) > 20
    for path in commands:
        name = " ".join(("engram", *path))
        assert re.search(rf"^#+ `{re.escape(name)}` \{{#", page, re.M), f"no section for {name}"
        assert f"usage: {name} [-h]" in page, f"no --help text for {name}"
    assert "--tokens-per-s TOKENS_PER_S" in page  # the options are there, as --help prints them
    anchors = re.findall(r"\{#([^}]+)\}", page)
    assert len(anchors) == len(set(anchors)) == len(commands)


@pytest.fixture
def hook(caplog) -> ModuleType:
    """docs/hooks/repo_files.py, configured for this repository (BENCHMARKS.md shown by benchmarks.md)."""
    hook = _hook("repo_files")
    hook.on_config({"docs_dir": str(ROOT / "docs"), "repo_url": None})
    hook._state["shown"] = {"BENCHMARKS.md": "benchmarks.md"}
    caplog.set_level(logging.WARNING, logger="mkdocs.hooks.repo_files")
    return hook


@pytest.fixture
def repo_files(hook):
    def render(markdown: str, src: str = "guides/page.md") -> str:
        page = SimpleNamespace(file=SimpleNamespace(src_uri=src))
        return hook.on_page_markdown(markdown, page=page, config=None, files=None)

    return render


def test_links_out_of_docs_become_paths_once_checked(repo_files, caplog):
    md = (
        "[the config](../../src/engram/config.py), [`src/engram/cli`](../../src/engram/cli/), "
        "[records](../../BENCHMARKS.md#x), [design](../memory.md), [set-up](../../README.md#set-up)\n"
        "`[code](../../nope.py)`\n\n```text\n[block](../../nope.py)\n```\n"
    )
    out = repo_files(md)
    assert out.splitlines()[0] == (
        "the config (`src/engram/config.py`), `src/engram/cli`, [records](../benchmarks.md#x), "
        "[design](../memory.md), set-up (`README.md`)"
    )
    assert "`[code](../../nope.py)`" in out and "[block](../../nope.py)" in out  # code is left alone
    assert not caplog.records


@pytest.mark.parametrize(
    ("link", "needle"),
    [
        ("../../src/engram/nope.py", "src/engram/nope.py does not exist"),
        ("../../README.md#no-such-heading", "README.md has no heading with the anchor #no-such-heading"),
        ("../../../elsewhere.md", "leaves the repository"),
    ],
)
def test_broken_links_out_of_docs_warn(repo_files, caplog, link, needle):
    repo_files(f"see [it]({link})\n")
    assert any(needle in r.getMessage() for r in caplog.records), caplog.text


def test_an_included_file_has_its_links_rebased(hook, repo_files, caplog):
    out = repo_files('--8<-- "pyproject.toml"\n', src="benchmarks.md")
    assert out.startswith("[build-system]")
    text = "see [memory](docs/memory.md#x), [code](src/engram/config.py), ![plot](docs/demo-loss.png)\n"
    assert hook._rebase(text, "benchmarks.md", "", base=ROOT) == (
        "see [memory](memory.md#x), code (`src/engram/config.py`), ![plot](demo-loss.png)\n"
    )


def test_github_slugs():
    slug = _hook("repo_files").github_slug
    assert slug("Set-up") == "set-up"
    assert slug("The trainer (`engram.apps.lm.train`)") == "the-trainer-engramappslmtrain"
    assert slug("Studies: the paper's questions on a laptop") == "studies-the-papers-questions-on-a-laptop"
    assert slug("HF models (`engram.distributed.hf`: `fsdp`)") == "hf-models-engramdistributedhf-fsdp"


@pytest.mark.slow  # the whole site, ~30 s on 2 cores
def test_the_site_builds_in_strict_mode(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-6000:]
    for package, page in REFERENCE.items():
        html = (site / "reference" / page / "index.html").read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([^"]+)"', html))
        exported = importlib.import_module(package).__all__
        # a name the package exports lazily or that shares its module's name is shown from its module
        missing = [
            n
            for n in exported
            if f"{package}.{n}" not in ids
            and not any(i.startswith(f"{package}.") and i.endswith(f".{n}") for i in ids)
        ]
        assert not missing, f"reference/{page}.md does not show {package}.{missing}"
