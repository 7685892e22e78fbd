"""Hostile input to the `engram` command line: every case gets one line, exit status 2, no traceback.

Each test runs `engram.cli.main(argv)` in-process with a bad argument or a damaged file and checks
that the error line (argparse may print its usage lines before it) is `engram CMD: error: ...`,
names the bad value or file, and that nothing escaped as an exception. The trained checkpoint the
checkpoint cases damage is a 3-step tiny run, copied per test.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cli_setup import CPU, load_commands, refused, train_tiny_run
from engram.cli import main

NESTED = "[" * 100_000  # a JSON document too deep for Python's parser (RecursionError)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A finished 3-step run (with Engram, rows 32 wide so --offload can quantise them)."""
    return train_tiny_run(corpus, tmp_path_factory.mktemp("hostile") / "run")


@pytest.fixture
def run(trained, tmp_path) -> tuple[Path, Path]:
    """(a copy of the trained run folder, its one checkpoint folder) to damage."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    (ckpt,) = sorted((out / "checkpoints").glob("step-*"))
    return out, ckpt


@pytest.fixture
def tiny_tokenizer(trained) -> str:
    (ckpt,) = sorted((trained / "checkpoints").glob("step-*"))
    return str(ckpt / "tokenizer.json")


# ------------------------------------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_garbage_model_file(run, capsys, cmd):
    out, ckpt = run
    (ckpt / "model.safetensors").write_bytes(b"\x00\x01not safetensors at all" * 10)
    refused(capsys, load_commands(out)[cmd], "model.safetensors")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_without_step(run, capsys, cmd):
    out, ckpt = run
    state = json.loads((ckpt / "state.json").read_text())
    del state["step"]
    (ckpt / "state.json").write_text(json.dumps(state))
    refused(capsys, load_commands(out)[cmd], "state.json", "step")


@pytest.mark.parametrize(
    "step", [-5, "x", 10**12, True, 2.0], ids=["negative", "str", "huge", "bool", "float"]
)
@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_step_out_of_range(run, capsys, cmd, step):
    """eval printed "(step x)", resume went on "at step 1000000000000": a step is an int from 0 to the
    run's total steps (the fixture's run has 3), checked where all three read a checkpoint."""
    out, ckpt = run
    state = json.loads((ckpt / "state.json").read_text())
    state["step"] = step
    (ckpt / "state.json").write_text(json.dumps(state))
    refused(capsys, load_commands(out)[cmd], "state.json", f"step {step!r}", "train_config.steps=3")


LM_EDITS = {
    "dim": {"dim": 64},
    "hidden": {"mlp_hidden": 128},
    "layer ids": {"engram": {"layer_ids": [0]}},
    "table sizes": {"engram": {"engram_vocab_size": [600, 600]}},
}


@pytest.mark.parametrize("edit", list(LM_EDITS.values()), ids=list(LM_EDITS))
@pytest.mark.parametrize("cmd", [0, 2], ids=["eval", "train-resume"])
def test_state_lm_config_edited(run, capsys, cmd, edit):
    """Edits to lm_config that `engram eval` refuses, `--resume` refuses too (it used to ignore them)."""
    out, ckpt = run
    state = json.loads((ckpt / "state.json").read_text())
    lm = state["lm_config"]
    for key, value in edit.items():
        lm[key] = lm[key] | value if isinstance(value, dict) else value
    (ckpt / "state.json").write_text(json.dumps(state))
    refused(capsys, load_commands(out)[cmd], str(ckpt), "lm_config" if cmd == 2 else "")


@pytest.mark.parametrize("kind", ["garbage", "other", "size", "fifo"])
def test_resume_reads_the_checkpoints_tokenizer(run, capsys, kind):
    """`--resume` used to never read the checkpoint's tokenizer.json: now checked as generate checks it
    (a regular file tokenizers reads, of the model's ids) and held against the run's own tokenizer."""
    import os

    from tokenizers import Tokenizer, models

    out, ckpt = run
    tok = ckpt / "tokenizer.json"
    if kind == "garbage":
        tok.write_bytes(b"\x89PNG\r\n")
    elif kind == "other":  # the same ids, another normaliser: other tokens for the same text
        d = json.loads(tok.read_text())
        d["normalizer"] = {"type": "Lowercase"}
        tok.write_text(json.dumps(d))
    elif kind == "size":
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tok))
    else:
        tok.unlink()
        os.mkfifo(tok)  # opening it would block for good
    refused(capsys, load_commands(out)[2], str(ckpt), "tokenizer.json")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_too_deep(run, capsys, cmd):
    out, ckpt = run
    (ckpt / "state.json").write_text(NESTED)
    refused(capsys, load_commands(out)[cmd], "state.json")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_size_mismatch(run, capsys, cmd):
    out, ckpt = run
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("tok_emb.weight") or "emb" in k)
    tensors[name] = tensors[name][:-1].clone()  # one row short
    save_file(tensors, str(ckpt / "model.safetensors"))
    refused(capsys, load_commands(out)[cmd], "model.safetensors")


def test_safetensors_header_too_deep(run, capsys):
    out, ckpt = run
    header = NESTED.encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    refused(capsys, ["eval", "--checkpoint", str(out)], "model.safetensors")


# ------------------------------------------------------------------------------------------- JSON too deep
def test_layout_config_too_deep(tmp_path, capsys):
    conf = tmp_path / "config.json"
    conf.write_text(NESTED)
    refused(capsys, ["layout", "--config", str(conf)], str(conf))


def test_train_config_too_deep(tmp_path, capsys):
    conf = tmp_path / "train.json"
    conf.write_text(NESTED)
    refused(capsys, ["train", "--config", str(conf), "--out", str(tmp_path / "run")], str(conf))


def test_convert_config_too_deep(tmp_path, capsys):
    from engram.checkpoint.convert import make_scaled_v41_checkpoint

    src = tmp_path / "src"
    make_scaled_v41_checkpoint(src)
    (src / "config.json").write_text(NESTED)
    refused(capsys, ["convert", str(src), str(tmp_path / "dst")], "config.json")


def test_convert_index_too_deep(tmp_path, capsys):
    from engram.checkpoint.convert import make_scaled_v41_checkpoint
    from engram.checkpoint.v41 import INDEX_FILE

    src = tmp_path / "src"
    make_scaled_v41_checkpoint(src)
    (src / INDEX_FILE).write_text(NESTED)
    refused(capsys, ["convert", str(src), str(tmp_path / "dst")], INDEX_FILE)


# ------------------------------------------------------------------------------------------- a folder for a file
def test_layout_config_is_a_folder(tmp_path, capsys):
    refused(capsys, ["layout", "--config", str(tmp_path)], str(tmp_path))


def test_train_config_is_a_folder(tmp_path, capsys):
    refused(capsys, ["train", "--config", str(tmp_path), "--out", str(tmp_path / "run")], str(tmp_path))


def test_collisions_text_file_is_a_folder(tmp_path, capsys):
    refused(capsys, ["collisions", "--preset", "tiny", "--text-file", str(tmp_path)], str(tmp_path))


def test_index_entry_is_a_folder(tmp_path, capsys):
    from engram.checkpoint.convert import make_scaled_v41_checkpoint
    from engram.checkpoint.v41 import INDEX_FILE

    src = tmp_path / "src"
    make_scaled_v41_checkpoint(src, max_shard_bytes=100_000)
    index = json.loads((src / INDEX_FILE).read_text())
    (src / "sub").mkdir()
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "sub"
    (src / INDEX_FILE).write_text(json.dumps(index))
    refused(capsys, ["convert", str(src), str(tmp_path / "dst")], "sub")


def test_tokenizer_is_a_folder(tmp_path, capsys):
    refused(capsys, ["compress", "--tokenizer", str(tmp_path)], str(tmp_path))


# ------------------------------------------------------------------------------------------- bad values
def test_hash_id_too_large(capsys):
    refused(
        capsys,
        ["hash", "--preset", "tiny", "--ids", "1 99999999999999999999999"],
        "99999999999999999999999",
    )


def test_hash_id_not_a_number(capsys):
    refused(capsys, ["hash", "--preset", "tiny", "--ids", "1 x2"], "x2")


@pytest.mark.parametrize("cmd", ["compress", "hash"])
def test_binary_tokenizer(tmp_path, capsys, cmd):
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(bytes(range(256)) * 4)
    argv = ["compress", "--tokenizer", str(tok)]
    if cmd == "hash":
        argv = ["hash", "--preset", "tiny", "--tokenizer", str(tok), "--text", "hi"]
    refused(capsys, argv, str(tok))


def test_compress_save_missing_folder(tmp_path, capsys, tiny_tokenizer):
    target = tmp_path / "nope" / "map.safetensors"
    refused(
        capsys, ["compress", "--tokenizer", tiny_tokenizer, "--save", str(target)], str(tmp_path / "nope")
    )


def test_compress_save_to_a_folder(tmp_path, capsys, tiny_tokenizer):
    refused(capsys, ["compress", "--tokenizer", tiny_tokenizer, "--save", str(tmp_path)], str(tmp_path))


@pytest.mark.parametrize("top", ["-5", "0"])
def test_compress_top_not_positive(capsys, top):
    refused(capsys, ["compress", "--top", top], "--top", top)


# ------------------------------------------------------------------------------------------- outputs
def test_train_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["train", "--preset", "tiny", "--out", str(f)], str(f))


def test_convert_out_is_a_file(tmp_path, capsys):
    from engram.checkpoint.convert import make_scaled_v41_checkpoint

    src = tmp_path / "src"
    make_scaled_v41_checkpoint(src)
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["convert", str(src), str(f)], str(f))


def test_demo_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["demo", "--steps", "1", "--seeds", "1", "--out", str(f)], str(f))


def test_generate_offload_dir_is_a_file(trained, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2", *CPU,
            "--offload", "ssd", "--offload-dir", str(f)]  # fmt: skip
    refused(capsys, argv, str(f))


def test_generate_offload_dir_unwritable(trained, tmp_path, capsys, monkeypatch):
    import engram.systems.prefetch as prefetch

    folder = tmp_path / "ro"
    folder.mkdir()

    def denied(path, *a, **k):  # what a read-only folder gives (root ignores chmod, so it is simulated)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(prefetch, "save_tensors", denied)
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2", *CPU,
            "--offload", "ssd", "--offload-dir", str(folder)]  # fmt: skip
    refused(capsys, argv, str(folder))


# ------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("cmd", ["train", "eval", "generate", "demo"])
def test_threads_not_positive(tmp_path, capsys, cmd, value):
    argv = {
        "train": ["train", "--preset", "tiny", "--out", str(tmp_path / "run")],
        "eval": ["eval", "--checkpoint", str(tmp_path)],
        "generate": ["generate", "--checkpoint", str(tmp_path), "--prompt", "x"],
        "demo": ["demo", "--out", str(tmp_path / "demo")],
    }[cmd]
    refused(capsys, [*argv, "--threads", value], "--threads", value)


@pytest.mark.parametrize("option", ["--checkpoint-every", "--until", "--steps"])
def test_train_negative_counts(tmp_path, capsys, option):
    argv = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), option, "-1"]
    refused(capsys, argv, option, "-1")
    assert not (tmp_path / "run").exists()


def test_generate_huge_tokens(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", str(10**15), *CPU]
    refused(capsys, argv, "--tokens", str(10**15))


def test_generate_huge_cache_rows(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2", *CPU,
            "--offload", "host", "--cache-rows", str(10**15)]  # fmt: skip
    refused(capsys, argv, f"--cache-rows {10**15}")


def test_generate_negative_cache_rows(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--offload", "host",
            "--cache-rows", "-1", *CPU]  # fmt: skip
    refused(capsys, argv, "--cache-rows", "-1")


def test_cache_sim_huge_cache_rows(tmp_path, capsys):
    """A cache larger than every row the text asks is exact with a slot per such row: not allocated whole."""
    text = tmp_path / "t.txt"
    text.write_text("And the earth was without form, and void. " * 20)
    argv = [
        "cache-sim",
        "--preset",
        "tiny",
        "--text-file",
        str(text),
        "--cache-rows",
        "64Ki",
        "1000T",
        "--json",
    ]
    assert main(argv) == 0
    reports = json.loads(capsys.readouterr().out)["reports"]
    assert [r["capacity"] for r in reports] == [65536] * 6 + [10**15] * 6
    assert [r["hit_rate"] for r in reports[:6]] == [r["hit_rate"] for r in reports[6:]]


def test_text_file_not_utf8(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(b"\xff\xfe\x00binary")
    refused(capsys, ["collisions", "--preset", "tiny", "--text-file", str(text)], str(text))


def test_damaged_tokenizer_in_checkpoint(run, capsys):
    out, ckpt = run
    (ckpt / "tokenizer.json").write_bytes(b"\x89PNG\r\n")
    refused(capsys, ["generate", "--checkpoint", str(out), "--prompt", "And", *CPU], "tokenizer.json")


def test_generate_huge_batch(trained, capsys):
    argv = [
        "generate",
        "--checkpoint",
        str(trained),
        "--prompt",
        "And",
        "--tokens",
        "2",
        "--batch",
        str(10**13),
        *CPU,
    ]
    refused(capsys, argv, f"--batch {10**13}", "--tokens 2", "ask for fewer")


def test_allocation_failure_is_one_line(trained, capsys, monkeypatch):
    """Past every check, an allocation that fails is still one line, not a traceback."""
    import engram.cli.generate as cli_generate

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(cli_generate, "generate", no_memory)
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2", *CPU]
    refused(capsys, argv, "out of memory", "ask for less")


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """main turns refusals of input into a line; any other RuntimeError (a bug) is left to propagate."""
    import engram.cli.addressing as addressing

    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(addressing, "cmd_layout", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["layout", "--preset", "tiny"])


# ------------------------------------------------------------------------------------------- cache policies
@pytest.fixture
def small_text(tmp_path) -> Path:
    text = tmp_path / "t.txt"
    text.write_text("And the earth was without form, and void.\n" * 30)
    return text


def test_profile_for_another_layout(tmp_path, small_text, capsys):
    prof = tmp_path / "p.safetensors"
    assert main(["profile", "--preset", "tiny", "--text-file", str(small_text), "--out", str(prof)]) == 0
    capsys.readouterr()
    argv = ["cache-sim", "--preset", "demo-v1", "--text-file", str(small_text), "--profile", str(prof)]
    refused(capsys, argv, "another layout", "config 'tiny'", "engram profile")
    argv = ["plan-memory", "--preset", "demo-v1", "--text-file", str(small_text), "--profile", str(prof),
            "--hbm", "1MB", "--dram", "10MB", "--tokens-per-s", "100"]  # fmt: skip
    refused(capsys, argv, "another layout")


def test_profile_file_of_another_kind(tmp_path, small_text, capsys):
    other = tmp_path / "o.safetensors"
    import torch

    save_file({"x": torch.zeros(3)}, str(other))
    argv = ["cache-sim", "--preset", "tiny", "--text-file", str(small_text), "--profile", str(other)]
    refused(capsys, argv, "is not an Engram row profile", "engram profile --out")


@pytest.mark.parametrize(
    ("flag", "value", "needles"),
    [
        ("--hbm", "0", ["--hbm", "at least 1"]),
        (
            "--hbm",
            "1TB",
            ["HBM budget 1,000,000,000,000 bytes is larger than the whole table", "give at most"],
        ),
        ("--dram", "1", ["DRAM budget 1 bytes holds less than one 33-byte row"]),
        ("--policy", "belady", ["--policy 'belady'", "belady is the simulator's bound only"]),
        ("--policy", "fifo", ["--policy 'fifo'", "lru, clock, lfu"]),
        ("--tokens-per-s", "0", ["--tokens-per-s", "out of range"]),
    ],
)
def test_plan_memory_bad_budgets_and_policies(small_text, capsys, flag, value, needles):
    args = {"--hbm": "10KB", "--dram": "100KB", "--tokens-per-s": "100"} | {flag: value}
    argv = [
        "plan-memory",
        "--preset",
        "tiny",
        "--text-file",
        str(small_text),
        *[x for kv in args.items() for x in kv],
    ]
    refused(capsys, argv, *needles)


def test_cache_sim_unknown_policy(small_text, capsys):
    argv = ["cache-sim", "--preset", "tiny", "--text-file", str(small_text), "--policies", "lru", "fifo"]
    refused(capsys, argv, "unknown policy 'fifo'", "pinned+lru, belady")


@pytest.mark.parametrize("command", ["cache-sim", "profile", "plan-memory"])
def test_empty_text_file(tmp_path, capsys, command):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = [command, "--preset", "tiny", "--text-file", str(empty)]
    argv += {"profile": ["--out", str(tmp_path / "p.safetensors")],
             "plan-memory": ["--hbm", "10KB", "--dram", "100KB", "--tokens-per-s", "100"]}.get(command, [])  # fmt: skip
    refused(capsys, argv, "empty.txt", "holds no tokens")


# ------------------------------------------------------------------------------------------- FIFOs and devices
class Pipe:
    """A named pipe at `path`. Opening it to read blocks until a writer comes, so a watchdog thread
    opens it for writing (and reading) after a few seconds: code that opened it gets EOF instead of
    hanging the suite, and `waited` says it had to (the check it failed to make)."""

    def __init__(self, path: Path, after_s: float = 5.0) -> None:
        self.path, self.waited = path, False
        os.mkfifo(path)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(after_s,), daemon=True)
        self._thread.start()

    def _watch(self, after_s: float) -> None:
        if self._done.wait(after_s):
            return
        while not self._done.is_set():
            for flags in (os.O_WRONLY, os.O_RDONLY):  # a blocked reader, a blocked writer
                try:
                    os.close(os.open(self.path, flags | os.O_NONBLOCK))
                    self.waited = self.waited or flags == os.O_WRONLY  # succeeds only with a reader
                except OSError:  # ENXIO: nobody reads it
                    pass
            time.sleep(0.05)

    def close(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture
def pipe(tmp_path) -> Iterator[Pipe]:
    p = Pipe(tmp_path / "pipe")
    yield p
    p.close()


def no_work(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> None:
    """Replace `module.name` by a function that fails the test: the command got past its checks."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{module}.{name} ran: the bad input was not refused before any work")

    monkeypatch.setattr(importlib.import_module(module), name, ran)


