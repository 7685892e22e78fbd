"""`engram hf-train` / `engram hf-eval` (engram.cli.hf; engram.apps.hf.train, hf_folder, hf_corpus) on
a tiny random Llama HF folder built here (hidden 32, 3 layers, the ~300-id BPE of tests/hf_setup.py)
and the first verses of the King James Bible: every mode trains and its loss drops, a resumed run
equals an uninterrupted one, `hf-eval` of OUT equals the run's own evaluation, bad input exits 2 with
one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import hf_setup as S
from cli_setup import CPU
from engram.apps.hf import corpus as hf_corpus
from engram.apps.hf import folder as hf_folder
from engram.apps.hf import train as H
from engram.apps.lm.corpus import kjv_path
from engram.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

VERSES = 160  # Genesis 1-6: 14.1K tokens of the test BPE, 440 blocks of 32, the last 22 held out
FAST = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM with its tokenizer, saved as an HF folder."""
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return S.save_folder(d, layers=3, seed=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "genesis.jsonl"
    with kjv_path().open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(VERSES)]
    p.write_text("".join(lines), encoding="utf-8")
    return p


def run(*argv: str) -> int:
    """`engram argv` (hf-train, hf-eval) in this process, on the CPU (cli_setup.CPU)."""
    return main([*(str(a) for a in argv), *CPU])


def train(folder: Path, corpus: Path, out: Path, *extra: str) -> dict:
    """Run hf-train; the run's summary (OUT/engram_train.json, what --json prints)."""
    assert run("hf-train", folder, "--corpus", corpus, "--out", out, *FAST, *extra) == 0
    return json.loads((out / hf_folder.RUN_FILE).read_text())


RESUMABLE = ("--steps", "5", "--checkpoint-every", "2", "--lr", "3e-3")


@pytest.fixture(scope="module")
def whole(folder, corpus, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """mode -> (OUT, summary) of an uninterrupted run with checkpoints (frozen, lora), made on first use."""
    done: dict[str, tuple[Path, dict]] = {}

    class Lazy(dict):
        def __missing__(self, mode):
            out = tmp_path_factory.mktemp(mode) / "out"
            done[mode] = (out, train(folder, corpus, out, *RESUMABLE, "--mode", mode))
            self[mode] = done[mode]
            return done[mode]

    return Lazy()


def test_frozen_trains_engram_only_and_eval_of_out_equals_the_run(folder, corpus, whole, capsys):
    out, r = whole["frozen"]
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"]
    assert (
        r["engram"]["layers"] == [1] and r["tokens"] == 5 * 4 * 32 and r["engram"]["rows_per_layer"] == 4096
    )
    assert r["engram"]["boundaries"] == "eos" and "restart after EOS" in (out / "README.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.md", "config.json", "engram", "engram_train.json", "generation_config.json",
         "model.safetensors", "modeling_engram.py", "tokenizer.json", "tokenizer_config.json"]
    )  # fmt: skip
    assert not H.partial_folder(out).exists()
    card = (out / "README.md").read_text()
    assert "layer(s) [1]" in card and "backbone frozen" in card and "Held-out loss" in card
    assert "`LlamaForCausalLM` from" in card and "load_engram" not in card
    import yaml  # the Hub's metadata block: what it indexes

    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "transformers" and meta["base_model"] == str(folder)
    assert {"engram", "engram-lm", "custom_code"} <= set(meta["tags"]) and meta["datasets"] == [corpus.name]
    (metrics,) = [x["metrics"] for x in meta["model-index"][0]["results"]]
    assert metrics[0] == {
        "type": "loss",
        "value": round(r["held_out"]["loss"], 6),
        "name": "Held-out loss (nats/token)",
    }
    # the backbone is unchanged: only Engram trained
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out)  # an Engram model: its part attached
    assert type(saved).__name__ == "EngramLlamaForCausalLM"
    backbone = {n: v for n, v in saved.state_dict().items() if not n.startswith("engram.")}
    for (n, a), b in zip(plain.state_dict().items(), backbone.values(), strict=True):
        assert torch.equal(a, b), n
    capsys.readouterr()
    assert run("hf-eval", out, "--corpus", corpus, "--json", "--threads", "1") == 0
    e = json.loads(capsys.readouterr().out)
    assert (
        e["engram"] and e["tokens"] == r["held_out"]["tokens"] and e["blocks"] == 22
    )  # 5% of 440 blocks of 32
    assert e["loss"] == pytest.approx(r["held_out"]["loss"], abs=1e-6)
    # the backbone alone: the loss before training (zero-init Engram left the model unchanged)
    assert run("hf-eval", folder, "--corpus", corpus, "--json", "--seq-len", "32") == 0
    b = json.loads(capsys.readouterr().out)
    assert not b["engram"] and b["loss"] == pytest.approx(r["held_out_before"]["loss"], abs=1e-6)
    assert run("hf-eval", folder, "--corpus", corpus, "--json", "--seq-len", "32", "--held-out", "0",
               "--max-blocks", "3") == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["tokens"] == 3 * 31  # the corpus's first 3 blocks


