"""Every bash and python block of README.md, docs/index.md and docs/guides/*.md runs here, page by page,
at the small settings its `<!-- docs-test: ... -->` comment asks for, or says why it does not
(tests/docs_examples.py has the convention). A page with a `slow` block is marked slow. The collector
itself is tested on small pages written here: directives, refusals, expect, and a failure's page:line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import docs_examples as D

PAGES = D.pages()


def _params() -> list:
    out = []
    for page in PAGES:
        blocks, _ = D.parse(page.read_text(encoding="utf-8"), D.page_name(page))
        marks = [pytest.mark.slow] if D.page_is_slow(blocks) else []
        out.append(pytest.param(page, marks=marks, id=D.page_name(page)))
    return out


@pytest.fixture(scope="session")
def setup_cache(tmp_path_factory) -> Path:
    """The setups' files (tiny HF folders, a train run, a corpus, facts), built once per session."""
    return tmp_path_factory.mktemp("docs-setups")


@pytest.mark.parametrize("page", _params())
def test_page_runs(page: Path, tmp_path: Path, setup_cache: Path):
    failure = D.run_page(page, tmp_path / "page", setup_cache)
    if failure is not None:
        pytest.fail(str(failure), pytrace=False)


def test_every_block_runs_or_says_why():
    """No bash/python block escapes: every directive is known and well formed, every skip has a reason,
    every setup is known, and no block is in a language that looks like code but never runs."""
    problems = []
    for page in PAGES:
        problems += D.parse(page.read_text(encoding="utf-8"), D.page_name(page))[1]
    assert not problems, "\n".join(problems)


def test_the_pages_are_found():
    names = [D.page_name(p) for p in PAGES]
    assert names[:2] == ["README.md", "docs/index.md"]
    assert all(n.startswith("docs/guides/") for n in names[2:])


# ---------------------------------------------------------------- the collector on pages written here

PAGE = """\
# A page

Text.

<!-- docs-test: setup: corpus corpus.txt | small: --steps 200 => --steps 2; head -c 5 => head -c 3 -->
<!-- docs-test: expect: ^In t$ | slow -->
```bash
echo --steps 200 | head -c 5; echo
```

```text
not run
```

<!-- docs-test: skip: needs a GPU -->
```python
import torch
torch.zeros(1, device="cuda")
```

   ```python
   x = 1
   ```
"""


def test_directives_are_parsed():
    blocks, problems = D.parse(PAGE, "page.md")
    assert problems == []
    assert [(b.lang, b.line, b.index) for b in blocks] == [
        ("bash", 7, 1),
        ("python", 16, 2),
        ("python", 21, 3),
    ]
    first, gpu, indented = blocks
    assert first.setups == [("corpus", "corpus.txt")]
    assert first.small == [("--steps 200", "--steps 2"), ("head -c 5", "head -c 3")]
    assert first.expects == ["^In t$"] and first.slow and first.skip is None
    assert first.runnable_code() == "echo --steps 2 | head -c 3; echo\n"
    assert first.where == "page.md:7 (bash block 1)"
    assert gpu.skip == "needs a GPU"
    assert indented.code == "x = 1\n"
    assert D.page_is_slow(blocks)


@pytest.mark.parametrize(
    ("comment", "needle"),
    [
        ("skip", "`skip` needs an argument"),
        ("skip:   ", "`skip` needs an argument"),
        ("sikp: typo", "unknown docs-test directive 'sikp'"),
        ("slow | flaky", "unknown docs-test directive 'flaky'"),
        ("slow: yes", "`slow` takes no argument"),
        ("setup: model-folder m", "setup: NAME ARG"),
        ("setup: hf-folder", "setup: NAME ARG"),
        ("setup: hf-folder ../outside", "inside the page's folder"),
        ("small: echo 1", "needs `=>`"),
        ("small: echo 9 => echo 1", "'echo 9' is not in the block"),
        ("expect: (unclosed", "not a regular expression"),
        ("skip: needs a GPU | slow", "a skipped block takes no other directive"),
        ("", "an empty docs-test comment"),
    ],
)
def test_bad_directives_are_refused(comment, needle):
    _, problems = D.parse(f"<!-- docs-test: {comment} -->\n```bash\necho 1\n```\n", "p.md")
    assert any(needle in p for p in problems), problems
    assert all(p.startswith("p.md:1: ") for p in problems), problems