def _fifo_commands(p: str, out: Path) -> dict[str, list[str]]:
    replay = ["--preset", "tiny", "--text-file", p]
    return {
        "layout-config": ["layout", "--config", p],
        "hash-config": ["hash", "--config", p, "--ids", "1 2"],
        "train-config": ["train", "--config", p, "--out", str(out)],
        "cache-sim-text": ["cache-sim", *replay],
        "profile-text": ["profile", *replay, "--out", str(out / "p.safetensors")],
        "plan-memory-text": ["plan-memory", *replay, "--hbm", "1KB", "--dram", "1MB", "--tokens-per-s", "1"],
        "collisions-text": ["collisions", *replay],
        "cache-sim-profile": ["cache-sim", "--preset", "tiny", "--profile", p],
        "cache-sim-profile-text": ["cache-sim", "--preset", "tiny", "--profile-text", p],
        "study-corpus": ["study", "memory", "--quick", "--corpus", p, "--out", str(out)],
        "demo-corpus": ["demo", "--steps", "1", "--seeds", "1", "--corpus", p, "--out", str(out)],
        "compress-tokenizer": ["compress", "--tokenizer", p],
        "hash-tokenizer": ["hash", "--preset", "tiny", "--tokenizer", p, "--ids", "1"],
        "demo-tokenizer": ["demo", "--tokenizer", p, "--out", str(out)],
        "eval-checkpoint": ["eval", "--checkpoint", p],
        "generate-checkpoint": ["generate", "--checkpoint", p, "--prompt", "x"],
        "run-layer-checkpoint": ["run-layer", "--checkpoint", p],
        "convert-src": ["convert", p, str(out)],
        "bench-dir": ["bench", "--dir", p, "--list"],
    }


