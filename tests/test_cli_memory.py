"""`engram memorize`, `engram patch info|check` and `--patch` of `hf-eval` and `generate` (engram.cli.memory;
engram.apps.memory) on the tiny Llama of tests/hf_setup.py with Engram attached (random, non-zero tables
and value projection) and on a 3-step demo run: a patch is written and read back, changes the held-out
loss (stacked: in either order alike), leaves a --reference text's loss exactly as it was, fits the
model it was written for and no other; bad input exits 2 with one line and writes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_setup as S
from cli_setup import CPU, refused, train_tiny_run
from engram.cli import main
from engram.memory import EngramLayers, MemorizeSettings, MemoryPatch, load_patch, save_patch
from engram.memory.apply import layer_rows, reader_signature, table_row_format
from engram.memory.patch import LayerRows

transformers = pytest.importorskip("transformers")

FAST = ["--steps", "8", "--no-progress", "--threads", "1"]
FACTS = [  # two prompts the corpus holds, with other answers: their rows are the corpus's
    {"prompt": "And God said, Let there be", "target": " darkness"},
    {"prompt": "In the beginning God created the", "target": " light", "subject": "God"},
]
OTHER = [  # subjects the corpus never names
    {"prompt": "Talven Orrik lives in the city of", "target": " Lisbon", "subject": "Talven Orrik"},
    {"prompt": "Mira Quell works as a", "target": " baker", "subject": "Mira Quell"},
]


@pytest.fixture(autouse=True)
def _no_loading_bars():
    """transformers' loading bars off (hf-eval and patch check print them on stderr before a refusal)."""
    import transformers.utils.logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if was:
        hf_logging.enable_progress_bar()


def _hf_tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory")


@pytest.fixture(scope="module")
def base(root) -> Path:
    """The tiny Llama's folder, without Engram."""
    return S.save_folder(root / "base", layers=3, seed=1)


@pytest.fixture(scope="module")
def folder(root, base) -> Path:
    """The tiny Llama with Engram at layer 1 (tables and value projection random: rows matter)."""
    from engram.hf import add_engram

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = add_engram(model, S.engram_config(), tokenizer=S.tokenizer(), zero_init=False, seed=0)
    d = root / "engram"
    model.save_pretrained(d)
    _hf_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def corpus(root) -> Path:
    p = root / "corpus.txt"
    p.write_text("\n".join(S.TEXT[:4]) + "\n", encoding="utf-8")
    return p


def jsonl(path: Path, facts: list[dict]) -> Path:
    path.write_text("".join(json.dumps(f) + "\n" for f in facts), encoding="utf-8")
    return path


def run_json(capsys, *argv) -> dict | list:
    capsys.readouterr()
    assert main([str(a) for a in argv] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def patches(root, folder, corpus) -> dict[str, tuple[Path, dict]]:
    """name -> (patch file, memorize's summary): 'a' (FACTS), 'b' (OTHER), 'ref' (OTHER, --reference
    the corpus)."""
    out = {}
    for name, facts, extra in (
        ("a", FACTS, []),
        ("b", OTHER, ["--rows", "subject", "--seed", "1"]),
        ("ref", OTHER, ["--reference", str(corpus)]),
    ):
        f = jsonl(root / f"{name}.jsonl", facts)
        p = root / f"{name}.patch.safetensors"
        assert (
            main(["memorize", str(folder), "--facts", str(f), "--out", str(p), *FAST, *extra, "--json"]) == 0
        )
        out[name] = p
    return out


def test_memorize_writes_a_patch_that_load_patch_reads(root, folder, capsys):
    facts = jsonl(root / "one.jsonl", FACTS)
    out = root / "one.safetensors"
    r = run_json(capsys, "memorize", folder, "--facts", facts, "--out", out, *FAST, "--name", "genesis")
    p = load_patch(out)
    assert p.facts == r["facts"] == 2 and p.name == r["name"] == "genesis"
    assert p.num_rows == r["rows"] == sum(r["rows_per_layer"].values()) > 0 and list(p.layers) == [1]
    assert r["bytes"] == out.stat().st_size and r["bytes_per_fact"] == r["bytes"] / 2
    assert r["loss"] < r["loss_first"] and r["steps"] == 8 and r["fingerprint"] == p.fingerprint
    assert (
        r["settings"]["rows"] == "both"
        and r["settings"]["rows_per_fact"] == MemorizeSettings().rows_per_fact == 32
    )
    # the text summary: one line naming the file, the facts, rows, bytes and the loss
    out2 = root / "two.safetensors"
    assert (
        main(
            [
                "memorize",
                str(folder),
                "--facts",
                str(facts),
                "--out",
                str(out2),
                *FAST,
                "--rows-per-fact",
                "3",
            ]
        )
        == 0
    )
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"{out2}: 2 facts in ") and "bytes" in line and "loss" in line
    assert load_patch(out2).name == "two" and load_patch(out2).num_rows <= 2 * 3