def _changed(folder: Path, out: Path) -> list[str]:
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    saved = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    return [n for n in plain if not torch.equal(plain[n], saved[n])]


def test_lora_trains_and_is_merged(folder, corpus, whole, capsys):
    out, r = whole["lora"]
    capsys.readouterr()
    assert run("hf-eval", out, "--corpus", corpus, "--json", "--threads", "1") == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(r["held_out"]["loss"], abs=1e-6)
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"] and r["lora_rank"] == 8
    changed = _changed(folder, out)
    assert any("q_proj" in n for n in changed) and not any("embed" in n for n in changed)
    assert (out / "engram").is_dir() and not (out / "adapter_config.json").exists()


def test_full_trains_every_parameter(folder, corpus, tmp_path, capsys):
    # --resume-if-possible with no earlier run: from the start, saying so
    r = train(
        folder,
        corpus,
        tmp_path / "out",
        "--tokens",
        "384",
        "--mode",
        "full",
        "--lr",
        "3e-3",
        "--resume-if-possible",
    )
    assert f"no earlier run for {tmp_path / 'out'}" in capsys.readouterr().err
    assert r["steps"] == 3 and r["tokens"] == 384  # --tokens: steps of 4 x 32
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"]
    assert "model.embed_tokens.weight" in _changed(folder, tmp_path / "out")


def test_no_engram_baseline_on_plain_text(folder, corpus, tmp_path):
    text = tmp_path / "genesis.txt"
    text.write_text("\n".join(json.loads(line)["text"] for line in corpus.read_text().splitlines()))
    r = train(folder, text, tmp_path / "out", "--steps", "3", "--mode", "lora", "--no-engram", "--lr", "3e-3")
    assert r["engram"] is None and not (tmp_path / "out" / "engram").exists()
    assert r["held_out"]["loss"] < r["held_out_before"]["loss"]


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_resume_equals_uninterrupted(folder, corpus, whole, tmp_path, capsys, monkeypatch, mode):
    args = (*RESUMABLE, "--mode", mode)
    out, r = whole[mode]
    step = transformers.Trainer.training_step

    def interrupt(self, *a, **kw):
        if self.state.global_step == 3:  # after checkpoint-2, before checkpoint-4
            raise KeyboardInterrupt
        return step(self, *a, **kw)

    monkeypatch.setattr(transformers.Trainer, "training_step", interrupt)
    capsys.readouterr()
    assert run("hf-train", folder, "--corpus", corpus, "--out", tmp_path / "cut", *FAST, *args) == 130
    stopped = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.startswith("engram hf-train: stopped by Ctrl-C") and "--resume" in stopped, stopped
    monkeypatch.undo()
    assert not (tmp_path / "cut").exists()
    capsys.readouterr()
    assert run("hf-train", folder, "--corpus", corpus, "--out", tmp_path / "cut", *FAST, *args) == 2
    assert "pass --resume" in capsys.readouterr().err
    other = ("--steps", "5", "--checkpoint-every", "2", "--lr", "1e-3", "--mode", mode, "--resume")
    assert run("hf-train", folder, "--corpus", corpus, "--out", tmp_path / "cut", *FAST, *other) == 2
    assert "other settings (lr: 0.003)" in capsys.readouterr().err
    # --resume-if-possible where there is an earlier run: the same as --resume
    resumed = train(
        folder, corpus, tmp_path / "cut", *args, "--resume" if mode == "frozen" else "--resume-if-possible"
    )
    assert (
        f"resuming from {H.partial_folder(tmp_path / 'cut')}/checkpoints/checkpoint-2"
        in capsys.readouterr().err
    )
    assert resumed["steps"] == r["steps"] == 5
    assert resumed["held_out"]["loss"] == pytest.approx(r["held_out"]["loss"], abs=1e-6)
    a = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut").state_dict()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-5, msg=n)