@pytest.mark.parametrize("case", list(_fifo_commands("p", Path("o"))))
def test_fifo_input_is_refused_unopened(pipe, tmp_path, capsys, monkeypatch, case):
    """Every input path of every command is checked (one os.stat) before it is opened: a FIFO is named,
    not read, so the command neither hangs nor starts any work."""
    no_work(monkeypatch, "engram.apps.lm.train", "split_documents")  # past reading the corpus
    no_work(monkeypatch, "engram.apps.study.studies", "prepare_data")
    argv = _fifo_commands(str(pipe.path), tmp_path / "out")[case]
    refused(capsys, argv, str(pipe.path), "FIFO")
    assert not pipe.waited


@pytest.mark.parametrize("cmd", ["demo", "study"])
def test_fifo_inside_a_corpus_folder(pipe, tmp_path, capsys, monkeypatch, cmd):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("In the beginning.\n" * 50)
    fifo = folder / "b.txt"
    pipe.path.rename(fifo)
    pipe.path = fifo
    no_work(monkeypatch, "engram.apps.lm.train", "split_documents")
    no_work(monkeypatch, "engram.apps.study.studies", "prepare_data")
    argv = {"demo": ["demo", "--steps", "1", "--seeds", "1"], "study": ["study", "memory", "--quick"]}[cmd]
    refused(capsys, [*argv, "--corpus", str(folder), "--out", str(tmp_path / "out")], str(fifo), "FIFO")
    assert not pipe.waited


