"""`engram study memorize` (engram.apps.study.memorize) on a tiny random Llama with Engram (hidden 32,
the ~300-id BPE of tests/hf_setup.py) and a tiny demo LM trained on tests/training_setup.py's corpus:
the shipped facts at 3 and 6, one seed, 2 passes. Every arm has every metric; the report, its plot and
results exist; a second run trains and measures nothing; the in-prompt arm's questions hold the fact;
the locality count is the positions before each held-out block's first patched row, every one
bit-equal; where the models come from without --model / --demo-run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import hf_setup as S
import training_setup
from cli_setup import CPU
from engram.apps.study import memorize as SM
from engram.apps.study import memorize_arms as MA
from engram.apps.study import memorize_models as MM
from engram.apps.study import memorize_reader as MR
from engram.apps.study.memorize_report import METRICS
from engram.cli import main
from engram.hf import add_engram
from engram.memory import load_patch, patch_hits

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

PLAN = SM.MemorizePlan(
    facts=(3, 6),
    steps=2,
    batch_size=4,
    lora_lrs=(1e-3, 3e-3),  # a pilot for LoRA at 3 facts (6 takes its choice); the last layer: one lr
    layer_lrs=(3e-4,),
    pilot_max_facts=3,
    held_tokens=512,
    block_len=64,
    eval_batch=8,
    reader_facts=4,
    reader_passes=2,
    reference_tokens=200,
)


def _engram_folder(d: Path) -> Path:
    m = add_engram(S.llama(seed=1), S.engram_config(), tokenizer=S.tokenizer(), zero_init=False, seed=0)
    m.save_pretrained(d)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _engram_folder(tmp_path_factory.mktemp("hf") / "tiny-engram")


@pytest.fixture(scope="module")
def demo_cfg(corpus):
    return training_setup.tiny_cfg(corpus, steps=5, warmup=1, eval_every=0, seq_len=128)


def _study(out: Path, folder: Path, corpus: str, demo_cfg, **kw):
    kw = {"model": str(folder), "demo_config": demo_cfg, "seeds": (0,), "plan": PLAN, **kw}
    return SM.run_memorize_study(out, corpus=corpus, progress=False, threads=1, say=lambda m: None, **kw)


@pytest.fixture(scope="module")
def study(folder, corpus, demo_cfg, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("study")
    return out, _study(out, folder, corpus, demo_cfg)


def test_every_model_arm_and_size_has_every_metric(study):
    out, r = study
    assert [m["key"] for m in r["models"]] == ["hf", "demo"] and r["skipped"] == []
    assert r["models"][0]["how"] == "given (--model)" and "trained here" in r["models"][1]["how"]
    runs = {(x["model"], x["n"], x["arm"]) for x in r["runs"]}
    assert runs == {(m, n, a) for m in ("hf", "demo") for n in (3, 6) for a in SM.ARMS}
    for x in r["runs"]:
        for key, *_ in METRICS:
            assert np.isfinite(x["metrics"][key]), (x["arm"], key)
        assert 0.0 <= x["metrics"]["direct_recall"] <= 1.0
    by = {(x["model"], x["n"], x["arm"]): x for x in r["runs"]}
    for m in ("hf", "demo"):
        patch = by[m, 6, "patch"]
        assert patch["metrics"]["bytes_per_fact"] == patch["locality"]["file_bytes"] / 6
        assert len(patch["losses"]) == PLAN.steps and patch["losses"][-1] < patch["losses"][0]
        assert by[m, 6, "lora-r8"]["params"] > by[m, 6, "lora-r1"]["params"] > 0
        assert by[m, 6, "lora-r1"]["lr"] == by[m, 3, "lora-r1"]["lr"]  # the pilot's choice at 3 facts
        assert by[m, 6, "none"]["metrics"]["held_out_delta"] == 0.0
        assert by[m, 6, "in-prompt"]["context_tokens"] > 0
    assert {(p["model"], p["arm"], p["n"]) for p in r["pilot"]} == {
        (m, a, 3) for m in ("hf", "demo") for a in ("lora-r1", "lora-r8")
    }
    report = (out / "memorize" / "report.md").read_text()
    for text in ("## tiny-engram", "## demo LM", "### Locality", "## Where patches lose", "## README row"):
        assert text in report
    assert "| 6 | lora-r8 |" in report and "(chosen)" in report
    assert (out / "memorize" / "memorize.png").stat().st_size > 1000
    assert json.loads((out / "memorize" / "results.json").read_text())["study"] == "memorize"
    assert len(r["findings"]["lose"]) == 12  # one line a model, size and patch arm, whatever it says
    for m in ("hf", "demo"):  # the readers: trained once a model, on the reader facts' first 4
        rd = by[m, 6, "reader-patch"]["reader"]
        assert rd == by[m, 3, "reader-patch"]["reader"] and rd["facts"] == 4
        assert len(rd["losses"]) == PLAN.reader_passes and np.isfinite(rd["held_out_loss"])
        assert len(rd["text_losses"]) == PLAN.reader_passes
        own = by[m, 6, "reader-patch"]["locality"]
        assert own["base_loss"] == pytest.approx(rd["held_out_loss"])  # written for the reader model
        assert by[m, 6, "reader-patch-ref"]["reader"] == rd  # the same readers
    assert "### The readers (reader-patch, reader-patch-ref)" in report and "| 6 reader-patch |" in report
    assert (
        "| 6 reader-patch-ref |" in report
        and "first 200 tokens (tiny-engram), 200 tokens (demo LM)" in report
    )


def test_the_pilots_chosen_run_is_seed_0s_run(study):
    """The pilot trains seed 0's runs at each lr; the chosen one is seed 0's run (nothing trained twice)."""
    _, r = study
    by = {(x["model"], x["n"], x["arm"], x.get("lr")): x for x in r["runs"] if x["seed"] == 0}
    for p in r["pilot"]:
        if p["chosen"]:
            assert by[p["model"], p["n"], p["arm"], p["lr"]]["losses"][-1] == p["final_loss"]
        else:
            assert (p["model"], p["n"], p["arm"], p["lr"]) not in by


def test_reader_patch_ref_leaves_out_every_row_the_reference_reads(study, folder):
    """Its patch holds no row that the training text's first `reference_tokens` read; reader-patch's
    patch of the same facts does (else this test could not fail)."""
    from engram.memory.choose import rows_read

    out, r = study
    s = MM.hf_subject(str(folder), "", (out / "memorize" / "corpus" / "held.txt").read_text(), 512, 64)
    train = (out / "memorize" / "corpus" / "train.txt").read_text()
    ids = MM.encode_text(s.tokenizer, train, False)[: PLAN.reference_tokens]
    read = rows_read(s.layers(s.model).hasher, [ids])

    def rows(arm: str) -> dict[int, np.ndarray]:
        rec = next(x for x in r["runs"] if x["model"] == "hf" and x["arm"] == arm and x["n"] == 6)
        patch = load_patch(out / "runs" / f"memorize-{rec['key']}.patch.safetensors")
        return {lid: lr.rows.numpy() for lid, lr in patch.layers.items()}

    ref, plain = rows("reader-patch-ref"), rows("reader-patch")
    assert ref and all(not np.isin(v, read[lid]).any() for lid, v in ref.items())
    assert any(np.isin(v, read[lid]).any() for lid, v in plain.items())


def test_the_default_reference_reads_about_a_heads_rows(folder):
    """reference_tokens None: a layer's rows per head, rounded down to a power of two."""
    s = MM.hf_subject(
        str(folder), "", "In the beginning God created the heaven and the earth. " * 20, 128, 64
    )
    e = s.layers(s.model)
    heads = e.hasher.config.n_heads * (e.hasher.config.max_ngram_size - 1)
    per_head = min(m.table.num_rows for m in e.modules.values()) / heads
    n = SM.reference_len(SM.MemorizePlan(), s)
    assert n & (n - 1) == 0 and per_head / 2 < n <= per_head
    assert SM.reference_len(SM.MemorizePlan(reference_tokens=7), s) == 7
    with pytest.raises(ValueError, match="reference_tokens=0"):
        SM.MemorizePlan(reference_tokens=0)