def _refused(capsys, *argv) -> str:
    assert run(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_bad_input_refused_with_one_line(folder, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    base = ("hf-train", folder, "--out", out, *FAST)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert "is empty" in _refused(capsys, *base, "--corpus", empty)
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"abc\0def" * 10)
    assert "looks binary" in _refused(capsys, *base, "--corpus", binary)
    small = tmp_path / "small.txt"
    small.write_text("In the beginning God created the heaven and the earth.\n")
    assert "smaller than one batch" in _refused(capsys, *base, "--corpus", small)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert "line 2" in _refused(capsys, *base, "--corpus", bad_json)
    no_tok = tmp_path / "no-tokenizer"
    S.llama(layers=3).save_pretrained(no_tok)
    capsys.readouterr()  # transformers' progress bar
    assert "has no tokenizer" in _refused(capsys, "hf-train", no_tok, "--corpus", corpus, "--out", out, *FAST)
    (no_tok / "tokenizer.json").write_text("{damaged")
    assert "its tokenizer cannot be read" in _refused(capsys, "hf-eval", no_tok, "--corpus", corpus)
    (no_tok / "model.safetensors").unlink()
    assert "has no weights" in _refused(capsys, "hf-eval", no_tok, "--corpus", corpus)
    err = _refused(capsys, *base, "--corpus", corpus, "--layers", "1,3")
    assert "3 decoder layers (ids 0..2)" in err
    # within the row bound (64Gi = 2^36, MAX_LAYER_ROWS) but not this machine's memory (18 TB to train)
    err = _refused(capsys, "hf-train", folder, "--corpus", corpus, "--out", out, "--table-rows", "64Gi")
    assert "--table-rows" in err and "GB available" in err and "or fewer" in err
    (out / "x").parent.mkdir()
    (out / "x").write_text("x")
    assert "not empty" in _refused(capsys, *base, "--corpus", corpus)
    typo = tmp_path / "typo"  # --resume with no earlier run (a mistyped --out): refused, nothing written
    assert _refused(capsys, "hf-train", folder, "--corpus", corpus, "--out", typo, *FAST, "--resume") == (
        f"engram hf-train: error: --resume: no earlier run for {typo} (looked in {H.partial_folder(typo)}): "
        "check --out, or give --resume-if-possible to start afresh where there is none"
    )
    assert not typo.exists() and not H.partial_folder(typo).exists()
    assert "applies to --mode lora" in _refused(capsys, *base, "--corpus", corpus, "--lora-rank", "4")
    assert "--no-engram with --mode frozen" in _refused(
        capsys, "hf-train", folder, "--corpus", corpus, "--out", tmp_path / "o2", "--no-engram"
    )
    assert not H.partial_folder(out).exists() and not H.partial_folder(tmp_path / "o2").exists()
    assert "has no config.json" in _refused(capsys, "hf-eval", tmp_path, "--corpus", corpus)


def _broken(folder: Path, d: Path, damage: str) -> Path:
    """A copy of the tiny folder with one thing wrong (and an Engram part, for the links)."""
    import shutil

    from engram.hf import add_engram, save_engram

    shutil.copytree(folder, d)
    config = json.loads((d / "config.json").read_text())
    weights = d / "model.safetensors"
    kind, _, value = damage.partition("=")
    if kind in ("hidden_size", "num_hidden_layers"):  # the tiny model: hidden 32, 4 heads, 3 layers
        (d / "config.json").write_text(json.dumps({**config, kind: int(value)}))
    elif kind == "truncate":
        os.truncate(weights, weights.stat().st_size // 2 if value == "half" else weights.stat().st_size - 1)
    else:  # a file linked from outside the folder
        save_engram(add_engram(S.llama(layers=3), S.engram_config((1,)), compression=S.compression()), d)
        outside = d.parent / f"{d.name}-outside"
        outside.mkdir()
        shutil.move(d / kind, outside / kind)
        (d / kind).symlink_to(outside / kind)
    return d


BROKEN = {
    "hidden_size=30": r"config.json cannot be read by transformers \(The hidden size \(30\) is not a multiple of the "
    r"number of attention heads \(4\).\); restore the config.json",
    "hidden_size=48": r"model.safetensors: tensor 'lm_head.weight' is \[\d+, 32\], but config.json \(vocab_size \d+, "
    r"hidden_size 48, .*\) does not describe these weights: restore the config.json they were saved with",
    "num_hidden_layers=4": r"model.safetensors: no tensor 'model.layers.3.input_layernorm.weight' and 8 more of the "
    r"model, so transformers would draw them at random: config.json \(.*num_hidden_layers 4",
    "num_hidden_layers=2": r"model.safetensors: the weights hold model.layers.2, which the model lacks \(model.layers "
    r"0..1\), so transformers would drop them",
    "truncate=half": r"model.safetensors: not a readable safetensors file \(\d+ bytes; .*file not fully covered\): "
    r"truncated or damaged .*; re-copy or re-convert it",
    "truncate=1": r"model.safetensors: not a readable safetensors file \(\d+ bytes; .*not fully covered",
    "tokenizer.json": r"the model folder .* holds 'tokenizer.json', a symlink to .*-outside/tokenizer.json, outside the "
    r"checkpoint folder .*; a checkpoint reads only files inside its folder: copy it in",
    "engram": r"the model folder .* holds 'engram', a symlink to .*-outside/engram, outside the checkpoint folder",
}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_broken_model_folder_refused(folder, corpus, tmp_path, capsys, damage):
    """A model folder whose config.json does not fit its weights (hidden size not a multiple of the
    heads, another hidden size, more or fewer layers), whose model.safetensors is truncated (to half,
    by one byte), or that links a file from outside: `hf-train` and `hf-eval` printed a traceback
    ending in "internal error" (or read the linked file); now one line naming the file, the value and
    the fix, exit 2, before anything loads; nothing written."""
    import re

    d = _broken(folder, tmp_path / "model", damage)
    out = tmp_path / "out"
    for argv in (
        ("hf-train", d, "--corpus", corpus, "--out", out, *FAST),
        ("hf-eval", d, "--corpus", corpus, "--seq-len", "32"),
    ):
        err = _refused(capsys, *argv)
        assert re.search(BROKEN[damage], err), err
        assert err.startswith(f"engram {argv[0]}: error: ") and "internal error" not in err
    assert not out.exists() and not H.partial_folder(out).exists()


def test_hf_eval_refuses_a_damaged_part_and_warns_of_another_base(corpus, whole, tmp_path, capsys):
    """A flipped byte in OUT's Engram part (a wkv weight from -0.0003 to 22925.3, say) was evaluated
    without a word: refused by its CRC32, one line naming the file and tensor, exit 2. OUT's backbone
    replaced by another model of the same sizes: evaluated, with one warning line."""
    import shutil

    from engram.checkpoint.files import read_header

    out, _ = whole["frozen"]
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    shard = damaged / "engram" / "model-00001-of-00001.safetensors"
    n, header = read_header(shard)
    data = bytearray(shard.read_bytes())
    data[8 + n + header["layers.1.engram.wkv.weight"]["data_offsets"][0] + 3] ^= 0x40  # an exponent bit
    shard.write_bytes(bytes(data))
    err = _refused(capsys, "hf-eval", damaged, "--corpus", corpus, "--threads", "1")
    assert f"{shard}: tensor 'layers.1.engram.wkv.weight': its bytes do not match the CRC32" in err
    other = tmp_path / "other"
    shutil.copytree(out, other)
    S.llama(layers=3, seed=5).save_pretrained(tmp_path / "seed5")  # another backbone of the same sizes
    shutil.copy(tmp_path / "seed5" / "model.safetensors", other / "model.safetensors")  # the part kept
    capsys.readouterr()
    assert run("hf-eval", other, "--corpus", corpus, "--json", "--threads", "1") == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engram")]
    assert len(err) == 1 and err[0].startswith(
        f"engram hf-eval: warning: {other / 'engram'} was trained on another base"
    )


def test_seq_len_without_a_target_refused(folder, corpus, tmp_path, capsys):
    """--seq-len 1 trained on no target (final loss 0.0, a model written) with --held-out 0, and blamed
    the corpus's size with a held-out share: refused at the option, naming it; nothing written. The
    library refuses it too (a block of one token has no next-token loss)."""
    out = tmp_path / "out"
    for held in ("0", "0.05"):
        with pytest.raises(SystemExit) as e:
            run(
                "hf-train",
                folder,
                "--corpus",
                corpus,
                "--out",
                out,
                *FAST,
                "--seq-len",
                "1",
                "--held-out",
                held,
            )
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (
            "engram hf-train: error: argument --seq-len: 1 is out of range; give a whole number >= 2 "
            "(a block of one token has no next token to predict)"
        )
    with pytest.raises(SystemExit) as e:
        run("hf-eval", folder, "--corpus", corpus, "--seq-len", "1")
    assert e.value.code == 2 and "argument --seq-len: 1 is out of range" in capsys.readouterr().err
    assert not out.exists() and not H.partial_folder(out).exists()
    with pytest.raises(ValueError, match="--seq-len 1: a block of one token has no next token"):
        hf_folder.evaluate_folder(str(folder), str(corpus), seq_len=1)
    with pytest.raises(ValueError, match="--seq-len 1: a block of one token"):
        hf_corpus.split_blocks(list(range(10)), 1, 0.0)


def test_several_processes_need_distributed(folder, corpus, tmp_path, capsys, monkeypatch):
    """Under torchrun without --distributed (N copies would train side by side), --distributed without
    torchrun's environment, and the options across processes without --distributed: refused, naming the
    fix (the launch command); nothing written. The 2-rank runs: tests/test_cli_hf_train_dist.py."""
    base = ("hf-train", folder, "--corpus", corpus, "--out", tmp_path / "o", *FAST)
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _refused(capsys, *base)
    assert "runs in one process unless --distributed, but WORLD_SIZE=2" in err
    assert "torchrun --nproc_per_node N -m engram hf-train" in err
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    err = _refused(capsys, *base, "--distributed")
    assert "--distributed needs torchrun's environment, but RANK, WORLD_SIZE" in err and "hf-train" in err
    assert "--table-sync sharded applies across processes: add --distributed" in _refused(
        capsys, *base, "--table-sync", "sharded"
    )
    assert "--collective-timeout applies across processes" in _refused(
        capsys, *base, "--collective-timeout", "9"
    )
    assert not H.partial_folder(tmp_path / "o").exists() and not (tmp_path / "o").exists()


def test_global_batch_split_over_the_ranks():
    from engram.apps.hf.ranks import Ranks

    assert Ranks().per_rank_batch(5) == 5 and Ranks(1, 2, True).per_rank_batch(8) == 4
    with pytest.raises(ValueError, match=r"--batch-size 5 is the global batch, .* 2 processes .* multiple "
                       r"of 2 \(e.g. --batch-size 4\)$"):  # fmt: skip
        Ranks(0, 2, True).per_rank_batch(5)
    with pytest.raises(ValueError, match=r"--batch-size 3 .* \(e.g. --batch-size 4\), or start at most 3"):
        Ranks(0, 4, True).per_rank_batch(3)


def test_settings_are_checked():
    ok = {"folder": "f", "corpus": "c", "out": "o"}
    assert H.HFTrainSettings(**ok, mode="lora").mode is H.TrainMode.LORA
    for bad, match in (
        ({"mode": "half"}, "mode='half': give one of"),
        ({"batch_size": 0}, "--batch-size 0: give a whole number >= 1"),
        ({"steps": 2, "tokens": 100}, "--steps or --tokens, not both"),
        ({"lr": float("nan")}, "--lr nan: give a finite number > 0"),
        ({"seq_len": 1}, "--seq-len 1: a block of one token has no next token to predict"),
        ({"eval_blocks": -1}, "--eval-blocks -1"),
        ({"table_sync": "half"}, "--table-sync 'half': give one of sharded, replicated"),
        ({"table_sync": "sharded", "engram": False, "mode": "lora"}, "--table-sync describes Engram"),
    ):
        with pytest.raises(ValueError, match=match):
            H.HFTrainSettings(**ok, **bad)


def test_table_memory_is_estimated_before_allocating():
    assert H.table_bytes(1000, 2, 64) == 2 * 1000 * (8 * 64 + 8)
    H.check_table_memory(1000, 2, 64, available=H.table_bytes(1000, 2, 64))
    with pytest.raises(ValueError, match="give --table-rows 500 or fewer"):
        H.check_table_memory(1001, 2, 64, available=H.table_bytes(1000, 2, 64))


def test_defaults_follow_the_model():
    assert H.default_layers(30) == (1, 14) and H.default_layers(3) == (1,) and H.default_layers(1) == (0,)
    assert H.default_table_rows(135_000_000, 2, 64) == 527_343
    assert H.default_table_rows(30_000, 1, 32) == 4096


def test_split_is_deterministic_and_holds_out_the_end():
    train, held = hf_corpus.split_blocks(list(range(100)), 10, 0.2)
    assert train.shape == (8, 10) and held.shape == (2, 10) and held[0, 0] == 80
    assert hf_corpus.split_blocks(list(range(100)), 10, 0.0)[1].shape == (0, 10)
    assert os.fspath(H.partial_folder("a/b")) == os.path.join("a", ".b.engram-partial")