def test_fifo_as_output_file_is_kept(pipe, tmp_path, small_text, capsys, monkeypatch):
    no_work(monkeypatch, "engram.cli.systems", "build_profile")
    argv = ["profile", "--preset", "tiny", "--text-file", str(small_text), "--out", str(pipe.path)]
    refused(capsys, argv, str(pipe.path), "FIFO", "not a regular file")
    assert stat.S_ISFIFO(os.stat(pipe.path).st_mode) and not pipe.waited


@pytest.mark.parametrize("flag", ["--plot", "--save"])
def test_socket_as_output_file(capsys, tmp_path, small_text, monkeypatch, flag):
    """Not a device such as /dev/null: code that replaces its output path would replace that for good."""
    sock = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        no_work(monkeypatch, "engram.cli.systems", "simulate_cache")
        no_work(monkeypatch, "engram.cli.addressing", "cmd_compress")
        argv = {
            "--plot": ["cache-sim", "--preset", "tiny", "--text-file", str(small_text), "--plot", str(sock)],
            "--save": ["compress", "--save", str(sock)],
        }[flag]
        refused(capsys, argv, str(sock), "a socket", "not a regular file")
        assert stat.S_ISSOCK(os.stat(sock).st_mode)


# ------------------------------------------------------------------------------------------- outputs, checked first
UNWRITABLE = "/proc/engram-test"  # /proc refuses new entries, even to root (who passes every chmod)