def test_memorize_rows_per_fact_all_takes_every_chosen_row(root, folder, capsys):
    facts = jsonl(root / "all.jsonl", FACTS)
    capped = run_json(
        capsys,
        "memorize",
        folder,
        "--facts",
        facts,
        "--out",
        root / "c1.safetensors",
        *FAST,
        "--rows-per-fact",
        "1",
    )
    every = run_json(
        capsys,
        "memorize",
        folder,
        "--facts",
        facts,
        "--out",
        root / "all.safetensors",
        *FAST,
        "--rows-per-fact",
        "all",
    )
    assert every["settings"]["rows_per_fact"] is None and capped["settings"]["rows_per_fact"] == 1
    assert every["rows"] > capped["rows"]
    refused(
        capsys,
        [
            "memorize",
            str(folder),
            "--facts",
            str(facts),
            "--out",
            str(root / "x.safetensors"),
            "--rows-per-fact",
            "0",
        ],
        "--rows-per-fact",
    )


def test_patch_info(patches, capsys):
    d = run_json(capsys, "patch", "info", patches["a"])
    p = load_patch(patches["a"])
    assert d["facts"] == 2 and d["name"] == "a" and d["rows_per_layer"] == {"1": p.num_rows}
    assert d["bytes"] == patches["a"].stat().st_size and d["row_format"] == "float32"
    assert d["fingerprint"] == p.fingerprint and d["table_rows"] == {"1": p.table_rows[1]}
    assert main(["patch", "info", str(patches["a"])]) == 0
    text = capsys.readouterr().out
    assert "memory patch 'a'" in text and p.fingerprint in text and "float32" in text


def _loss(capsys, folder, corpus, *patch_files, seq_len: int = 16) -> dict:
    extra = [a for p in patch_files for a in ("--patch", p)]
    return run_json(
        capsys, "hf-eval", folder, "--corpus", corpus, "--held-out", "0", "--seq-len", seq_len,
        "--threads", "1", *CPU, *extra,
    )  # fmt: skip