def test_a_pipe_inside_a_substitution_stays_in_it():
    blocks, problems = D.parse(
        "<!-- docs-test: small: engram bench | head => echo ok | slow -->\n```bash\nengram bench | head\n```\n",
        "p.md",
    )
    assert problems == []
    assert blocks[0].small == [("engram bench | head", "echo ok")] and blocks[0].slow
    blocks, problems = D.parse(
        "<!-- docs-test: small: engram demo => engram demo --steps 2 | slow | expect: loss: [+-]\\d -->\n"
        "```bash\nengram demo\n```\n",
        "p.md",
    )
    assert problems == []
    assert blocks[0].small == [("engram demo", "engram demo --steps 2")]
    assert blocks[0].slow and blocks[0].expects == [r"loss: [+-]\d"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<!-- docs-test: slow -->\n\n```bash\necho 1\n```\n", "not right before a code block"),
        ("<!-- docs-test: slow -->\nText.\n", "not right before a code block"),
        ("<!-- docs-test: slow -->\n```text\nout\n```\n", "on a `text` block, which never runs"),
        ("<!-- docs-test: slow\n```bash\necho 1\n```\n", "must close"),
        ("```sh\necho 1\n```\n", "a `sh` block"),
        ("```py\nx = 1\n```\n", "a `py` block"),
        ("```bash\npip install -e . && engram demo\n```\n", "the block installs packages"),
        (
            "<!-- docs-test: small: demo => demo --quick -->\n```bash\npython -m pip install x && engram demo\n```\n",
            "installs",
        ),
    ],
)
def test_comments_and_languages_that_would_escape_are_refused(text, needle):
    _, problems = D.parse(text, "p.md")
    assert any(needle in p for p in problems), problems


def _run(tmp_path: Path, text: str) -> D.Failure | None:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return D.run_page(page, tmp_path / "work", tmp_path / "cache")


def test_blocks_run_in_order_in_one_folder_python_sharing_a_namespace(tmp_path):
    text = (
        "```python\nimport os\nx = 41\nopen('a.txt', 'w').write(str(x + 1))\nos.chdir('/')\n```\n"
        "<!-- docs-test: expect: ^42$ -->\n```bash\ncat a.txt; echo\n```\n"
        "<!-- docs-test: expect: ^x=41 42$ -->\n```python\nprint(f'x={x}', open('a.txt').read())\n```\n"
    )
    assert _run(tmp_path, text) is None
    assert (tmp_path / "work" / "a.txt").read_text() == "42"


def test_bash_runs_strict_with_engram_on_path_and_hf_offline(tmp_path):
    bin_dir = Path(sys.executable).parent
    text = (
        f"<!-- docs-test: expect: ^{bin_dir}/engram$ -->\n```bash\ncommand -v engram\n```\n"
        '```bash\ntest "$HF_HUB_OFFLINE" = 1 && test "$TRANSFORMERS_OFFLINE" = 1\n```\n'
        "```python\nimport os\nassert os.environ['HF_DATASETS_OFFLINE'] == '1'\n```\n"
    )
    assert _run(tmp_path, text) is None
    for strict in ("false | true", "echo $UNSET_VARIABLE_OF_NO_ONE", "false\necho after"):
        failure = _run(tmp_path, f"# P\n\n```bash\n{strict}\n```\n")
        assert failure is not None and failure.where == "page.md:3 (bash block 1)", strict