def test_reader_facts_must_be_apart_from_the_written_ones():
    written = SM.read_records(SM.FACTS_PATH)
    readers = SM.read_records(SM.READER_FACTS_PATH)
    MR.check_apart(written, readers, "shipped")  # the shipped files are apart
    same = {**readers[0], "subject": written[0]["subject"].upper()}  # case aside, the same person
    with pytest.raises(ValueError, match=rf"reader fact f1000 shares its subject \('{same['subject']}'\)"):
        MR.check_apart(written, [same], "x")
    twin = {**readers[0], "prompt": written[3]["prompt"]}
    with pytest.raises(ValueError, match="shares its prompt"):
        MR.check_apart(written, [twin], "x")


def test_held_out_positions_before_the_first_patched_row_are_bit_equal(study, folder, corpus):
    """The count is the positions before each block's first hit, recomputed here from the patch file."""
    out, r = study
    s = MM.hf_subject(
        str(folder),
        "",
        (out / "memorize" / "corpus" / "held.txt").read_text(),
        PLAN.held_tokens,
        PLAN.block_len,
    )
    rec = next(x for x in r["runs"] if x["model"] == "hf" and x["arm"] == "patch" and x["n"] == 6)
    patch = load_patch(out / "runs" / f"memorize-{rec['key']}.patch.safetensors")
    hasher = s.layers(s.model).hasher
    hits = np.stack([patch_hits(hasher, patch, b.tolist()) for b in s.held])
    before = sum(int(np.argmax(h)) if h.any() else len(h) for h in hits)
    loc = rec["locality"]
    assert loc["tokens"] == s.held.numel() and loc["hits"] == int(hits.sum())
    assert loc["before_first_hit"] == before == loc["bit_equal"]
    assert 0 < before < s.held.numel()  # some blocks read the patch, and some positions come before
    assert loc["hits_per_1000"] == pytest.approx(1000 * hits.sum() / hits.size)