def _output_commands(small_text: Path, src: Path) -> dict[str, tuple[list[str], str, str]]:
    """case -> (argv, the module and the function the command would run if the path passed)."""
    text = ["--preset", "tiny", "--text-file", str(small_text)]
    return {
        "study": (["study", "memory", "--quick", "--out", UNWRITABLE], "engram.cli.study", "cmd_study"),
        "demo": (["demo", "--steps", "1", "--out", UNWRITABLE], "engram.cli.train", "cmd_demo"),
        "train": (["train", "--preset", "tiny", "--out", UNWRITABLE], "engram.cli.train", "cmd_train"),
        "profile": (["profile", *text, "--out", f"{UNWRITABLE}.safetensors"], "engram.cli.systems",
                    "cmd_profile"),
        "cache-sim-plot": (["cache-sim", *text, "--plot", f"{UNWRITABLE}.png"], "engram.cli.systems",
                           "cmd_cache_sim"),
        "compress-save": (["compress", "--save", f"{UNWRITABLE}.safetensors"], "engram.cli.addressing",
                          "cmd_compress"),
        "convert": (["convert", str(src), UNWRITABLE], "engram.cli.checkpoint", "cmd_convert"),
        "generate-offload-dir": (["generate", "--checkpoint", str(src), "--prompt", "x", "--offload", "ssd",
                                  "--offload-dir", f"{UNWRITABLE}/deeper"], "engram.cli.generate", "cmd_generate"),
    }  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("case", list(_output_commands(Path("t"), Path("s"))))
