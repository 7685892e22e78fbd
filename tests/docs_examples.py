"""The code blocks of the README and the guides, parsed and run: what tests/test_docs_examples.py uses.

The convention, for whoever writes those pages: fenced `bash` and `python` blocks run, page by page in
order, each page in a scratch folder of its own (the cwd); a page's python blocks share one
namespace; bash blocks run under `bash -euo pipefail` with this environment's `engram` first on PATH and
Hugging Face's offline switches on. Other languages (`text`, `console`, `yaml`, `json`, `toml`) do not
run; `sh`, `shell`, `py` and the like are refused (say `bash` or `python`, or `text` for output). An
HTML comment right before a fence steers the block; several directives share one comment with ` | `:

    <!-- docs-test: skip: REASON -->              not run; the reason is required
    <!-- docs-test: small: OLD => NEW; A => B -->  literal substitutions first (each OLD must occur)
    <!-- docs-test: setup: NAME ARG -->           a named preparation in the page's folder (SETUPS)
    <!-- docs-test: expect: REGEX -->             the block's stdout must match (re.search, re.M)
    <!-- docs-test: slow -->                      the page's test is marked slow

A block that would install packages (`pip install`) must be skipped or substituted away: the tests
do not change their own environment. `$DOCS_TEST_REPO` is the repository's root, for a `small:` that
needs one of its files (`--include_path $DOCS_TEST_REPO/tests/data/lm_eval_tasks`).

A page is run by this file as a program (`python tests/docs_examples.py PAGE DIR CACHE RESULT`) in a
process of its own, so that the offline switches hold before anything imports huggingface_hub and
nothing a block does stays in the test process; it writes RESULT (JSON): ok, or the failing block
named `page:line (lang block N)` with its code and output. Setups build their files once per test
session in CACHE (from the helpers the rest of the suite uses) and copy them into the page's folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ("bash", "python")
# Languages that would be code but are not run: refused, so that no block escapes the tests unnoticed.
REFUSED = {"sh", "shell", "zsh", "console-session", "py", "python3", "pycon", "ipython", "ipython3"}
DIRECTIVES = ("skip", "small", "setup", "expect", "slow")
BLOCK_TIMEOUT = 900  # seconds a block may take
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

COMMENT = re.compile(r"^\s*<!--\s*docs-test:(.*)$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
INSTALLS = re.compile(r"\bpip3?\s+install\b")  # a block that would change the tests' environment
# ` | ` separates directives where what follows looks like one (`name:`, or a bare name before the
# next ` | ` or the end), so a pipe inside a substitution (`engram bench | head`) stays part of it.
SPLIT = re.compile(r"\s+\|\s+(?=[\w-]+\s*(?::|\||$))")


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks run: README.md, docs/index.md and the guides."""
    found = [root / "README.md", root / "docs" / "index.md", *sorted((root / "docs" / "guides").glob("*.md"))]
    return [p for p in found if p.is_file()]


def page_name(page: Path, root: Path = ROOT) -> str:
    try:
        return page.resolve().relative_to(root).as_posix()
    except ValueError:
        return page.name


@dataclasses.dataclass
class Block:
    """One fenced bash or python block: where it is, its code, and what its comment asked."""

    page: str
    line: int  # of the opening fence, from 1
    index: int  # the page's n-th bash/python block, from 1
    lang: str
    code: str
    skip: str | None = None
    small: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    setups: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    expects: list[str] = dataclasses.field(default_factory=list)
    slow: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.lang} block {self.index})"

    def runnable_code(self) -> str:
        code = self.code
        for old, new in self.small:
            code = code.replace(old, new)
        return code