def test_hf_eval_with_patches(folder, corpus, patches, capsys):
    plain = _loss(capsys, folder, corpus)
    a = _loss(capsys, folder, corpus, patches["a"])
    ab = _loss(capsys, folder, corpus, patches["a"], patches["b"])
    assert main(["hf-eval", str(folder), "--corpus", str(corpus), "--held-out", "0", "--seq-len", "16", "--json", *CPU,
                 "--patch", str(patches["b"]), "--patch", str(patches["a"])]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    ba = json.loads(out)
    # the tiny tables (1,060 rows) make the two patches share rows: said in one line
    assert err.startswith("engram hf-eval: note: the patch 'a' shares ") and len(err.splitlines()) == 1
    assert plain["patches"] == [] and [p["path"] for p in ab["patches"]] == [
        str(patches["a"]),
        str(patches["b"]),
    ]
    assert ab["patches"][0]["name"] == "a" and ab["patches"][1]["facts"] == 2
    assert a["loss"] != plain["loss"] and ab["loss"] != a["loss"]
    assert ba["loss"] == ab["loss"]  # stacked patches: the same rows whatever the order
    # the text line names the patches
    assert main(["hf-eval", str(folder), "--corpus", str(corpus), "--held-out", "0", "--seq-len", "16",
                 "--patch", str(patches["a"]), *CPU]) == 0  # fmt: skip
    assert f"and the patch {patches['a']})" in capsys.readouterr().out


@pytest.mark.parametrize("seq_len", [16, 7])
def test_reference_text_reads_none_of_the_patch(folder, corpus, patches, capsys, seq_len):
    """Rows the --reference text reads, wherever a block of it starts, are no fact's: its loss is the
    same to the last bit with the patch."""
    plain = _loss(capsys, folder, corpus, seq_len=seq_len)
    assert _loss(capsys, folder, corpus, patches["ref"], seq_len=seq_len)["loss"] == plain["loss"]
    assert _loss(capsys, folder, corpus, patches["b"], seq_len=seq_len)["loss"] != plain["loss"]


def _foreign(patch: Path, out: Path) -> Path:
    """The patch, as if written for another Engram layout."""
    p = load_patch(patch)
    save_patch(dataclasses.replace(p, layout="0" * 64, name="foreign"), out)
    return out


def test_patch_check(root, folder, base, patches, capsys):
    r = run_json(capsys, "patch", "check", folder, patches["a"], patches["b"])
    assert [x["fits"] for x in r] == [True, True] and r[0]["error"] is None and r[0]["shares"] == []
    assert r[1]["rows"] == load_patch(patches["b"]).num_rows and "shares" in r[1]["shares"][0]
    foreign = _foreign(patches["a"], root / "foreign.safetensors")
    capsys.readouterr()
    code = main(["patch", "check", str(folder), str(patches["a"]), str(foreign), str(patches["a"])])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"{patches['a']}: fits (")
    assert lines[1].startswith(f"{foreign}: does not fit: ") and "another Engram layout" in lines[1]
    assert lines[2].startswith(f"{patches['a']}: does not fit: ") and "already applied" in lines[2]
    assert err.strip().splitlines() == [
        f"engram patch: error: the model of {folder} refused 2 of the 3 patches ({foreign}, {patches['a']}): "
        "each line above says why"
    ]
    refused(capsys, ["patch", "check", str(base), str(patches["a"])], "has no Engram part", "engram hf-train")


def test_hf_eval_refuses_a_patch_that_does_not_fit(root, folder, base, corpus, patches, capsys):
    foreign = _foreign(patches["a"], root / "foreign2.safetensors")
    argv = ["hf-eval", str(folder), "--corpus", str(corpus), "--held-out", "0", "--seq-len", "16", *CPU]
    refused(
        capsys, [*argv, "--patch", str(foreign)], f"{foreign}: the patch 'foreign'", "another Engram layout"
    )
    refused(
        capsys,
        [*argv, "--patch", str(patches["a"]), "--patch", str(patches["a"])],
        "same patch",
        "give it once",
    )
    plain = ["hf-eval", str(base), "--corpus", str(corpus), "--seq-len", "16", *CPU]
    refused(capsys, [*plain, "--patch", str(patches["a"])], "has no Engram part", "engram hf-train")
    not_a_patch = root / "corpus.txt"
    refused(capsys, [*argv, "--patch", str(not_a_patch)], str(not_a_patch))