def test_unwritable_output_refused_before_any_work(tmp_path, small_text, capsys, monkeypatch, case):
    argv, module, func = _output_commands(small_text, tmp_path)[case]
    no_work(monkeypatch, module, func)
    refused(capsys, argv, UNWRITABLE, "cannot write in /proc")


# ------------------------------------------------------------------------------------------- numbers past int64
@pytest.mark.parametrize(
    "argv",
    [
        ["cache-sim", "--preset", "tiny", "--cache-rows", "99999999999999999999999"],
        ["cache-sim", "--preset", "tiny", "--batch-tokens", "99999999999999999999999"],
        ["profile", "--preset", "tiny", "--top", "99999999999999999999999", "--out", "p.safetensors"],
        ["plan-memory", "--preset", "tiny", "--hbm", "99999999999999999999999B", "--dram", "1MB"],
    ],
    ids=["cache-rows", "batch-tokens", "top", "hbm"],
)
def test_count_past_int64(capsys, monkeypatch, argv):
    no_work(monkeypatch, "engram.cli.systems", "_replay_setup")
    no_work(monkeypatch, "engram.cli.systems", "config_from_args")
    refused(capsys, argv, "99999999999999999999999", "too large")


@pytest.mark.parametrize(
    ("argv", "module", "func"),
    [
        (["run-layer"], "engram.cli.checkpoint", "cmd_run_layer"),
        (["generate", "--checkpoint", ".", "--prompt", "x"], "engram.cli.generate", "cmd_generate"),
        (["train", "--preset", "tiny", "--out", "run"], "engram.cli.train", "cmd_train"),
    ],
    ids=["run-layer", "generate", "train"],
)
def test_seed_past_int64(capsys, monkeypatch, tmp_path, argv, module, func):
    monkeypatch.chdir(tmp_path)
    no_work(monkeypatch, module, func)
    refused(
        capsys, [*argv, "--seed", "99999999999999999999999"], "--seed", "99999999999999999999999", "too large"
    )