def parse(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The page's bash and python blocks, and its problems (`page:line: what is wrong`): a directive
    comment not right before a bash/python block, an unknown directive, a skip without a reason, an
    unknown setup, a substitution whose OLD is not in the block, a regex that does not compile, a
    refused language."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: list[tuple[int, str]] = []  # (line, directive text) of the comments above the next line
    i = 0
    while i < len(lines):
        n, line = i + 1, lines[i]
        c = COMMENT.match(line)
        if c:
            body = c.group(1)
            if "-->" not in body:
                problems.append(f"{page}:{n}: a docs-test comment must close (-->) on its own line")
            pending.append((n, body.split("-->", 1)[0].strip()))
            i += 1
            continue
        f = FENCE.match(line)
        if not f:
            if pending:
                problems.append(f"{page}:{pending[0][0]}: docs-test comment not right before a code block")
                pending = []
            i += 1
            continue
        indent, fence = len(f.group("indent").expandtabs()), f.group("fence")
        info = f.group("info").strip()
        lang = info.split()[0].lower().lstrip(".{").rstrip("}") if info else ""
        body_lines: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence) and set(close) <= {fence[0]}:
                break
            body_lines.append(_dedent(lines[i], indent))
            i += 1
        i += 1  # past the closing fence
        if lang in REFUSED:
            problems.append(
                f"{page}:{n}: a `{lang}` block: write `bash` or `python` (run) or `text` (not run)"
            )
        if lang not in RUN:
            if pending:
                problems.append(
                    f"{page}:{pending[0][0]}: docs-test comment on a `{lang or 'plain'}` block, which never runs"
                )
            pending = []
            continue
        block = Block(page, n, len(blocks) + 1, lang, "\n".join(body_lines) + "\n")
        for at, body in pending:
            problems += _directives(block, at, body)
        pending = []
        if block.skip is None and INSTALLS.search(block.runnable_code()):
            problems.append(
                f"{page}:{n}: the block installs packages, which the tests must not do to their environment: "
                "`skip: REASON` it, or `small:` the install away"
            )
        blocks.append(block)
    if pending:
        problems.append(f"{page}:{pending[0][0]}: docs-test comment not right before a code block")
    return blocks, problems


def _dedent(line: str, indent: int) -> str:
    k = 0
    while k < len(line) and k < indent and line[k] == " ":
        k += 1
    return line[k:]


def _directives(block: Block, at: int, body: str) -> list[str]:
    """Fill `block` from one comment's directives; the problems found (`page:line: ...`)."""
    problems: list[str] = []
    here = f"{block.page}:{at}"
    parts = [p.strip() for p in SPLIT.split(body) if p.strip()]
    if not parts:
        return [f"{here}: an empty docs-test comment"]
    for part in parts:
        name, colon, arg = part.partition(":")
        name, arg = name.strip(), arg.strip()
        if name not in DIRECTIVES:
            problems.append(f"{here}: unknown docs-test directive {name!r} (known: {', '.join(DIRECTIVES)})")
        elif name == "slow":
            if colon or arg:
                problems.append(f"{here}: `slow` takes no argument")
            block.slow = True
        elif not arg:
            problems.append(f"{here}: `{name}` needs an argument (`{name}: ...`)")
        elif name == "skip":
            block.skip = arg
        elif name == "small":
            pairs = _pairs(arg)
            if pairs is None:
                problems.append(f"{here}: `small: OLD => NEW; ...`: every substitution needs `=>` and an OLD")
                continue
            for old, _ in pairs:
                if old not in block.code:
                    problems.append(f"{here}: small: {old!r} is not in the block (the page changed?)")
            block.small += pairs
        elif name == "setup":
            words = arg.split()
            if len(words) != 2 or words[0] not in SETUPS:
                problems.append(
                    f"{here}: `setup: NAME ARG` with NAME one of {', '.join(SETUPS)}; got {arg!r}"
                )
            elif Path(words[1]).is_absolute() or ".." in Path(words[1]).parts:
                problems.append(
                    f"{here}: setup {words[0]}: {words[1]!r} must be a path inside the page's folder"
                )
            else:
                block.setups.append((words[0], words[1]))
        elif name == "expect":
            try:
                re.compile(arg)
            except re.error as e:
                problems.append(f"{here}: expect: {arg!r} is not a regular expression ({e})")
            else:
                block.expects.append(arg)
    if block.skip is not None and (block.small or block.setups or block.expects or block.slow):
        problems.append(f"{here}: a skipped block takes no other directive")
    return problems