def test_in_prompt_questions_hold_the_fact(study, folder, monkeypatch):
    out, _ = study
    rec = SM.read_records(SM.FACTS_PATH)[SM.fact_subset(1000, 3, 0)[0]]
    ctx = SM.in_prompt(rec)
    assert ctx == f"{rec['prompt']}{rec['target']}. "
    seen: list[str] = []
    real = MA.question

    def spy(r, q=None, prefix=""):
        f = real(r, q, prefix)
        seen.append(f.prompt)
        return f

    monkeypatch.setattr(MA, "question", spy)
    s = MM.hf_subject(str(folder), "", (out / "memorize" / "corpus" / "held.txt").read_text(), 512, 64)
    MA.answers(s, s.model, [rec], MA.in_prompt)
    assert seen == [ctx + q["prompt"] for q in [rec, *rec["paraphrases"], rec["indirect"]]]


def test_a_second_run_trains_and_measures_nothing(study, folder, corpus, demo_cfg, monkeypatch):
    out, r = study
    # every arm but none, and LoRA's other pilot lr at 3 facts; the pilot's: both lrs, both ranks
    assert r["new_runs"] == 2 * 2 * 7 + 2 * 2 and r["new_pilot_runs"] == 2 * 2 * 2
    for name in ("memorize", "fit", "answers", "locality", "position_losses", "reader_model"):
        monkeypatch.setattr(SM, name, lambda *a, **kw: pytest.fail("measured again"))
    again = _study(out, folder, corpus, demo_cfg)
    assert again["new_runs"] == 0 and again["new_pilot_runs"] == 0
    assert [x["metrics"] for x in again["runs"]] == [x["metrics"] for x in r["runs"]]


def test_without_model_the_pretrained_studys_engram_run_is_taken(
    study, folder, corpus, tmp_path, monkeypatch
):
    """No --model: `engram study pretrained`'s Engram-alone run (its first seed) under OUT; --no-demo
    skips the demo LM, with a note. The patch learns each fact with its subject (its rows' trigger)."""
    learnt = []
    real = SM.memorize

    def spy(model, tok, facts, *a, **kw):
        learnt.extend(facts)
        return real(model, tok, facts, *a, **kw)

    monkeypatch.setattr(SM, "memorize", spy)
    key = "0123abcd"
    shutil.copytree(folder, tmp_path / "runs" / key)
    (tmp_path / "runs" / key / "engram_train.json").write_text("{}")
    (tmp_path / "pretrained").mkdir()
    runs = [{"arm": "LoRA", "seed": 0, "key": "x"}, {"arm": "Engram", "seed": 0, "key": key}]
    (tmp_path / "pretrained" / "results.json").write_text(json.dumps({"runs": runs}))
    r = SM.run_memorize_study(
        tmp_path, demo=False, seeds=(0,), plan=SM.MemorizePlan(facts=(2,), steps=1, lora_lrs=(1e-3,),
        layer_lrs=(1e-4,), held_tokens=128, block_len=64, reader_facts=0), corpus=corpus, progress=False, threads=1, say=lambda m: None,
    )  # fmt: skip
    assert r["models"][0]["source"] == str(tmp_path / "runs" / key)
    assert "pretrained" in r["models"][0]["how"] and len(r["models"]) == 1
    assert r["skipped"] and "--no-demo" in (tmp_path / "memorize" / "report.md").read_text()
    assert any(x.startswith("reader-patch") for x in r["skipped"])  # reader_facts 0: left out, said
    assert len(learnt) == 2 and all(f.subject and f.subject in f.prompt for f in learnt)