def test_expect_is_checked(tmp_path):
    assert (
        _run(tmp_path, "<!-- docs-test: expect: loss 3\\.5\\d -->\n```bash\necho 'loss 3.51'\n```\n") is None
    )
    failure = _run(tmp_path, "<!-- docs-test: expect: loss 3\\.4\\d -->\n```bash\necho 'loss 3.51'\n```\n")
    assert failure is not None and "stdout does not match expect" in failure.message
    assert "loss 3.51" in failure.message


def test_a_failing_block_is_reported_with_page_line_and_block(tmp_path):
    text = "# P\n\n```bash\necho fine\n```\n\nThen:\n\n```python\nx = 1\nraise ValueError('boom')\n```\n"
    failure = _run(tmp_path, text)
    assert failure is not None
    assert failure.where == "page.md:9 (python block 2)"
    assert "ValueError: boom" in failure.message
    assert 'page.md", line 11' in failure.message  # the traceback's line is the page's line
    failure = _run(tmp_path, "```bash\necho out; echo err >&2; exit 3\n```\n")
    assert failure.where == "page.md:1 (bash block 1)" and "exit status 3" in failure.message
    assert "out" in failure.message and "err" in failure.message


def test_an_install_substituted_away_or_skipped_is_accepted():
    text = (
        "<!-- docs-test: small: pip install -e . && engram demo => engram demo --steps 2 -->\n"
        "```bash\npip install -e . && engram demo\n```\n"
        "<!-- docs-test: skip: installs into the environment the tests run in -->\n```bash\npip install -e .\n```\n"
    )
    blocks, problems = D.parse(text, "p.md")
    assert problems == [] and blocks[0].runnable_code() == "engram demo --steps 2\n"


def test_a_skipped_block_does_not_run(tmp_path):
    assert _run(tmp_path, "<!-- docs-test: skip: needs a GPU -->\n```bash\nexit 1\n```\n") is None


def test_a_page_with_wrong_directives_fails_before_running(tmp_path):
    failure = _run(tmp_path, "<!-- docs-test: skip -->\n```bash\ntouch ran\n```\n")
    assert failure is not None and "`skip` needs an argument" in failure.message
    assert not (tmp_path / "work" / "ran").exists()


def test_setups_make_their_files(tmp_path):
    """corpus and facts (the fast ones); the model folders and the train run in the slow test below."""
    text = (
        "<!-- docs-test: setup: corpus data/corpus.txt | setup: facts facts.jsonl -->\n"
        "```python\nimport json\nfrom engram.memory import read_facts\n"
        "text = open('data/corpus.txt', encoding='utf-8').read()\n"
        "assert text.startswith('In the beginning God created the heaven and the earth.'), text[:80]\n"
        "assert 50_000 < len(text) < 200_000, len(text)\n"
        "facts = [json.loads(line) for line in open('facts.jsonl')]\n"
        "assert all(f['prompt'] and f['target'] for f in facts) and len(facts) == 4\n```\n"
    )
    assert _run(tmp_path, text) is None


@pytest.mark.slow  # the three model setups (transformers, a 3-step train run), ~20 s on 2 cores
def test_model_setups_make_what_the_commands_take(tmp_path):
    text = (
        "<!-- docs-test: setup: hf-folder base | setup: engram-folder my-engram-model -->\n"
        "```python\nimport transformers\nfrom engram.hf import get_attachment\n"
        "base = transformers.AutoModelForCausalLM.from_pretrained('base')\n"
        "assert not hasattr(base, 'engram')\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained('my-engram-model')\n"
        "assert get_attachment(model).config.layer_ids == (1,)\n"
        "transformers.AutoTokenizer.from_pretrained('my-engram-model')\n```\n"
        "<!-- docs-test: setup: train-run runs/tiny -->\n"
        "```bash\nengram eval --checkpoint runs/tiny --device cpu\n```\n"
    )
    failure = _run(tmp_path, text)
    assert failure is None, str(failure)
    assert sorted(os.listdir(tmp_path / "work")) == ["base", "my-engram-model", "runs"]