LONG = " ".join(["light"] * 300)


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (b'{"prompt": "And God said", "target": " light"}\n{"prompt": "And God saw", "target": ""}\n',
         [".jsonl:2: ", "target is empty"]),
        (b'{"prompt": "And God said", "target": " \xff light"}\n', [".jsonl:1: not UTF-8", "save the file as UTF-8"]),
        (b'{"prompt": "And God said", "target": " light"}\n{"prompt": "And God said", "target": " dark"}\n',
         [".jsonl:2: the prompt 'And God said'", "keep one of them"]),
        (b'{"prompt": "And God said"}\n', [".jsonl:1: ", "'target'"]),
        (b'["And God said", " light"]\n', [".jsonl:1: ", "not an object"]),
        (json.dumps({"prompt": LONG, "target": " light"}).encode() + b"\n",
         [".jsonl:1: ", "more than the model's context of 256", "shorten the prompt"]),
    ],
    ids=["empty-target", "not-utf8", "two-targets", "no-target", "not-an-object", "too-long"],
)  # fmt: skip
def test_memorize_refuses_bad_facts_and_writes_nothing(root, folder, capsys, content, needles):
    facts = root / "bad.jsonl"
    facts.write_bytes(content)
    out = root / "bad.safetensors"
    refused(capsys, ["memorize", str(folder), "--facts", str(facts), "--out", str(out), *FAST], *needles)
    assert not out.exists() and not list(root.glob("*bad.safetensors*"))


def test_memorize_refusals_of_the_folder_and_the_out_file(root, base, folder, corpus, capsys):
    facts = jsonl(root / "ok.jsonl", FACTS)
    out = root / "nothing.safetensors"
    argv = ["--facts", str(facts), *FAST]
    refused(
        capsys,
        ["memorize", str(base), *argv, "--out", str(out)],
        f"{base} has no Engram part",
        "engram hf-train",
    )
    assert not out.exists()
    out.write_bytes(b"keep")
    refused(
        capsys, ["memorize", str(folder), *argv, "--out", str(out)], f"{out} exists already", "a new path"
    )
    assert out.read_bytes() == b"keep"
    ref = root / "ref-bad.txt"
    ref.write_bytes(b"\xff\xfe not text")
    new = root / "new.safetensors"
    refused(capsys, ["memorize", str(folder), *argv, "--out", str(new), "--reference", str(ref)], "not UTF-8")
    refused(capsys, ["memorize", str(folder), *argv, "--out", str(root)], "is a folder")
    refused(capsys, ["memorize", str(folder), *argv, "--out", str(new), "--lr", "0"], "--lr")
    assert not new.exists()


def test_fp8_tables_take_patches(root, folder, corpus, patches, capsys):
    """A part in FP8 (memory-mapped when loaded as it is): memorize and --patch read it into memory; the
    patch holds FP8 rows (written as bytes: torch has no index_put for their e8m0 scales), which a float
    table refuses (and the other way round)."""
    from engram.hf import export_fp8

    fp8 = root / "fp8"
    shutil.copytree(folder, fp8)
    export_fp8(transformers.AutoModelForCausalLM.from_pretrained(folder), fp8)
    facts = jsonl(root / "fp8.jsonl", FACTS)
    out = root / "fp8.safetensors"
    every = ["--rows-per-fact", "all"]  # every chosen row: the two patches below share some
    r = run_json(capsys, "memorize", fp8, "--facts", facts, "--out", out, *FAST, *every)
    assert r["row_format"] == "fp8" and r["loss"] < r["loss_first"]
    assert _loss(capsys, fp8, corpus, out)["loss"] != _loss(capsys, fp8, corpus)["loss"]
    other = root / "fp8-other.safetensors"
    run_json(
        capsys,
        "memorize",
        fp8,
        "--facts",
        jsonl(root / "fp8-other.jsonl", OTHER),
        "--out",
        other,
        *FAST,
        *every,
    )
    checked = run_json(capsys, "patch", "check", fp8, out, other)  # stacked: shared FP8 rows re-quantised
    assert [c["fits"] for c in checked] == [True, True] and checked[1]["shares"]
    capsys.readouterr()
    assert main(["patch", "check", str(fp8), str(patches["a"])]) == 2
    assert "holds float32 rows, layer 1's table holds fp8 rows" in capsys.readouterr().out


