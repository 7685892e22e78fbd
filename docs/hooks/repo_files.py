"""MkDocs hook: the site's pages and the repository's other files.

The pages under docs/ are written to read well on GitHub too, so they link to files outside docs/ by
relative path (`../src/engram/config.py`, `../README.md#results`): MkDocs cannot serve those, and in
strict mode it must not quietly drop them either. This hook, before MkDocs reads a page:

- includes a repository file where a page holds a line `--8<-- "PATH"` (PATH from the repository's
  root; docs/benchmarks.md holds `--8<-- "BENCHMARKS.md"`), with the relative links inside it rebased
  from that file's folder to the page's;
- turns every relative link that leaves docs/ into the path it names, after checking that the file
  exists (and, for a Markdown file, that the `#anchor` is one of its headings, as GitHub spells them):
  with `repo_url` set in mkdocs.yml, a link to the file there; without it, the path as code text;
- points a link to an included file (`../BENCHMARKS.md#...`) at the page that includes it.

A missing file or anchor is a warning, so `mkdocs build --strict` fails on it. Links inside docs/ are
left to MkDocs' own validation (mkdocs.yml's `validation`). Code spans and fenced blocks are not touched.
"""

from __future__ import annotations

import logging
import posixpath
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

log = logging.getLogger("mkdocs.hooks.repo_files")

