"""`engram quantise-check` compares only what is comparable (issue 46): folders of one model that differ
in nothing but the seed, each folder once (a symlink or a trailing slash is the same folder), a seed
spread from fewer than two distinct seeds reported as unknown (text and --json), and a memory probe's
--ngram bounded (a stated maximum, and the block length) before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli_setup import CPU, refused
from engram.apps.tools import quantise_check as Q
from engram.apps.tools import quantise_report as R
from engram.cli import main
from training_setup import tiny_cfg, write_corpus

FAST = ["--threads", "1", "--formats", "int8", "--max-tokens", "256", *CPU]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Tiny 3-step runs (blocks of 24 tokens, 32-wide rows): `a` (seed 0), `b` (seed 1), `steps` (seed 1, 4 steps), `rows` (seed 1, another
    table size), `copy` (a's folder copied: the same seed in another folder)."""
    from engram.apps.lm.train import Trainer, build_model, prepare_data

    root = tmp_path_factory.mktemp("runs")
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    made = {}
    for name, kw in {
        "a": {},
        "b": {"seed": 1},
        "steps": {"seed": 1, "steps": 4},
        "rows": {"seed": 1, "engram_kw": {"head_dim": 32, "engram_vocab_size": (600, 600)}},
    }.items():
        kw = {
            "steps": 3,
            "seq_len": 24,
            "engram_kw": {"head_dim": 32},
        } | kw  # 32-wide rows: every format takes them
        cfg = tiny_cfg(corpus, eval_every=0, threads=1, **kw)
        data = prepare_data(cfg)
        Trainer(cfg, data, build_model(cfg, data), out_dir=root / name).run()
        made[name] = root / name
    shutil.copytree(made["a"], root / "copy")
    made["copy"] = root / "copy"
    (root / "link").symlink_to(made["a"], target_is_directory=True)
    made["link"] = root / "link"
    return made


def test_one_folder_twice_is_refused_also_through_a_symlink_or_a_trailing_slash(runs, capsys):
    a = str(runs["a"])
    for second in (a, a + "/", str(runs["link"]), str(runs["a"] / ".." / "a")):
        line = refused(capsys, ["quantise-check", a, second, *FAST], "again", "give each folder once")
        assert "no seed spread" in line


def test_runs_of_other_configs_are_refused_naming_the_fields(runs, capsys):
    line = refused(
        capsys, ["quantise-check", str(runs["b"]), str(runs["steps"]), *FAST], "not seeds of one model"
    )
    assert "steps (3 vs 4)" in line and "step (3 vs 4)" in line and "differ only in the seed" in line
    line = refused(capsys, ["quantise-check", str(runs["b"]), str(runs["rows"]), *FAST], "engram_vocab_size")
    assert "seed" not in line.split("differ in")[1].split(";")[0]  # the seed is not a difference
    with pytest.raises(ValueError, match="not seeds of one model"):
        Q.comparable([runs["a"], runs["rows"]])


def test_spread_of_one_seed_is_unknown_and_of_two_seeds_known(runs, capsys):
    code = main(["quantise-check", str(runs["a"]), str(runs["copy"]), *FAST, "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and [f["seed"] for f in r["folders"]] == [{"engram.seed": 0, "seed": 0}] * 2
    (s,) = r["seed_summary"]
    assert s["float_seed_spread"] is None and s["within_seed_spread"] is None  # unknown, not 0
    assert main(["quantise-check", str(runs["a"]), str(runs["copy"]), *FAST]) == 0
    out = capsys.readouterr().out
    assert "seed spread is unknown" in out and "LOSES MORE" not in out and "within the" not in out
    code = main(["quantise-check", str(runs["a"]), str(runs["b"]), *FAST, "--json"])
    (s,) = json.loads(capsys.readouterr().out)["seed_summary"]
    assert code == 0 and s["float_seed_spread"] > 0 and isinstance(s["within_seed_spread"], bool)


def test_seed_summary_of_one_seed_has_no_spread():
    rows = [{"format": "float", "loss": 4.2, "loss_change": 0.0}, {"format": "int8", "loss_change": 0.01}]
    same = [{"folder": f, "seed": {"seed": 3}, "formats": rows} for f in "xy"]
    (s,) = R.seed_summary(same)
    assert s["float_seed_spread"] is None and s["within_seed_spread"] is None
    assert "unknown" in R.format_summary([s], 2)[0] and "seed spread unknown" in R.format_summary([s], 2)[1]
    unrecorded = [{"folder": f, "seed": None, "formats": rows} for f in "xy"]
    assert R.seed_summary(unrecorded)[0]["float_seed_spread"] is None


def test_ngram_is_bounded_before_any_work(runs, capsys, monkeypatch):
    def never(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(Q, "_run_scorer", never)
    a = str(runs["a"])
    refused(capsys, ["quantise-check", a, "--ngram", "100000"], "--ngram", f"from 2 to {Q.NGRAM_MAX}")
    refused(capsys, ["quantise-check", a, "--ngram", "1000"], "--ngram", f"from 2 to {Q.NGRAM_MAX}")
    # the runs' blocks are 24 tokens: 24 is the longest n-gram a block holds
    line = refused(capsys, ["quantise-check", a, "--ngram", "25", *CPU], "--ngram 25", "blocks are 24 tokens")
    assert "from 2 to 24" in line
    with pytest.raises(ValueError, match="from 2 to 24"):
        Q.check_folder(a, ngram=25)
    with pytest.raises(AssertionError, match="work started"):  # 24 passes the check
        Q.check_folder(a, ngram=24)
