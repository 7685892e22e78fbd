"""The memory-patches study's shipped facts (`engram/apps/study/data/memory_facts.jsonl`, the 1,000 it
writes, and `reader_facts.jsonl`, the 300 its readers train on), taken together: their shape, the
constraints the study's scoring relies on (unique invented subjects across both files, one target per
prompt, neighbours that share no subject), and that `facts_gen.generate_facts` rewrites both exactly."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from importlib.resources import files

import pytest

from engram.apps.study import facts_gen

KEYS = ["id", "subject", "relation", "prompt", "target", "paraphrases", "indirect", "neighbours"]


def _read(name: str) -> str:
    return (files("engram.apps.study") / "data" / name).read_text(encoding="ascii")


@pytest.fixture(scope="module")
def text() -> str:
    return _read("memory_facts.jsonl")


@pytest.fixture(scope="module")
def reader_text() -> str:
    return _read("reader_facts.jsonl")


@pytest.fixture(scope="module")
def records(text: str, reader_text: str) -> list[dict]:
    """Both files' records: the 1,000 written, then the 300 for readers."""
    return [json.loads(line) for line in (text + reader_text).splitlines()]


def pairs(rec: dict) -> list[tuple[str, str]]:
    """Every (prompt, target) of a record: direct, paraphrases, indirect."""
    return [
        (rec["prompt"], rec["target"]),
        *((p["prompt"], p["target"]) for p in rec["paraphrases"]),
        (rec["indirect"]["prompt"], rec["indirect"]["target"]),
    ]


def test_the_files_are_1000_and_300_ascii_json_lines(text, reader_text, records):
    for t in (text, reader_text):
        assert t.isascii()
        assert t.endswith("\n") and "\r" not in t
    assert len(text.splitlines()) == facts_gen.FACTS == 1000
    assert len(reader_text.splitlines()) == facts_gen.READER_FACTS == 300
    assert [r["id"] for r in records] == [f"f{i:04d}" for i in range(1300)]


def test_record_shape(records):
    for rec in records:
        assert list(rec) == KEYS
        assert all(isinstance(rec[k], str) for k in ("id", "subject", "relation", "prompt", "target"))
        assert len(rec["paraphrases"]) == 2
        assert all(list(p) == ["prompt", "target"] for p in rec["paraphrases"])
        assert list(rec["indirect"]) == ["prompt", "target"]
        assert len(rec["neighbours"]) == 2 and all(isinstance(n, str) for n in rec["neighbours"])


def test_prompts_and_targets_are_well_formed(records):
    for rec in records:
        for prompt, target in pairs(rec):
            assert prompt == prompt.strip() and prompt, prompt
            assert rec["subject"] in prompt, prompt
            assert target.startswith(" ") and not target.startswith("  ") and target == target.rstrip(), (
                target
            )
            assert 1 <= len(target.split()) <= 3, target
        for n in rec["neighbours"]:
            assert n == n.strip() and n, n


def test_paraphrases_share_the_answer_and_indirect_differs(records):
    for rec in records:
        assert [p["target"] for p in rec["paraphrases"]] == [rec["target"]] * 2
        assert len({rec["prompt"], *(p["prompt"] for p in rec["paraphrases"])}) == 3
        assert rec["indirect"]["target"] != rec["target"]
        assert rec["indirect"]["prompt"] not in {rec["prompt"], *(p["prompt"] for p in rec["paraphrases"])}


def test_subjects_are_unique_and_none_contains_another(records):
    subjects = [r["subject"].lower() for r in records]
    assert len(set(subjects)) == len(subjects)
    # Each subject occurs once in the joined list: it is no substring of another subject.
    joined = "\n".join(subjects)
    assert [s for s in subjects if joined.count(s) != 1] == []


def test_prompts_are_unique_and_each_has_one_target(records):
    assert len({r["prompt"] for r in records}) == len(records)
    targets: dict[str, set[str]] = defaultdict(set)
    for rec in records:
        for prompt, target in pairs(rec):
            targets[prompt].add(target)
    assert {p: t for p, t in targets.items() if len(t) > 1} == {}
    # A neighbour must stay unchanged, so it is never also a prompt that a fact teaches.
    assert [n for r in records for n in r["neighbours"] if n in targets] == []


def test_neighbours_contain_no_subject(records):
    subjects = [r["subject"].lower() for r in records]
    neighbours = "\n".join(n.lower() for r in records for n in r["neighbours"])
    assert [s for s in subjects if s in neighbours] == []


def test_no_prompt_gives_its_answer_away(records):
    """No answer of any table is spelled inside a subject's name (say Berlin in "Umberlin"), so no
    prompt carries its own target."""
    values = {v.lower() for r in facts_gen.RELATIONS for pair in r.values for v in pair}
    for rec in records:
        assert [v for v in values if v in rec["subject"].lower()] == [], rec["subject"]
        for prompt, target in pairs(rec):
            assert target.strip().lower() not in prompt.lower(), prompt


def test_relations_are_spread_evenly(records):
    counts = Counter(r["relation"] for r in records)
    assert set(counts) == {r.name for r in facts_gen.RELATIONS}
    assert len(counts) >= 5
    assert max(counts.values()) - min(counts.values()) <= 1


def test_answers_come_from_the_curated_tables(records):
    """Direct and indirect answers are a row of the relation's table (the code's stated mappings)."""
    by_name = {r.name: set(r.values) for r in facts_gen.RELATIONS}
    for rec in records:
        pair = (rec["target"][1:], rec["indirect"]["target"][1:])
        assert pair in by_name[rec["relation"]], rec["id"]


def test_generator_reproduces_the_files(text, reader_text):
    assert facts_gen.facts_jsonl(facts_gen.generate_facts(1000)) == text
    assert "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in facts_gen.generate_facts(1000)) == text
    assert facts_gen.facts_jsonl(facts_gen.generate_facts(1300)[1000:]) == reader_text


def test_smaller_n_is_a_prefix(records):
    assert facts_gen.generate_facts(17) == records[:17]
    with pytest.raises(ValueError):
        facts_gen.generate_facts(len(facts_gen.GIVEN_NAMES) * len(facts_gen.FAMILY_NAMES) + 1)