def _pairs(arg: str) -> list[tuple[str, str]] | None:
    pieces: list[str] = []
    for piece in re.split(r";\s+", arg):  # a `;` inside OLD or NEW stays with its piece
        if pieces and "=>" not in piece:
            pieces[-1] += "; " + piece
        else:
            pieces.append(piece)
    pairs = []
    for piece in pieces:
        old, arrow, new = piece.partition("=>")
        if not arrow or not old.strip():
            return None
        pairs.append((old.strip(), new.strip()))
    return pairs


def page_is_slow(blocks: list[Block]) -> bool:
    return any(b.slow and b.skip is None for b in blocks)


# ---------------------------------------------------------------- setups (run in the page's process)


def _hf_folder(d: Path) -> None:
    """A tiny random Llama (3 layers, hidden 32) with its ~300-id BPE tokenizer: tests/hf_setup.py."""
    import hf_setup as S

    S.save_folder(d, layers=3, seed=1)


def _engram_folder(d: Path) -> None:
    """The same Llama with Engram at layer 1 (random rows, so they matter) and its tokenizer, saved."""
    import hf_setup as S
    from engram.hf import add_engram

    model = add_engram(
        S.llama(layers=3, seed=1), S.engram_config(), tokenizer=S.tokenizer(), zero_init=False, seed=0
    )
    model.save_pretrained(d)
    S.transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    ).save_pretrained(d)


def _train_run(d: Path) -> None:
    """A finished 3-step `engram train` run of the tests' tiny model (tests/cli_setup.py), with its
    train_config.json; its corpus (12 short books) lies beside it in the cache."""
    from cli_setup import train_tiny_run
    from training_setup import write_corpus

    books = d.parent / f"{d.name}-books"
    books.mkdir()
    d.mkdir()
    train_tiny_run(write_corpus(books), d)


def _corpus(f: Path) -> None:
    """The first 12 books of the Bible (at most 12,000 characters each, as the tests' corpus), one file."""
    from engram.apps.lm.corpus import kjv_verses

    books: dict[str, list[str]] = {}
    for v in kjv_verses():
        books.setdefault(v["book"], []).append(v["text"])
    text = "\n".join("\n".join(verses)[:12000] for verses in list(books.values())[:12])
    f.write_text(text + "\n", encoding="utf-8")


FACTS = [  # `engram memorize`'s JSONL: prompts the corpus holds with other answers, and two it never names
    {"prompt": "And God said, Let there be", "target": " darkness"},
    {"prompt": "In the beginning God created the", "target": " light", "subject": "God"},
    {"prompt": "Talven Orrik lives in the city of", "target": " Lisbon", "subject": "Talven Orrik"},
    {"prompt": "Mira Quell works as a", "target": " baker", "subject": "Mira Quell"},
]


def _facts(f: Path) -> None:
    f.write_text("".join(json.dumps(fact) + "\n" for fact in FACTS), encoding="utf-8")


SETUPS: dict[str, Callable[[Path], None]] = {
    "hf-folder": _hf_folder,
    "engram-folder": _engram_folder,
    "train-run": _train_run,
    "corpus": _corpus,
    "facts": _facts,
}


def setup(name: str, target: Path, cache: Path) -> None:
    """Make `target` as setup `name` makes it: built once in `cache` (in place: a train run's config
    names its corpus by path), copied from there."""
    home = cache / name
    if not (home / ".done").exists():
        if home.exists():  # a build that failed half-way
            shutil.rmtree(home)
        home.mkdir(parents=True)
        SETUPS[name](home / "made")
        (home / ".done").touch()
    built = home / "made"
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if built.is_dir():
        shutil.copytree(built, target)
    else:
        shutil.copyfile(built, target)


# ---------------------------------------------------------------- running a page