INCLUDE = re.compile(r'^--8<--\s+"([^"]+)"\s*$', re.M)
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?(?:^[ \t]*\1[`~]*[ \t]*$|\Z)", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
# [text](target "title") and ![alt](target); text may hold one level of brackets.
LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(?P<target><[^>\n]+>|[^\s)]+)"
    r"(?P<title>\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
REF_DEF = re.compile(r"^(?P<lead>[ ]{0,3}\[[^\]\n]+\]:[ \t]*)(?P<target>\S+)", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ID = re.compile(r"""<[a-zA-Z][^>]*\s(?:id|name)=["']([^"']+)["']""")

_state: dict = {}


def on_config(config, **kwargs):
    docs = Path(config["docs_dir"]).resolve()
    _state.update(docs=docs, root=docs.parent, repo_url=(config.get("repo_url") or "").rstrip("/"))
    return config


def on_files(files, config, **kwargs):
    """Which page shows which repository file (its `--8<--` line): links to that file go there."""
    shown: dict[str, str] = {}
    for f in files.documentation_pages():
        for path in INCLUDE.findall(Path(f.abs_src_path).read_text(encoding="utf-8")):
            shown[posixpath.normpath(path)] = f.src_uri
    _state["shown"] = shown
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    src = page.file.src_uri
    page_dir = posixpath.dirname(src)
    docs, root = _state["docs"], _state["root"]
    out, at = [], 0
    for m in INCLUDE.finditer(markdown):
        out.append(_rebase(markdown[at : m.start()], src, page_dir, base=docs / page_dir))
        path = posixpath.normpath(m.group(1))
        f = root / path
        if not f.is_file():
            log.warning("%s: --8<-- %r: no such file in the repository", src, path)
        else:
            out.append(_rebase(f.read_text(encoding="utf-8"), src, page_dir, base=f.parent, origin=path))
        at = m.end()
    out.append(_rebase(markdown[at:], src, page_dir, base=docs / page_dir))
    return "".join(out)


def _rebase(text: str, src: str, page_dir: str, base: Path, origin: str | None = None) -> str:
    """`text` with its relative links, written from folder `base`, rewritten for the page `src`."""
    where = f"{src} (from {origin})" if origin else src
    pieces, at = [], 0
    for m in FENCE.finditer(text):
        pieces.append(_rebase_prose(text[at : m.start()], where, page_dir, base))
        pieces.append(m.group(0))
        at = m.end()
    pieces.append(_rebase_prose(text[at:], where, page_dir, base))
    return "".join(pieces)


def _rebase_prose(text: str, where: str, page_dir: str, base: Path) -> str:
    spans: list[str] = []

    def hide(m: re.Match) -> str:
        spans.append(m.group(0))
        return f"\x00{len(spans) - 1}\x00"

    text = CODE_SPAN.sub(hide, text)

    def link(m: re.Match) -> str:
        target = m.group("target").strip("<>")
        label = re.sub(r"\x00(\d+)\x00", lambda s: spans[int(s.group(1))], m.group("text"))
        new = _target(target, where, page_dir, base, label=label, image=bool(m.group("bang")))
        if new is None:
            return m.group(0)
        if isinstance(new, _Text):
            return new.markdown
        return f"{m.group('bang')}[{m.group('text')}]({new}{m.group('title') or ''})"

    def ref_def(m: re.Match) -> str:
        target = m.group("target").strip("<>")
        new = _target(target, where, page_dir, base, label=None, image=False)
        if new is None:
            return m.group(0)
        if isinstance(new, _Text):  # a reference definition cannot become text
            if new.url is None:
                log.warning("%s: reference link %r leaves docs/: write it as an inline link", where, target)
                return m.group(0)
            new = new.url
        return m.group("lead") + new

    text = LINK.sub(link, text)
    text = REF_DEF.sub(ref_def, text)
    return re.sub(r"\x00(\d+)\x00", lambda s: spans[int(s.group(1))], text)


class _Text:
    """A link that leaves the site, as what replaces it: plain markdown, and the URL it had if any."""

    def __init__(self, markdown: str, url: str | None) -> None:
        self.markdown, self.url = markdown, url


def _target(target: str, where: str, page_dir: str, base: Path, label: str | None, image: bool):
    """The new target (a string), a `_Text` for a link out of the site, or None to keep the link."""
    if not target or target.startswith(("#", "/")) or SCHEME.match(target):
        return None
    path, _, fragment = target.partition("#")
    path = unquote(path.split("?", 1)[0])
    docs, root = _state["docs"], _state["root"]
    full = Path(posixpath.normpath((base / path).as_posix()))
    anchor = f"#{fragment}" if fragment else ""
    if full == docs or docs in full.parents:
        rel = posixpath.relpath(full.relative_to(docs).as_posix(), page_dir or ".")
        return None if rel == posixpath.normpath(path) else rel + anchor
    if full != root and root not in full.parents:
        log.warning("%s: link %r leaves the repository", where, target)
        return None
    repo_path = full.relative_to(root).as_posix()
    shown = _state["shown"].get(repo_path)
    if shown is not None:
        return posixpath.relpath(shown, page_dir or ".") + anchor
    if not full.exists():
        log.warning("%s: link %r: %s does not exist in the repository", where, target, repo_path)
        return None
    if fragment and full.suffix == ".md" and fragment not in _anchors(full):
        log.warning("%s: link %r: %s has no heading with the anchor #%s", where, target, repo_path, fragment)
    if image:
        log.warning(
            "%s: image %r lies outside docs/: the site cannot show it; move it under docs/", where, target
        )
        return None
    url = None
    if _state["repo_url"]:
        kind = "tree" if full.is_dir() else "blob"
        url = f"{_state['repo_url']}/{kind}/HEAD/{repo_path}{anchor}"
    if label is None:
        return _Text("", url)
    plain = label.strip().strip("`")
    shown_as = f"`{repo_path}`" if plain in (repo_path, path, posixpath.basename(repo_path)) else None
    if url is not None:
        return _Text(f"[{label}]({url})", url)
    return _Text(shown_as or f"{label} (`{repo_path}`)", None)


def _anchors(md: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (and any HTML id or name in it)."""
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(HTML_ID.findall(text))
    for heading in HEADING.findall(text):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text, lower case, punctuation dropped
    (letters, digits, `-` and `_` kept), each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*{1,3})(.+?)\1", r"\2", text)
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ " or unicodedata.category(c) == "Mn")
    return text.replace(" ", "-")