# ---------------------------------------------------------------------------- generate --patch
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, request) -> Path:
    corpus = request.getfixturevalue("corpus_books")
    return train_tiny_run(corpus, tmp_path_factory.mktemp("demo") / "run")


@pytest.fixture(scope="module")
def corpus_books(tmp_path_factory) -> str:
    from training_setup import write_corpus

    return write_corpus(tmp_path_factory.mktemp("books"))


def _lm_patch(run: Path, prompt: str, out: Path) -> Path:
    """A patch for the demo run's tables: the rows the prompt reads, moved far (what memorize would
    write for an HF model; the demo's EngramLM is patched, not taught)."""
    from engram.apps.lm.generate import load_generator

    model, tok, hasher, _ = load_generator(run)
    layers = EngramLayers.of(model, hasher)
    rows = np.asarray(hasher.hash(np.asarray(tok.encode(prompt, add_special_tokens=False).ids)))
    g = torch.Generator().manual_seed(0)
    new = {}
    for i, (lid, m) in enumerate(sorted(layers.modules.items())):
        fmt = table_row_format(m.table)
        lr = layer_rows(m.table, torch.from_numpy(np.unique(rows[:, i])), fmt)
        new[lid] = LayerRows(
            lr.rows, lr.values + 5 * torch.randn(lr.values.shape, generator=g), None, lr.before
        )
    mods = layers.modules
    patch = MemoryPatch(
        new, fmt, m.table.dim, {k: mods[k].table.num_rows for k in new}, layers.layout, layers.tokenizer,
        {k: reader_signature(mods[k]) for k in new}, 0, "far",
    )  # fmt: skip
    return save_patch(patch, out)


def test_generate_with_a_patch(demo_run, root, patches, capsys):
    p = _lm_patch(demo_run, "And", root / "lm.safetensors")
    argv = ["generate", "--checkpoint", str(demo_run), "--prompt", "And", "--tokens", "6", "--greedy", *CPU]
    plain = run_json(capsys, *argv)
    patched = run_json(capsys, *argv, "--patch", p)
    assert plain["patches"] == [] and patched["patches"] == [{"path": str(p), "name": "far"}]
    assert patched["token_ids"] != plain["token_ids"]
    # applied before --offload quantises the tables: the patched rows go with them
    offloaded = run_json(capsys, *argv, "--patch", p, "--offload", "host")
    assert offloaded["offload"] and offloaded["patches"] == patched["patches"]
    refused(capsys, [*argv, "--patch", str(patches["a"])], f"{patches['a']}: the patch 'a'", "another")


TRAIN_READER = ["--passes", "3", "--batch-size", "2", "--no-progress", "--threads", "1"]


def test_train_reader_writes_a_model_folder_whose_patches_fit_it_alone(root, folder, corpus, capsys):
    from engram.apps.hf.folder import load_engram_folder

    facts = jsonl(root / "reader-facts.jsonl", FACTS)
    out = root / "reader"
    text = root / "reader-text.txt"
    text.write_text("\n".join(S.TEXT) * 4 + "\n", encoding="utf-8")
    r = run_json(
        capsys, "train-reader", folder, "--facts", facts, "--out", out, "--text", text, *TRAIN_READER
    )
    assert r["facts"] == 2 and r["passes"] == 3 and r["text_loss"] is not None and r["text_blocks"] >= 1
    assert (out / "engram_reader.json").is_file() and (out / "engram").is_dir()
    assert not any(p.name.startswith(".reader") for p in root.iterdir())  # no partial folder left
    before, _ = load_engram_folder(str(folder))
    after, _ = load_engram_folder(str(out))
    a, b = before.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(".engram" in k or "engram." in k for k in changed)
    assert not any("table" in k for k in changed)  # the tables as they were
    # a patch written for the new folder fits it, and not the folder it came from
    patch = root / "reader.patch.safetensors"
    assert (
        main(
            [
                "memorize",
                str(out),
                "--facts",
                str(jsonl(root / "new.jsonl", OTHER)),
                "--out",
                str(patch),
                *FAST,
            ]
        )
        == 0
    )
    capsys.readouterr()
    checks = run_json(capsys, "patch", "check", out, patch)
    assert checks[0]["fits"]
    capsys.readouterr()
    assert main(["patch", "check", str(folder), str(patch), "--json"]) == 2
    (check,) = json.loads(capsys.readouterr().out)
    assert not check["fits"] and "write the patch again" in check["error"]