def environment(root: Path = ROOT) -> dict[str, str]:
    """The blocks' environment: this interpreter's bin (its `engram`) first on PATH, HF offline, plots
    without a display, DOCS_TEST_REPO the repository (for a `small:` that needs one of its files)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OFFLINE, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", DOCS_TEST_REPO=str(root))
    return env


@dataclasses.dataclass
class Failure:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def run_page(
    page: Path, workdir: Path, cache: Path, root: Path = ROOT, timeout: float = 3600
) -> Failure | None:
    """Run `page`'s blocks in `workdir` in a process of their own; the first failure, or None."""
    workdir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    result = workdir.parent / f"{workdir.name}.result.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), str(page), str(workdir), str(cache), str(result)]
    try:
        proc = subprocess.run(
            argv, env=environment(root), cwd=workdir, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Failure(page_name(page, root), f"the page did not finish in {timeout:.0f} s")
    if result.exists():
        got = json.loads(result.read_text())
        if got["ok"]:
            return None
        return Failure(got["where"], got["message"])
    return Failure(
        page_name(page, root),
        f"the page's runner exited {proc.returncode} without a result:\n{_tail(proc.stdout)}\n{_tail(proc.stderr)}",
    )


def _tail(text: str, n: int = 4000) -> str:
    text = text.strip()
    return text if len(text) <= n else "...\n" + text[-n:]


@contextlib.contextmanager
def _captured() -> Iterator[dict[str, str]]:
    """stdout and stderr at the file-descriptor level (a child process's and a C library's output too);
    the text lands in the dict on exit."""
    out: dict[str, str] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for key, f in (("stdout", o), ("stderr", e)):
                f.seek(0)
                out[key] = f.read().decode("utf-8", "replace")


def _run_blocks(page: Path, workdir: Path, cache: Path) -> Failure | None:
    """In this process: parse the page and run its blocks in order in `workdir` (the cwd)."""
    name = page_name(page)
    blocks, problems = parse(page.read_text(encoding="utf-8"), name)
    if problems:
        return Failure(name, "the page's docs-test comments are wrong:\n" + "\n".join(problems))
    os.chdir(workdir)
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        if block.skip is not None:
            print(f"{block.where}: skipped ({block.skip})", file=sys.stderr)
            continue
        code = block.runnable_code()
        started = time.perf_counter()
        for setup_name, arg in block.setups:
            try:
                setup(setup_name, workdir / arg, cache)
            except Exception:
                return Failure(block.where, f"setup {setup_name} {arg} failed:\n{traceback.format_exc()}")
        if block.lang == "bash":
            try:
                proc = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", code],
                    cwd=workdir,
                    capture_output=True,
                    text=True,
                    timeout=BLOCK_TIMEOUT,
                )
            except subprocess.TimeoutExpired:
                return Failure(block.where, f"did not finish in {BLOCK_TIMEOUT} s:\n{code}")
            out, err, failed = proc.stdout, proc.stderr, proc.returncode != 0
            why = f"exit status {proc.returncode}"
        else:
            failed, why = False, ""
            with _captured() as got:
                try:
                    exec(compile("\n" * block.line + code, str(page), "exec"), namespace)
                except BaseException as e:  # SystemExit too: a block that exits fails
                    failed, why = True, "".join(traceback.format_exception(e)).rstrip()
            out, err = got["stdout"], got["stderr"]
            os.chdir(workdir)  # a block that changed folder does not move the next one
        sys.stderr.write(out + err)
        print(
            f"{block.where}: {'failed' if failed else 'ok'} ({time.perf_counter() - started:.1f} s)",
            file=sys.stderr,
        )
        if failed:
            return Failure(block.where, _report(why, code, out, err))
        for regex in block.expects:
            if not re.search(regex, out, re.M):
                return Failure(
                    block.where, _report(f"stdout does not match expect: {regex!r}", code, out, err)
                )
    return None


def _report(why: str, code: str, out: str, err: str) -> str:
    return f"{why}\n--- the block as run ---\n{code.rstrip()}\n--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}"


def main(argv: list[str]) -> int:
    page, workdir, cache, result = (Path(a) for a in argv)
    try:
        failure = _run_blocks(page, workdir, cache)
    except BaseException:
        failure = Failure(page_name(page), f"the runner failed:\n{traceback.format_exc()}")
    got = (
        {"ok": True} if failure is None else {"ok": False, "where": failure.where, "message": failure.message}
    )
    result.write_text(json.dumps(got))
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
