"""The vLLM plugin's parts that need no vLLM: the served folder's checks (engram.vllm.folder), the table
options and the tables they build (engram.vllm.tables), the registry rule that resolves a folder with
an Engram part to our class (engram.vllm.registry), and the entry point. The served model itself is
tested under vLLM in tests/test_vllm_serve.py."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import vllm_setup
from engram.checkpoint.convert import row_file_path
from engram.model.table import FP8Table
from engram.systems import LevelTable, TieredTable
from engram.vllm import registry
from engram.vllm.folder import PartError, read_part
from engram.vllm.tables import ServeOptions, TableMode, load_tables, serve_options, table_stats

SHAPE = dict(hidden_size=vllm_setup.HIDDEN, num_layers=2, vocab_size=vllm_setup.VOCAB)


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    return vllm_setup.build_folder(tmp_path_factory.mktemp("f") / "model")


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    return vllm_setup.build_folder(tmp_path_factory.mktemp("q") / "model", fp8=True, row_files=True)


# ------------------------------------------------------------------------------------ the folder
def test_part_is_read_and_checked(float_folder, fp8_folder):
    part = read_part(float_folder, **SHAPE)
    assert part.part == float_folder / "engram" and not part.fp8
    assert part.config.layer_ids == (1,) and part.boundaries is None
    assert read_part(fp8_folder, **SHAPE).fp8


def test_refusals_name_the_value(float_folder, tmp_path):
    with pytest.raises(PartError, match=r"hidden size 256, but the backbone .* has hidden size 384"):
        read_part(float_folder, **{**SHAPE, "hidden_size": 384})
    with pytest.raises(PartError, match=r"layers \[1\], but the backbone .* has 1 decoder layers"):
        read_part(float_folder, **{**SHAPE, "num_layers": 1})
    with pytest.raises(PartError, match=r"vocabulary of 1000, but the backbone .* has 500 token ids"):
        read_part(float_folder, **{**SHAPE, "vocab_size": 500})
    plain = vllm_setup.build_folder(tmp_path / "plain", engram=False)
    with pytest.raises(FileNotFoundError, match=r"has no Engram part .*save_engram"):
        read_part(plain, **SHAPE)


def test_part_linked_from_outside_the_folder_is_refused(float_folder, tmp_path):
    """The served folder's engram/ and tokenizer.json: read only from inside the folder, as every file a
    folder reader opens (a link that stays inside is followed)."""
    import shutil

    served = tmp_path / "served"
    shutil.copytree(float_folder, served)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(served / "engram", outside / "engram")
    (served / "engram").symlink_to(outside / "engram")
    with pytest.raises(
        PartError, match=r"'engram', a symlink to .*elsewhere/engram, outside the checkpoint folder"
    ):
        read_part(served, **SHAPE)
    (served / "engram").unlink()
    shutil.move(outside / "engram", served / "engram")
    (outside / "tokenizer.json").write_text("{}")  # never opened: refused by its place alone
    (served / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    with pytest.raises(PartError, match=r"'tokenizer.json', a symlink to .*, outside the checkpoint folder"):
        read_part(served, **SHAPE)


def test_part_for_another_tokenizer_is_refused(float_folder, tmp_path):
    from engram.addressing.compression import resolve_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    resolve_tokenizer("deepseek-v4").save(str(tok / "tokenizer.json"))
    with pytest.raises(PartError, match=r"does not fit the tokenizer .*tokenizer.json"):
        read_part(float_folder, **SHAPE, tokenizer_dir=tok)


def test_variant_with_a_convolution_is_refused(tmp_path):
    import shutil

    from engram.hf import add_engram, save_engram

    folder = vllm_setup.build_folder(tmp_path / "model")

    model = vllm_setup.backbone("llama")
    cfg = vllm_setup.engram_config().replace(variant="demo-v1")
    from engram.addressing.compression import TokenizerCompression

    add_engram(model, cfg, compression=TokenizerCompression.identity(vllm_setup.VOCAB))
    shutil.rmtree(folder / "engram")
    save_engram(model, folder)
    with pytest.raises(PartError, match=r"variant 'demo-v1'; the vLLM plugin serves 'deepseek-v4.1' only"):
        read_part(folder, **SHAPE)


def test_eos_boundaries_become_the_restart_rule(tmp_path):
    from engram.addressing.compression import TokenizerCompression
    from engram.hf import add_engram, save_engram

    model = vllm_setup.backbone("llama")
    add_engram(
        model,
        vllm_setup.engram_config(),
        compression=TokenizerCompression.identity(vllm_setup.VOCAB),
        boundaries="eos",
        eos_token_id=7,
    )
    model.save_pretrained(tmp_path / "m")
    save_engram(model, tmp_path / "m")
    part = read_part(tmp_path / "m", **SHAPE)
    assert part.boundaries == "eos" and part.config.restart_after_id == 7
    (tmp_path / "m" / "engram" / "engram_hf.json").write_text("[1, 2]")
    with pytest.raises(PartError, match=r"expected a JSON object"):
        read_part(tmp_path / "m", **SHAPE)


@pytest.fixture
def folder_copy(float_folder, tmp_path):
    import shutil

    return shutil.copytree(float_folder, tmp_path / "model")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_tokenizer_json_that_is_not_a_file_is_refused(folder_copy, mkfifo, kind):
    """It was skipped without a word (the map then went unchecked); a FIFO is never opened."""
    path = folder_copy / "tokenizer.json"
    if kind == "fifo":
        mkfifo(path)
    else:
        path.mkdir()
    what = "a named pipe" if kind == "fifo" else "a folder"
    with pytest.raises(
        PartError, match=rf"tokenizer.json is {what}.*, not a tokenizer.json, so .* cannot be checked"
    ):
        read_part(folder_copy, **SHAPE)


def test_a_missing_tokenizer_folder_is_refused_and_a_missing_tokenizer_said(float_folder, tmp_path):
    from engram.hf.io import TokenizerNotCheckedWarning

    with pytest.raises(
        PartError, match=r"the tokenizer folder .*nope is missing, so the Engram part .* cannot be"
    ):
        read_part(float_folder, **SHAPE, tokenizer_dir=tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(PartError, match=r"the tokenizer folder .*file is a file"):
        read_part(float_folder, **SHAPE, tokenizer_dir=tmp_path / "file")
    # no tokenizer.json (vLLM with skip_tokenizer_init serves token ids): served, and said
    with pytest.warns(
        TokenizerNotCheckedWarning,
        match=r"not checked against a tokenizer \(no tokenizer given and no .*tokenizer.json\)",
    ):
        assert read_part(float_folder, **SHAPE).tokenizer is None


def test_part_files_that_are_not_what_they_should_be_are_named(folder_copy, mkfifo):
    import shutil

    comp = folder_copy / "engram" / "compression.safetensors"
    comp.unlink()
    mkfifo(comp)  # was reported "missing"
    with pytest.raises(PartError, match=r"'compression.safetensors': a named pipe \(FIFO\), not a file"):
        read_part(folder_copy, **SHAPE)
    shutil.rmtree(folder_copy / "engram")
    (folder_copy / "engram").write_text("{}")  # was reported "missing"
    with pytest.raises(PartError, match=r"engram is a file, not the folder of an Engram part"):
        read_part(folder_copy, **SHAPE)


def test_the_tokenizer_checked_is_recorded(tmp_path):
    import warnings

    from engram.addressing.compression import TokenizerCompression
    from engram.hf import add_engram, save_engram

    tok = tmp_path / "tok"
    tok.mkdir()
    tokenizer = _word_level(vllm_setup.VOCAB)
    tokenizer.save(str(tok / "tokenizer.json"))
    model = vllm_setup.backbone("llama")
    add_engram(model, vllm_setup.engram_config(), compression=TokenizerCompression.from_tokenizer(tokenizer))
    model.save_pretrained(tmp_path / "m")
    save_engram(model, tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part = read_part(tmp_path / "m", **SHAPE, tokenizer_dir=tok)
    assert part.tokenizer == str(tok / "tokenizer.json")


def _word_level(size):
    """A word-level tokenizer of exactly `size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


# ------------------------------------------------------------------------------------ the tables
def test_options_are_checked():
    assert serve_options(None) == ServeOptions()
    assert serve_options({"tables": "rowfile", "cache_fraction": 0.1}) == ServeOptions(TableMode.ROWFILE, 0.1)
    for bad, match in [
        ("ssd", "must be a dict"),
        ({"table": "host"}, "unknown keys \\['table'\\]"),
        ({"tables": "disk"}, "'disk': use one of 'memory', 'host', 'mmap', 'rowfile'"),
        ({"cache_fraction": 0}, "must be a number in \\(0, 1\\]"),
        ({"cache_fraction": True}, "must be a number"),
        ({"verify": "yes"}, r"\['verify'\]='yes' must be True or False"),
    ]:
        with pytest.raises(ValueError, match=match):
            serve_options(bad)
    assert serve_options({"verify": True}) == ServeOptions(verify=True)


def test_verify_checks_every_table_however_large(fp8_folder, tmp_path, monkeypatch):
    """A table past the scan limit, one byte damaged: served unchecked by default (a note says so),
    refused by its CRC32 with verify=True (memory and mmap modes), and a row file's damaged byte refused
    by the table fingerprint its header records."""
    import shutil

    from engram.checkpoint.files import read_header
    from engram.storage import integrity

    served = tmp_path / "served"
    shutil.copytree(fp8_folder, served)
    shard = served / "engram" / "model-00001-of-00001.safetensors"
    n, header = read_header(shard)
    data = bytearray(shard.read_bytes())
    data[8 + n + header["layers.1.engram.embed.weight"]["data_offsets"][0] + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    rows = row_file_path(served / "engram", 1)
    data = bytearray(rows.read_bytes())
    data[4096 + 5] ^= 0x01  # row 0's sixth value
    rows.write_bytes(bytes(data))
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 1024)
    part = read_part(served, **SHAPE)
    with pytest.warns(integrity.UnscannedTableWarning):
        load_tables(part, ServeOptions(TableMode.MMAP), torch.float32)
    for mode in (TableMode.MEMORY, TableMode.MMAP):
        with pytest.raises(
            ValueError, match=r"'layers.1.engram.embed.weight': its bytes do not match the CRC32"
        ):
            load_tables(part, ServeOptions(mode, verify=True), torch.float32)
    from engram.checkpoint.convert import open_row_file

    with pytest.raises(ValueError, match=r"engram_layer1.rows: its rows do not match the fingerprint"):
        open_row_file(served / "engram", 1, verify=True)


@pytest.mark.parametrize("mode", list(TableMode))
def test_every_mode_serves_the_stored_rows(fp8_folder, mode):
    part = read_part(fp8_folder, **SHAPE)
    want = load_tables(part, ServeOptions(), torch.float32)[1].table
    assert isinstance(want, FP8Table)
    got = load_tables(part, ServeOptions(mode, 0.05), torch.float32)[1].table
    kind = {"memory": FP8Table, "host": TieredTable, "mmap": TieredTable, "rowfile": LevelTable}[mode.value]
    assert isinstance(got, kind)
    rows = torch.randint(0, want.num_rows, (3, 40, 4))
    for _ in range(2):  # the second time partly from the hot-row cache
        assert torch.equal(got.gather(rows, torch.float32), want.gather(rows, torch.float32))
    stats = table_stats({1: load_tables(part, ServeOptions(mode, 0.05), torch.float32)[1]})
    assert stats[1]["table"] == kind.__name__


def test_fp8_modes_refuse_a_float_part_and_missing_row_files(float_folder, tmp_path):
    part = read_part(float_folder, **SHAPE)
    with pytest.raises(ValueError, match=r"stores float tables: write an FP8 part with engram.hf.export_fp8"):
        load_tables(part, ServeOptions(TableMode.HOST), torch.float32)
    q = vllm_setup.build_folder(tmp_path / "q", fp8=True)
    with pytest.raises(ValueError, match=r"engram_layer1.rows'\], which are missing: write them"):
        load_tables(read_part(q, **SHAPE), ServeOptions(TableMode.ROWFILE), torch.float32)
    assert not row_file_path(q / "engram", 1).exists()


# ------------------------------------------------------------------------------------ the registry
def model_config(folder, impl="auto", **changes):
    """What the registry reads of vLLM's ModelConfig (a stand-in: vLLM is not needed here)."""
    hf = SimpleNamespace(**{**SHAPE, "num_hidden_layers": SHAPE["num_layers"], **changes})
    return SimpleNamespace(
        model=str(folder),
        model_impl=impl,
        hf_text_config=hf,
        tokenizer=str(folder),
        enable_prompt_embeds=False,
    )


def test_a_folder_with_a_part_resolves_to_our_class(float_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "check_vllm_version", lambda version=None: None)
    cfg = model_config(float_folder)
    assert registry.engram_architectures(["LlamaForCausalLM"], cfg) == ["EngramLlamaForCausalLM"]
    assert registry.engram_architectures("Qwen2ForCausalLM", cfg) == ["EngramQwen2ForCausalLM"]
    assert registry.engram_architectures(["EngramLlamaForCausalLM"], cfg) == ["EngramLlamaForCausalLM"]
    plain = vllm_setup.build_folder(tmp_path / "plain", engram=False)
    assert registry.engram_architectures(["LlamaForCausalLM"], model_config(plain)) == ["LlamaForCausalLM"]
    assert registry.engram_architectures(["X"], SimpleNamespace(model="org/hub-name")) == ["X"]
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*is not one engram-lm's vLLM plugin serves"):
        registry.engram_architectures(["GPT2LMHeadModel"], cfg)
    with pytest.raises(ValueError, match=r"model_impl='transformers' .* without Engram"):
        registry.engram_architectures(["LlamaForCausalLM"], model_config(float_folder, "transformers"))


def test_the_registry_checks_the_folder_before_any_worker(float_folder, tmp_path, monkeypatch):
    """Where vLLM resolves the architecture (the user's process): the part against the backbone, the
    options against the part, prompt embeddings; a folder named explicitly without a part."""
    monkeypatch.setattr(registry, "check_vllm_version", lambda version=None: None)
    arch = ["LlamaForCausalLM"]
    with pytest.raises(PartError, match=r"hidden size 256, but the backbone .* has hidden size 384"):
        registry.engram_architectures(arch, model_config(float_folder, hidden_size=384))
    opts = {"vllm_engram": {"tables": "host"}}
    with pytest.raises(ValueError, match=r"tables='host' serves FP8 tables, but .* stores float tables"):
        registry.engram_architectures(arch, model_config(float_folder, **opts))
    with pytest.raises(ValueError, match=r"unknown keys \['x'\]"):
        registry.engram_architectures(arch, model_config(float_folder, vllm_engram={"x": 1}))
    embeds = model_config(float_folder)
    embeds.enable_prompt_embeds = True
    with pytest.raises(ValueError, match=r"enable_prompt_embeds=True\) cannot be served"):
        registry.engram_architectures(arch, embeds)
    plain = vllm_setup.build_folder(tmp_path / "plain", engram=False)
    with pytest.raises(FileNotFoundError, match=r"has no Engram part"):
        registry.engram_architectures(["EngramLlamaForCausalLM"], model_config(plain))
    assert registry.served_part(model_config(float_folder)).config.layer_ids == (1,)


def test_truncated_files_are_refused_at_start_up(fp8_folder, tmp_path, monkeypatch):
    """A part whose FP8 file or row file was cut short: refused where the architecture resolves."""
    import os
    import shutil

    monkeypatch.setattr(registry, "check_vllm_version", lambda version=None: None)
    arch = ["LlamaForCausalLM"]
    rowfile = {"vllm_engram": {"tables": "rowfile"}}
    for name, opts, says in (
        ("model-00001-of-00001.safetensors", {}, r"not a readable safetensors file .* truncated or damaged"),
        ("engram_layer1.rows", rowfile, r"engram_layer1.rows: the row file is \d+ bytes but its header"),
    ):
        cut = tmp_path / name / "model"
        shutil.copytree(fp8_folder, cut)
        os.truncate(cut / "engram" / name, (cut / "engram" / name).stat().st_size - 1000)
        with pytest.raises(ValueError, match=says):
            registry.engram_architectures(arch, model_config(cut, **opts))


def test_the_registry_check_stays_light(float_folder):
    """The check runs in every vLLM process before its CPU platform's module scan: no numba loaded."""
    hf = dict(hidden_size=vllm_setup.HIDDEN, num_hidden_layers=2, vocab_size=vllm_setup.VOCAB)
    code = (
        "import sys; from types import SimpleNamespace as N; from engram.vllm import registry; "
        f"registry.served_part(N(model={str(float_folder)!r}, tokenizer=None, hf_text_config=N(**{hf!r}))); "
        "print(sorted(m for m in ('numba', 'llvmlite', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_vllm_version_is_checked():
    registry.check_vllm_version("0.32.0")
    registry.check_vllm_version("0.32.1+cpu")
    for v in ("0.31.0", "0.33.0", "1.0"):
        with pytest.raises(RuntimeError, match=f"vLLM {v} is installed, but .* written against vLLM 0.32.x"):
            registry.check_vllm_version(v)


def test_entry_point_and_a_light_import():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("engram") == "engram.vllm:register"
    # vLLM runs the entry point in its workers before its CPU platform scans every loaded module, a scan
    # that fails on llvmlite's objects: importing the plugin must not load numba
    code = (
        "import sys, engram.vllm; print(sorted(m for m in ('numba', 'llvmlite', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize("kind", ["float", "fp8"])
def test_tensor_parallel_shards_sum_to_the_table(kind):
    """Each TP rank holds its share of the rows; the all-reduce of the ranks' gathers is the table's."""
    from engram.model.table import TrainableTable
    from engram.vllm.tensor_parallel import TensorParallelTable, shard_rows, shard_tables

    torch.manual_seed(0)
    full = TrainableTable(1001, 32)
    if kind == "fp8":
        full = FP8Table.from_float(full.weight.detach())
    rows = torch.randint(0, 1001, (1, 50, 4))
    rows[0, :3, 0] = torch.tensor([0, 499, 1000])  # both ends of each share
    want = full.gather(rows, torch.float32)
    world = 3
    parts = []
    for rank in range(world):
        module = SimpleNamespace(table=full)
        shard_tables({1: module}, rank, world, lambda x: parts.append(x) or x)
        t = module.table
        assert isinstance(t, TensorParallelTable) and (t.lo, t.hi) == shard_rows(1001, rank, world)
        assert t.shard.num_rows == t.hi - t.lo and t.num_rows == 1001
        t.gather(rows, torch.float32)
    assert torch.equal(sum(parts), want)
    from engram.model.table import EngramTable

    class Tiered(EngramTable):  # any table not held in memory (TieredTable, LevelTable, ...)
        num_rows, dim = 10, 32

    with pytest.raises(
        ValueError, match=r"shards tables served from memory .* not Tiered: serve with tables="
    ):
        shard_tables({1: SimpleNamespace(table=Tiered())}, 0, 2, lambda x: x)