def test_cli_refusals(folder, tmp_path, capsys):
    def refused(*argv: str) -> str:
        assert main(["study", *argv, "--out", str(tmp_path), "--no-progress", *CPU]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        return err

    assert "drop --demo-run" in refused("memory", "--quick", "--demo-run", str(tmp_path))
    assert "drop --facts" in refused("pretrained", "--quick", "--facts", "3")
    assert "drop --rows-per-fact" in refused("memory", "--quick", "--rows-per-fact", "32")
    with pytest.raises(SystemExit):  # argparse's refusal: usage, then the line naming the value
        main(["study", "memorize", "--facts", "3,x", "--out", str(tmp_path)])
    assert "argument --facts: '3,x': give whole numbers >= 1" in capsys.readouterr().err
    assert "holds 1000 facts" in refused("memorize", "--quick", "--facts", "2000", "--model", str(folder))
    assert "drop --size" in refused("memorize", "--quick", "--size", "tiny")
    assert "no such folder" in refused("memorize", "--quick", "--model", str(tmp_path / "none"))
    assert "'lora' is not an arm" in refused(
        "memorize", "--quick", "--arms", "patch,lora", "--model", str(folder)
    )
    assert "drop --arms" in refused("memory", "--quick", "--arms", "patch")
    assert "drop --report-only" in refused("memory", "--quick", "--report-only")


def test_report_only_reports_the_runs_made_and_lists_the_rest(study, folder, corpus, demo_cfg):
    """report_only with a size never run: the runs made are reported as they were, the others listed."""
    out, full = study
    plan = SM.MemorizePlan(**{**PLAN.__dict__, "facts": (3, 6, 7)})
    r = _study(out, folder, corpus, demo_cfg, plan=plan, report_only=True)
    assert r["new_runs"] == 0 and {x["n"] for x in r["runs"] if x["arm"] != "none"} == {3, 6}
    want = {(x["model"], x["n"], x["arm"]): x["metrics"] for x in full["runs"]}
    assert all(x["metrics"] == want[x["model"], x["n"], x["arm"]] for x in r["runs"] if x["n"] != 7)
    assert any(
        s.startswith("14 runs not made yet (report only): tiny-engram, patch, 7 facts, seed 0, lr 1;")
        for s in r["skipped"]
    )


def test_a_subset_of_arms_runs_those_alone(study, folder, corpus, demo_cfg):
    """--arms patch,in-prompt: those and none, from the full run's cache (nothing trained again)."""
    out, full = study
    r = _study(
        out,
        folder,
        corpus,
        demo_cfg,
        plan=SM.MemorizePlan(**{**PLAN.__dict__, "arms": ("in-prompt", "patch")}),
    )
    assert r["arms"] == ["none", "patch", "in-prompt"] and r["new_runs"] == 0 and r["pilot"] == []
    assert {x["arm"] for x in r["runs"]} == {"none", "patch", "in-prompt"}
    want = {(x["model"], x["n"], x["arm"]): x["metrics"] for x in full["runs"]}
    assert all(x["metrics"] == want[x["model"], x["n"], x["arm"]] for x in r["runs"])


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_a_plain_folder_gets_engram_trained_as_the_pretrained_arm(corpus, tmp_path):
    """--model a plain folder: Engram trained first (`study pretrained`'s quick plan), once."""
    plain = S.save_folder(tmp_path / "plain", layers=3, seed=1)
    plan = SM.MemorizePlan(
        facts=(2,),
        steps=1,
        lora_lrs=(1e-3,),
        layer_lrs=(1e-4,),
        held_tokens=128,
        block_len=64,
        arms=("patch",),
    )
    kw = {"model": str(plain), "demo": False, "seeds": (0,), "plan": plan, "quick": True, "corpus": corpus}
    r = SM.run_memorize_study(tmp_path / "out", progress=False, threads=1, say=lambda m: None, **kw)
    src = Path(r["models"][0]["source"])
    assert src.parent == tmp_path / "out" / "runs" and src.name.startswith("memorize-engram-")
    assert (src / "engram").is_dir() and "trained on" in r["models"][0]["how"]
    again = SM.run_memorize_study(tmp_path / "out", progress=False, threads=1, say=lambda m: None, **kw)
    assert again["models"][0]["source"] == str(src) and again["new_runs"] == 0


def test_the_patch_arms_rows_a_fact_default_to_memorizes_and_are_checked():
    assert SM.MemorizePlan().patch_rows == 32 == SM.MemorizeSettings.rows_per_fact
    with pytest.raises(ValueError, match="patch_rows"):
        SM.MemorizePlan(patch_rows=0)
    assert SM.MemorizePlan(patch_rows=None).patch_rows is None  # every chosen row


def test_facts_subsets_nest_and_differ_by_seed():
    a, b = SM.fact_subset(1000, 10, 0), SM.fact_subset(1000, 100, 0)
    assert b[:10] == a and len(set(b)) == 100 and SM.fact_subset(1000, 10, 1) != a
    assert SM.memorize_plan(quick=True, steps=3, facts=[100, 10]).facts == (10, 100)


def test_a_single_seed_shows_no_spread_and_is_noted():
    """Sizes run with one seed of several (the 1,000 facts of a study run in pieces): the mean alone."""
    from engram.apps.study.memorize_report import LOCALITY, summarize, table_lines

    def run(arm: str, seed: int, recall: float) -> dict:
        m = {k: 0.5 for k, *_ in METRICS} | {"direct_recall": recall}
        loc = {k: 1.0 for k in LOCALITY if k != "own_delta"} | {"held_out_loss": 3.0, "base_loss": 2.5}
        return {"model": "hf", "n": 9, "arm": arm, "seed": seed, "lr": None, "metrics": m, "locality": loc}

    results = {
        "models": [{"key": "hf", "name": "tiny"}],
        "plan": {"facts": [9]},
        "arms": ["patch", "lora-r1"],
        "seeds": [0, 1],
        "pilot": [],
        "runs": [run("patch", 0, 0.25), run("lora-r1", 0, 0.5), run("lora-r1", 1, 0.75)],
    }
    results.update(summarize(results))
    rows = "\n".join(table_lines(results, "hf"))
    assert "| 9 | patch | - | 0.250 |" in rows and "| 9 | lora-r1 | - | 0.625 ± 0.177 |" in rows
    patch = next(s for s in results["summary"] if s["arm"] == "patch")
    assert patch["locality"]["own_delta"] == {"mean": 0.5, "spread": None}
    assert (
        "tiny, 9 facts, patch: one seed at this size, so any difference counts there."
        in results["findings"]["notes"]
    )


def test_a_patch_runs_key_names_its_rows(study, folder, corpus, demo_cfg):
    """Other rows a fact are other runs (trained anew), whatever memorize's default is."""
    out, _ = study
    plan = SM.MemorizePlan(**{**PLAN.__dict__, "arms": ("patch",), "patch_rows": 5})
    r = _study(out, folder, corpus, demo_cfg, plan=plan)
    assert r["new_runs"] == 2 * 2  # both models, both sizes
    again = _study(out, folder, corpus, demo_cfg, plan=plan)
    assert again["new_runs"] == 0


def test_a_patch_runs_key_does_not_hang_on_memorizes_default(study, folder, corpus, demo_cfg, monkeypatch):
    """The full run's patch runs are found again with memorize's default set otherwise."""
    out, _ = study
    monkeypatch.setattr(SM.MemorizeSettings, "rows_per_fact", 16)
    plan = SM.MemorizePlan(**{**PLAN.__dict__, "arms": ("patch", "reader-patch")})
    assert _study(out, folder, corpus, demo_cfg, plan=plan)["new_runs"] == 0


def test_report_only_lists_the_runs_whose_pilot_is_not_made(study, folder, corpus, demo_cfg):
    """A new lr in LoRA's grid: its pilot run is not made, so LoRA's lr is not known; report only
    trains nothing and lists LoRA's runs, and reports the other arms."""
    out, _ = study
    plan = SM.MemorizePlan(**{**PLAN.__dict__, "lora_lrs": (1e-3, 3e-3, 1e-2)})
    r = _study(out, folder, corpus, demo_cfg, plan=plan, report_only=True)
    assert r["new_runs"] == 0 and r["pilot"] == []
    assert not any(x["arm"].startswith("lora") for x in r["runs"])
    assert {x["arm"] for x in r["runs"]} == set(SM.ARMS) - {"lora-r1", "lora-r8"}
    (line,) = [s for s in r["skipped"] if "not made yet" in s]
    assert (
        line.startswith("8 runs not made yet") and "tiny-engram, lora-r1, 3 facts, seed 0, lr 0.01;" in line
    )
    assert "lora-r1, 6 facts, seed 0 (its lr: the pilot's)" in line