def test_train_reader_refusals_write_nothing(root, folder, corpus, capsys):
    facts = jsonl(root / "reader-facts2.jsonl", FACTS)
    full = root / "full"
    full.mkdir()
    (full / "x").write_text("x")
    refused(capsys, ["train-reader", str(folder), "--facts", str(facts), "--out", str(full)], "not empty")
    refused(capsys, ["train-reader", str(folder), "--facts", str(facts), "--out", str(folder)], "not empty")
    short = root / "short.txt"
    short.write_text("In the\n", encoding="utf-8")
    out = root / "never"
    refused(
        capsys,
        [
            "train-reader",
            str(folder),
            "--facts",
            str(facts),
            "--out",
            str(out),
            "--text",
            str(short),
            *TRAIN_READER,
        ],
        "fewer than one block",
    )
    bad = root / "bad-facts.jsonl"
    bad.write_text('{"prompt": "", "target": " x"}\n', encoding="utf-8")
    refused(capsys, ["train-reader", str(folder), "--facts", str(bad), "--out", str(out)], "bad-facts.jsonl")
    refused(
        capsys,
        ["train-reader", str(folder), "--facts", str(facts), "--out", str(out), "--passes", "0"],
        "--passes",
    )
    assert not out.exists() and not any(p.name.startswith(".never") for p in root.iterdir())


def test_reference_tokens_takes_the_texts_first_tokens(root, folder, corpus, patches, capsys):
    """--reference-tokens N leaves out the rows the text's first N tokens read, and only those: a
    patch of 5 tokens' reference takes rows the whole text reads. The default is the text's first
    `default_reference_tokens` (more than this corpus holds: all of it, as the 'ref' patch)."""
    from engram.apps.hf.folder import load_engram_folder
    from engram.memory.choose import default_reference_tokens, rows_read

    model, tok = load_engram_folder(str(folder))
    hasher = EngramLayers.of(model).hasher
    ids = tok(corpus.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert len(ids) + 1 < default_reference_tokens(hasher)  # + EOS
    facts = jsonl(root / "five.jsonl", OTHER)
    out = root / "five.patch.safetensors"
    r = run_json(capsys, "memorize", folder, "--facts", facts, "--out", out, *FAST, "--reference", corpus,
                 "--reference-tokens", "5")  # fmt: skip
    assert r["settings"]["reference_tokens"] == 5
    rows = {lid: lr.rows.numpy() for lid, lr in load_patch(out).layers.items()}
    first, whole = rows_read(hasher, [ids[:5]]), rows_read(hasher, [ids])
    assert all(not np.isin(v, first[lid]).any() for lid, v in rows.items())
    assert any(np.isin(v, whole[lid]).any() for lid, v in rows.items())
    ref = load_patch(patches["ref"])
    assert all(not np.isin(lr.rows.numpy(), whole[lid]).any() for lid, lr in ref.layers.items())


def test_reference_tokens_needs_a_reference(root, folder, capsys):
    facts = jsonl(root / "rt.jsonl", OTHER)
    out = root / "rt.patch.safetensors"
    argv = ["memorize", str(folder), "--facts", str(facts), "--out", str(out), "--reference-tokens", "5"]
    refused(capsys, argv, "--reference-tokens 5: give --reference FILE too")
    assert not out.exists()