# ------------------------------------------------------------------------------------------- selections and ids
@pytest.mark.parametrize("only", ["", ",", "hash,"])
def test_bench_empty_selection(capsys, monkeypatch, only):
    no_work(monkeypatch, "engram.cli.bench", "run_suite")
    refused(capsys, ["bench", "--only", only], f"--only {only!r}", "empty", "hash")


@pytest.mark.parametrize("ids", ["1,,2", ",1", "1,", "1, ,2"])
def test_hash_empty_id_between_commas(capsys, monkeypatch, ids):
    no_work(monkeypatch, "engram.cli.addressing", "hasher_for")
    refused(capsys, ["hash", "--preset", "tiny", "--ids", ids], repr(ids), "no id at position")


# ------------------------------------------------------------------------------------------- config field types
@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("steps", "ten", "a whole number"),
        ("steps", True, "a whole number"),
        ("lr", "0.1", "a number"),
        ("tie_embeddings", 1, "true or false"),
        ("engram", 5, "a JSON object of EngramConfig fields or null"),
        ("corpus", ["a.txt"], "a string or null"),
        ("table_optimizer", 3, "one of 'adam', 'adagrad'"),
        ("extra", [], "a JSON object"),
    ],
)
def test_train_config_field_of_the_wrong_type(tmp_path, capsys, monkeypatch, field, value, expected):
    no_work(monkeypatch, "engram.apps.lm.train", "prepare_data")
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps({field: value}))
    argv = ["train", "--config", str(conf), "--out", str(tmp_path / "run")]
    refused(capsys, argv, str(conf), f"{field}={value!r}", f"expected {expected}")


# ------------------------------------------------------------------------------------------- binary corpus
@pytest.mark.parametrize("cmd", ["demo", "study", "train"])
def test_binary_corpus_names_the_file(tmp_path, capsys, monkeypatch, cmd):
    no_work(monkeypatch, "engram.apps.lm.train", "split_documents")
    no_work(monkeypatch, "engram.apps.study.studies", "prepare_data")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\n\xff\xfe\x00\x81 binary")
    out = str(tmp_path / "out")
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps({"corpus": str(binary)}))
    argv = {
        "demo": ["demo", "--steps", "1", "--seeds", "1", "--corpus", str(binary), "--out", out],
        "study": ["study", "memory", "--quick", "--corpus", str(binary), "--out", out],
        "train": ["train", "--config", str(conf), "--out", out],
    }[cmd]
    refused(capsys, argv, str(binary), "not UTF-8 text (byte 3)")


# ------------------------------------------------------------------------------------------- --version
def test_version(capsys):
    import engram

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"engram {engram.__version__}"
