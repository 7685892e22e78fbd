"""Hostile input to the `engram` command line: every case gets one line, exit status 2, no traceback.

Each test runs `engram.cli.main(argv)` in-process with a bad argument or a damaged file and checks
that the error line (argparse may print its usage lines before it) is `engram CMD: error: ...`,
names the bad value or file, and that nothing escaped as an exception. The trained checkpoint the
checkpoint cases damage is a 3-step tiny run, copied per test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engram.cli import main

NESTED = "[" * 100_000  # a JSON document too deep for Python's parser (RecursionError)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run `engram argv`; assert exit 2 and one error line holding every needle; return that line.

    argparse prints its usage lines first; a list of problems (`  - ...` lines) may follow the line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage, then the error line
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    (at,) = [i for i, ln in enumerate(lines) if ln.startswith(f"engram {argv[0]}: error: ")]
    assert all(ln.startswith(("usage:", " ")) for ln in lines[:at]), err
    assert all(ln.startswith("  - ") for ln in lines[at + 1 :]), f"more than one message line:\n{err}"
    message = "\n".join(lines[at:])
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A finished 3-step run (with Engram, rows 32 wide so --offload can quantise them)."""
    from engram.apps.train import Trainer, build_model, prepare_data
    from training_setup import tiny_cfg

    cfg = tiny_cfg(corpus, steps=3, eval_every=0, engram_kw={"head_dim": 32})
    data = prepare_data(cfg)
    out = tmp_path_factory.mktemp("hostile") / "run"
    Trainer(cfg, data, build_model(cfg, data), out_dir=out).run()
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict()))
    return out


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
def _load_commands(out: Path) -> list[list[str]]:
    return [
        ["eval", "--checkpoint", str(out)],
        ["generate", "--checkpoint", str(out), "--prompt", "And", "--tokens", "2"],
        ["train", "--config", str(out / "train_config.json"), "--out", str(out), "--resume", "--no-progress"],
    ]


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_garbage_model_file(run, capsys, cmd):
    out, ckpt = run
    (ckpt / "model.safetensors").write_bytes(b"\x00\x01not safetensors at all" * 10)
    refused(capsys, _load_commands(out)[cmd], "model.safetensors")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_without_step(run, capsys, cmd):
    out, ckpt = run
    state = json.loads((ckpt / "state.json").read_text())
    del state["step"]
    (ckpt / "state.json").write_text(json.dumps(state))
    refused(capsys, _load_commands(out)[cmd], "state.json", "step")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_state_too_deep(run, capsys, cmd):
    out, ckpt = run
    (ckpt / "state.json").write_text(NESTED)
    refused(capsys, _load_commands(out)[cmd], "state.json")


@pytest.mark.parametrize("cmd", [0, 1, 2], ids=["eval", "generate", "train-resume"])
def test_size_mismatch(run, capsys, cmd):
    out, ckpt = run
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("tok_emb.weight") or "emb" in k)
    tensors[name] = tensors[name][:-1].clone()  # one row short
    save_file(tensors, str(ckpt / "model.safetensors"))
    refused(capsys, _load_commands(out)[cmd], "model.safetensors")


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
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2",
            "--offload", "ssd", "--offload-dir", str(f)]  # fmt: skip
    refused(capsys, argv, str(f))


def test_generate_offload_dir_unwritable(trained, tmp_path, capsys, monkeypatch):
    import engram.systems.prefetch as prefetch

    folder = tmp_path / "ro"
    folder.mkdir()

    def denied(path, *a, **k):  # what a read-only folder gives (root ignores chmod, so it is simulated)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(prefetch, "save_tensors", denied)
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2",
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
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", str(10**15)]
    refused(capsys, argv, "--tokens", str(10**15))


def test_generate_huge_cache_rows(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2",
            "--offload", "host", "--cache-rows", str(10**15)]  # fmt: skip
    refused(capsys, argv, f"--cache-rows {10**15}")


def test_generate_negative_cache_rows(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--offload", "host",
            "--cache-rows", "-1"]  # fmt: skip
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
    refused(capsys, ["generate", "--checkpoint", str(out), "--prompt", "And"], "tokenizer.json")


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
    ]
    refused(capsys, argv, f"--batch {10**13}", "--tokens 2", "ask for fewer")


def test_allocation_failure_is_one_line(trained, capsys, monkeypatch):
    """Past every check, an allocation that fails is still one line, not a traceback."""
    import engram.cli.generate as cli_generate

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(cli_generate, "generate", no_memory)
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "And", "--tokens", "2"]
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
