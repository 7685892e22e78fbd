"""Tests for engram.checkpoint.v41: the V4.1 safetensors checkpoint format, its validation and conversion.

Round trips are checked bit for bit (tensor bytes) and through an `Engram` forward; every malformed
checkpoint must be refused with an error naming the tensor (or file), what was found and what was expected.
The files are also read back with the `safetensors` package, an independent reader.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engram import EngramConfig, Layout
from engram.addressing.layout import layout_fingerprint
from engram.checkpoint.convert import convert_table, make_scaled_v41_checkpoint
from engram.checkpoint.hf_config import to_hf_dict
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.checkpoint.v41 import (
    CONFIG_FILE,
    INDEX_FILE,
    LAYOUT_FINGERPRINT_KEY,
    TABLE_FINGERPRINT_KEY,
    TableFormat,
    engram_state_dict,
    layer_prefix,
    load_engram_modules,
    read_checkpoint_config,
    save_checkpoint,
)
from engram.cli import build_parser
from engram.model.module import Engram
from engram.model.table import FP8Table, TrainableTable
from engram.rowformat.fp8 import BLOCK
from engram.storage import quant

BASE = 512  # prime-search base of the scaled V4.1 checkpoints: ~12k rows a layer, ~3 MB a table


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k


def forward_all(config: EngramConfig, modules: dict[int, Engram], seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer_id, m in modules.items():
        h = torch.randn(2, 9, config.hc_mult, config.hidden_size, generator=g)
        rows = torch.randint(
            0, Layout(config).layer(layer_id).num_embeddings, (2, 9, config.rows_per_token), generator=g
        )
        out[layer_id] = m(h, rows)
    return out


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> tuple[Path, EngramConfig]:
    d = tmp_path_factory.mktemp("v41")
    return d, make_scaled_v41_checkpoint(d, base=BASE, hidden_size=32, hc_mult=4, seed=3)


@pytest.fixture(scope="module")
def v41_modules(v41) -> tuple[EngramConfig, dict[int, Engram]]:
    return load_engram_modules(v41[0], mmap=False)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def rewrite(path: Path, edit) -> None:
    """Load a shard with the safetensors package, edit the dict, save it back."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


# ----------------------------------------------------------------------------------- format and names


def test_scaled_v41_checkpoint_format(v41):
    d, config = v41
    assert config.variant.value == "deepseek-v4.1" and config.layer_ids == (1, 14)
    assert config.engram_vocab_size == (BASE,) * 3 and config.compressed_vocab_size == 99092
    assert sorted(p.name for p in d.iterdir()) == [CONFIG_FILE, "model-00001-of-00001.safetensors"]
    h = header(d / "model-00001-of-00001.safetensors")
    layout = Layout(config)
    expected = {}
    for layer_id in (1, 14):
        p, rows = layer_prefix(layer_id), layout.layer(layer_id).num_embeddings
        expected |= {
            p + "embed.weight": ("F8_E4M3", [rows, 256]),
            p + "embed.scale": ("F8_E8M0", [rows, 8]),
            p + "wkv.weight": ("F32", [5 * 32, 24 * 256]),
            p + "q_weight": ("F32", [4, 32]),
            p + "k_weight": ("F32", [4, 32]),
        }
    assert {k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"} == expected
    hf = json.loads((d / CONFIG_FILE).read_text())
    assert hf["engram_num_embeddings"] == list(layout.num_embeddings)  # one per layer, as published
    assert read_checkpoint_config(d).replace(name=config.name, tokenizer=config.tokenizer) == config


def test_safetensors_package_reads_our_files(v41, v41_modules):
    d, _ = v41
    _, modules = v41_modules
    with safe_open(str(d / "model-00001-of-00001.safetensors"), "pt") as f:
        ours = engram_state_dict(modules, fp8=True)
        assert sorted(f.keys()) == sorted(ours)
        for k in ours:
            assert torch.equal(raw_bytes(f.get_tensor(k)), raw_bytes(ours[k])), k


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("mmap", [True, False])
def test_load_builds_the_right_tables(v41, mmap):
    config, modules = load_engram_modules(v41[0], mmap=mmap)
    for layer_id, m in modules.items():
        assert isinstance(m.table, MmapFP8Table if mmap else FP8Table)
        assert m.table.num_rows == Layout(config).layer(layer_id).num_embeddings
        assert m.wkv.weight.dtype == torch.float32 and not m.wkv.weight.is_meta
    _, mb = load_engram_modules(v41[0], mmap=mmap, dtype=torch.bfloat16)
    assert mb[1].wkv.weight.dtype == torch.bfloat16 and mb[1].q_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("max_shard_bytes", [None, 1 << 20])
def test_round_trip(v41, v41_modules, tmp_path, max_shard_bytes):
    config, modules = v41_modules
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    written = save_checkpoint(tmp_path, config, modules, **kw)
    assert written == shards(tmp_path)
    if max_shard_bytes is None:
        assert len(written) == 1 and not (tmp_path / INDEX_FILE).exists()
    else:
        assert len(written) > 2 and written[0].name == f"model-00001-of-{len(written):05d}.safetensors"
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert set(index["weight_map"].values()) == {p.name for p in written}
        assert index["metadata"]["total_size"] == sum(
            p.stat().st_size - 8 - struct.unpack("<Q", p.read_bytes()[:8])[0] for p in written
        )
        for layer_id in config.layer_ids:  # a table's values and scales share a shard
            p = layer_prefix(layer_id)
            assert index["weight_map"][p + "embed.weight"] == index["weight_map"][p + "embed.scale"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    before = forward_all(config, modules)
    for mmap in (True, False):
        c2, m2 = load_engram_modules(tmp_path, mmap=mmap)
        assert c2 == config.replace(name=c2.name)  # the name is the directory's
        assert_same_state(engram_state_dict(modules, fp8=True), engram_state_dict(m2, fp8=True))
        after = forward_all(c2, m2)
        for layer_id in config.layer_ids:
            assert torch.equal(before[layer_id], after[layer_id])


def test_resave_with_fewer_shards_removes_stale_ones(v41_modules, tmp_path):
    config, modules = v41_modules
    save_checkpoint(tmp_path, config, modules, max_shard_bytes=1 << 20)
    assert len(shards(tmp_path)) > 2 and (tmp_path / INDEX_FILE).exists()
    save_checkpoint(tmp_path, config, modules)
    assert [p.name for p in shards(tmp_path)] == ["model-00001-of-00001.safetensors"]
    assert not (tmp_path / INDEX_FILE).exists()
    load_engram_modules(tmp_path)


def test_max_size_tables(tmp_path):
    """V4.1's config.json declares one engram_num_embeddings: every layer may have that many rows."""
    config = make_scaled_v41_checkpoint(tmp_path, base=BASE, hidden_size=32, max_size_tables=True)
    rows = max(Layout(config).num_embeddings)
    c2, modules = load_engram_modules(tmp_path)
    assert modules[1].table.num_rows == rows == modules[14].table.num_rows
    assert Layout(config).layer(1).num_embeddings < rows
    forward_all(c2, modules)


def small_config(variant: str) -> EngramConfig:
    if variant == "demo-v1":
        return EngramConfig.preset("demo-v1").replace(engram_vocab_size=(300, 300), hidden_size=32, hc_mult=2)
    return EngramConfig.preset("tiny")  # V4.1 module, head_dim 32


@pytest.mark.parametrize("variant", ["demo-v1", "tiny"])
@pytest.mark.parametrize("fp8", [False, True])
def test_round_trip_trainable_tables(tmp_path, variant, fp8):
    config = small_config(variant)
    torch.manual_seed(0)
    modules = {layer_id: Engram(config, layer_id) for layer_id in config.layer_ids}
    for m in modules.values():
        if hasattr(m, "value_proj"):  # demo: make every weight non-default so names matter
            for p in m.parameters():
                p.data.normal_()
    save_checkpoint(tmp_path, config, modules, fp8=fp8)
    h = header(shards(tmp_path)[0])
    p = layer_prefix(config.layer_ids[0])
    assert h[p + "embed.weight"]["dtype"] == ("F8_E4M3" if fp8 else "F32")
    assert (p + "embed.scale" in h) == fp8
    c2, m2 = load_engram_modules(tmp_path)
    for layer_id, m in modules.items():
        assert isinstance(m2[layer_id].table, MmapFP8Table if fp8 else TrainableTable)
        expect = dict(m.state_dict())
        got = dict(m2[layer_id].state_dict())
        for k in list(expect):
            if k.startswith("table."):
                del expect[k]
                got.pop(k, None)
        assert_same_state(expect, {k: v for k, v in got.items() if not k.startswith("table.")})
        if not fp8:
            assert torch.equal(m.table.weight, m2[layer_id].table.weight)
            assert m2[layer_id].table.weight.requires_grad
    if not fp8:
        before, after = forward_all(config, modules), forward_all(c2, m2)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_save_refuses_bad_modules(v41_modules, tmp_path):
    config, modules = v41_modules
    with pytest.raises(
        ValueError, match=r"modules cover layers \[1\] but config .* has Engram layers \[1, 14\]"
    ):
        save_checkpoint(tmp_path, config, {1: modules[1]})
    with pytest.raises(ValueError, match="modules\\[1\\] is the Engram module of layer 14"):
        save_checkpoint(tmp_path, config, {1: modules[14], 14: modules[1]})
    with pytest.raises(ValueError, match="built for another config: hidden_size: 32 vs 64"):
        save_checkpoint(tmp_path, config.replace(hidden_size=64), modules)
    assert not list(tmp_path.iterdir())


# -------------------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def bad(v41, tmp_path) -> Path:
    return copy_checkpoint(v41[0], tmp_path / "ckpt")


def shard_of(d: Path) -> Path:
    return d / "model-00001-of-00001.safetensors"


def load_error(d: Path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        load_engram_modules(d, **kw)
    return str(e.value)


def test_missing_tensor(bad, v41):
    config = v41[1]
    rewrite(shard_of(bad), lambda t: t.pop("layers.14.engram.embed.scale"))
    rows = Layout(config).layer(14).num_embeddings
    assert (
        f"layers.14.engram.embed.scale: missing; expected F8_E8M0 [{rows}, 8] (one ue8m0 scale per 32 values "
        "of layers.14.engram.embed.weight)" in load_error(bad)
    )


def test_missing_module_weight(bad):
    rewrite(shard_of(bad), lambda t: t.pop("layers.1.engram.wkv.weight"))
    assert "layers.1.engram.wkv.weight: missing; expected a float tensor [160, 6144]" in load_error(bad)


def test_misshaped_tensors_all_reported(bad, v41):
    config = v41[1]
    layout = Layout(config)
    r1, r14 = layout.num_embeddings

    def edit(t):
        t["layers.1.engram.embed.weight"] = t["layers.1.engram.embed.weight"][:-5].contiguous()
        t["layers.1.engram.embed.scale"] = t["layers.1.engram.embed.scale"][:-5].contiguous()
        t["layers.14.engram.q_weight"] = torch.ones(4, 31)
        t["layers.14.engram.wkv.weight"] = torch.zeros(160, 6000)

    rewrite(shard_of(bad), edit)
    msg = load_error(bad)
    assert "4 problem(s)" in msg
    # the config.json written lists each layer's rows, so only the layer's own prime sum fits
    assert (
        f"layers.1.engram.embed.weight: shape [{r1 - 5}, 256], expected [{r1}, 256] (layer 1's prime sum)"
        in msg
    )
    assert (
        f"layers.1.engram.embed.scale: shape [{r1 - 5}, 8], expected [{r1}, 8] (layer 1's prime sum)" in msg
    )
    assert f"[{r14}, 256] (engram_num_embeddings)" not in msg
    assert "layers.14.engram.q_weight: shape [4, 31], expected [4, 32]" in msg
    assert "layers.14.engram.wkv.weight: shape [160, 6000], expected [160, 6144]" in msg


def test_wrong_dtypes(bad):
    def edit(t):
        t["layers.1.engram.embed.scale"] = t["layers.1.engram.embed.scale"].view(torch.uint8)
        t["layers.14.engram.embed.weight"] = t["layers.14.engram.embed.weight"].view(torch.int16)
        t["layers.14.engram.k_weight"] = torch.ones(4, 32, dtype=torch.int64)

    rewrite(shard_of(bad), edit)
    msg = load_error(bad)
    assert "layers.1.engram.embed.scale: dtype U8, expected F8_E8M0" in msg
    assert (
        "layers.14.engram.embed.weight: dtype I16, expected F8_E4M3, I8 (int8), U8 (int4) "
        "(or F32/BF16/F16/F64 for a float table)" in msg
    )
    assert "layers.14.engram.k_weight: dtype I64, expected one of F32, BF16, F16, F64" in msg


def test_unexpected_tensors(bad):
    def edit(t):
        t["layers.2.engram.embed.weight"] = torch.zeros(1, 256)
        t["layers.1.engram.wkv.bias"] = torch.zeros(160)
        t["layers.1.attn.wq.weight"] = torch.zeros(2, 2)  # not Engram's: ignored

    rewrite(shard_of(bad), edit)
    msg = load_error(bad)
    assert "2 problem(s)" in msg
    assert "layers.2.engram.embed.weight: unexpected tensor: layer 2 has no Engram module" in msg
    assert "layers.1.engram.wkv.bias: unexpected tensor: not a tensor of a deepseek-v4.1 Engram module" in msg


def test_truncated_file(bad):
    path = shard_of(bad)
    os.truncate(path, path.stat().st_size - 100)
    msg = load_error(bad)
    assert f"{path}: not a readable safetensors file" in msg and "truncated" in msg
    assert "re-copy or re-convert it" in msg and "1 problem(s)" in msg
    assert ": missing" not in msg  # the tensors are in the damaged file, not missing
    with pytest.raises(ValueError, match="truncated"):
        MmapFP8Table(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")


def test_index_naming_missing_file(v41_modules, tmp_path):
    config, modules = v41_modules
    written = save_checkpoint(tmp_path, config, modules, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    gone = written[-1].name
    gone_names = sorted(k for k, v in index["weight_map"].items() if v == gone)
    written[-1].unlink()
    msg = load_error(tmp_path)
    assert (
        f"{INDEX_FILE} maps {len(gone_names)} tensor(s) (e.g. {gone_names[0]}) to {gone}, "
        "which does not exist" in msg
    )
    assert ": missing" not in msg
    # an index naming a file that exists but lacks the tensor
    index["weight_map"][gone_names[0]] = written[0].name
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    assert (
        f"{gone_names[0]}: {INDEX_FILE} maps it to {written[0].name}, which does not hold it"
        in load_error(tmp_path)
    )


def test_config_with_wrong_num_embeddings(bad):
    path = bad / CONFIG_FILE
    hf = json.loads(path.read_text())
    hf["engram_num_embeddings"][-1] += 1
    path.write_text(json.dumps(hf))
    msg = load_error(bad)
    assert str(path) in msg and "engram_num_embeddings=" in msg and "prime sums" in msg


def test_config_mismatch_and_missing_config(bad, v41):
    config = v41[1]
    with pytest.raises(ValueError, match=r"disagrees with .*config\.json .*hidden_size: 64 vs 32"):
        load_engram_modules(bad, config.replace(hidden_size=64))
    c2, _ = load_engram_modules(bad, config)  # the matching config is accepted
    assert load_engram_modules(bad, config.replace(norm_eps=1e-5))[0].norm_eps == 1e-5  # not in config.json
    assert c2.declared_num_embeddings == Layout(config).num_embeddings  # as config.json lists them
    (bad / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_engram_modules(bad)
    assert load_engram_modules(bad, config)[0] == config


def test_checkpoint_for_another_config(bad, v41):
    """Tables of a different prime base: every table is the wrong size, and the shard records another
    layout fingerprint (nothing else is wrong)."""
    other = v41[1].replace(engram_vocab_size=(BASE + 200,) * 3)
    rows = Layout(other).num_embeddings
    (bad / CONFIG_FILE).write_text(json.dumps(to_hf_dict(other)))
    msg = load_error(bad)
    assert "5 problem(s)" in msg and f"expected [{rows[0]}, 256] (layer 1's prime sum)" in msg
    assert f"has layout fingerprint {layout_fingerprint(Layout(other))}" in msg
    assert (
        f"layers.14.engram.embed.scale: shape [{Layout(v41[1]).num_embeddings[1]}, 8], "
        f"expected [{rows[1]}, 8]" in msg
    )


def test_config_with_an_edited_seed_refused(bad, v41):
    """The seed draws the multipliers only: every table keeps its shape, so only the layout fingerprint
    the shard records tells that each row would be read for other n-grams."""
    path = bad / CONFIG_FILE
    hf = json.loads(path.read_text())
    hf["engram_seed"] += 1
    path.write_text(json.dumps(hf))
    want = layout_fingerprint(Layout(v41[1]))
    got = layout_fingerprint(Layout(v41[1].replace(seed=v41[1].seed + 1)))
    msg = load_error(bad)
    assert "1 problem(s)" in msg and "model-00001-of-00001.safetensors" in msg
    assert f"saved for the layout with fingerprint {want}" in msg and f"has layout fingerprint {got}" in msg
    assert "engram_seed" in msg and "restore the checkpoint's config.json" in msg


def test_fingerprints_recorded_and_files_without_them_load(bad, v41):
    """Our shards record the layout and each FP8 table's fingerprint; a file without them (DeepSeek's)
    loads as before."""
    meta = header(shard_of(bad))["__metadata__"]
    assert meta[LAYOUT_FINGERPRINT_KEY] == layout_fingerprint(Layout(v41[1]))
    assert {k for k in meta if k.startswith(TABLE_FINGERPRINT_KEY)} == {
        f"{TABLE_FINGERPRINT_KEY}.1",
        f"{TABLE_FINGERPRINT_KEY}.14",
    }
    rewrite(shard_of(bad), lambda t: None)  # the safetensors package writes no metadata
    assert "__metadata__" not in header(shard_of(bad))
    assert set(load_engram_modules(bad)[1]) == {1, 14}


def test_duplicate_tensor_across_files(bad):
    save_file({"layers.1.engram.q_weight": torch.ones(4, 32)}, str(bad / "extra.safetensors"))
    assert "layers.1.engram.q_weight: in both extra.safetensors and model-00001-of-00001.safetensors" in (
        load_error(bad)
    )


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        load_engram_modules(tmp_path / "nope")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(to_hf_dict(EngramConfig.preset("tiny"))))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_engram_modules(tmp_path)


# ----------------------------------------------------------------- what a checkpoint may name and hold


@pytest.fixture
def indexed(v41_modules, tmp_path) -> Path:
    """A checkpoint of several shards with model.safetensors.index.json, and beside it (outside it) a
    copy of its first shard."""
    config, modules = v41_modules
    ckpt = tmp_path / "ckpt"
    written = save_checkpoint(ckpt, config, modules, max_shard_bytes=1 << 20)
    (tmp_path / "outside.safetensors").write_bytes(written[0].read_bytes())
    return ckpt


def remap(ckpt: Path, shard: str, to: str) -> list[str]:
    """Point the index's tensors of `shard` at file name `to`; return those tensors."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    names = sorted(k for k, v in index["weight_map"].items() if v == shard)
    index["weight_map"].update(dict.fromkeys(names, to))
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    return names


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute", "link"])
def test_index_naming_a_file_outside_is_refused(indexed, tmp_path, where):
    first = shards(indexed)[0].name
    outside = tmp_path / "outside.safetensors"
    name = {
        "../outside.safetensors": "../outside.safetensors",
        "absolute": str(outside),
        "link": "l.safetensors",
    }
    if where == "link":
        (indexed / "l.safetensors").symlink_to(outside)
    names = remap(indexed, first, name[where])
    (indexed / first).unlink()  # the data now exists only outside the folder
    msg = load_error(indexed)
    assert f"{indexed / INDEX_FILE} maps {len(names)} tensor(s) (e.g. {names[0]}) to {name[where]!r}" in msg
    assert ("a symlink to" if where == "link" else "which is not a plain file name") in msg
    assert ": missing" not in msg
    with pytest.raises(ValueError, match=r"not a plain file name|a symlink to"):
        convert_table(indexed, tmp_path / "copy", to="float")  # the outside data is not copied in
    assert not (tmp_path / "copy").exists() or not shards(tmp_path / "copy")


def test_index_naming_a_system_file_or_a_fifo(indexed, mkfifo):
    first = shards(indexed)[0].name
    remap(indexed, first, "/etc/passwd")
    msg = load_error(indexed)
    assert "'/etc/passwd', which is not a plain file name" in msg and "root:" not in msg
    assert not re.search(r"\d{6,}", msg), msg  # no bytes of it shown as a number
    mkfifo(indexed / "pipe.safetensors")
    remap(indexed, "/etc/passwd", "pipe.safetensors")
    assert "'pipe.safetensors': a named pipe (FIFO), not a file" in load_error(indexed)  # never opened
    (indexed / INDEX_FILE).unlink()  # without an index, every *.safetensors is read: not the FIFO
    msg = load_error(indexed)
    assert "'pipe.safetensors': a named pipe (FIFO)" in msg


@pytest.mark.parametrize("tensor", ["wkv.weight", "q_weight", "k_weight"])
def test_nan_in_module_weights_is_refused(bad, tensor):
    name = f"layers.14.engram.{tensor}"

    def edit(t):
        t[name] = t[name].clone()
        t[name].view(-1)[7] = float("nan")

    rewrite(shard_of(bad), edit)
    msg = load_error(bad)
    assert f"{shard_of(bad)}: tensor {name!r}: 1 of its" in msg and "values are NaN or Inf" in msg
    assert "the file is damaged" in msg


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize(("tensor", "byte"), [("weight", 0x7F), ("weight", 0xFF), ("scale", 255)])
def test_nan_bytes_in_fp8_tables_are_refused(bad, mmap, tensor, byte):
    name = f"layers.1.engram.embed.{tensor}"

    def edit(t):
        raw = t[name].clone().view(torch.uint8)
        raw[100, 3] = byte
        t[name] = raw.view(t[name].dtype)

    rewrite(shard_of(bad), edit)
    msg = load_error(bad, mmap=mmap)
    assert "table 'layers.1.engram.embed.weight'" in msg and "at row 100, column 3" in msg
    assert ("NaN in e4m3" if tensor == "weight" else "255, NaN in ue8m0") in msg


def test_large_tables_are_scanned_only_with_verify(bad, monkeypatch, capsys):
    from engram.cli import main
    from engram.storage import integrity

    def edit(t):
        raw = t["layers.14.engram.embed.weight"].clone().view(torch.uint8)
        raw[5, 0] = 0x7F
        t["layers.14.engram.embed.weight"] = raw.view(torch.float8_e4m3fn)

    rewrite(shard_of(bad), edit)
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 1024)  # every table is "large"
    with pytest.warns(integrity.UnscannedTableWarning, match="was not scanned for NaN / Inf"):
        load_engram_modules(bad)
    assert "row 5, column 0" in load_error(bad, verify=True)
    # not scanned, but dequantising its NaN byte is refused as a NaN scale byte is (one rule), and
    # nothing is left behind
    assert main(["convert", str(bad), str(bad.parent / "f"), "--to", "float"]) == 2
    err = capsys.readouterr().err
    assert "engram convert: note: " in err and "only with --verify" in err
    assert "value byte 0x7F (NaN in e4m3) at row 5, column 0" in err and not (bad.parent / "f").exists()
    assert main(["convert", str(bad), str(bad.parent / "g"), "--to", "float", "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram convert: error: ") and "row 5, column 0" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------- convert


def test_convert_fp8_float_round_trip(v41, v41_modules, tmp_path):
    src, config = v41
    _, modules = v41_modules
    fl = tmp_path / "float"
    back = tmp_path / "fp8"
    convert_table(src, fl, to="float")
    h = header(shards(fl)[0])
    assert h["layers.1.engram.embed.weight"]["dtype"] == "F32" and "layers.1.engram.embed.scale" not in h
    cf, mf = load_engram_modules(fl)
    assert isinstance(mf[1].table, TrainableTable)
    for layer_id in config.layer_ids:  # FP8 -> float is exact
        assert torch.equal(mf[layer_id].table.weight.detach(), modules[layer_id].table.to_float())
    before, after = forward_all(config, modules), forward_all(cf, mf)
    for k in before:  # the same values, gathered through another path: equal up to float rounding
        torch.testing.assert_close(before[k], after[k], rtol=1e-5, atol=1e-6)

    convert_table(fl, back, to=TableFormat.FP8)
    _, mb = load_engram_modules(back, mmap=False)
    for layer_id in config.layer_ids:
        w = mf[layer_id].table.weight.detach()
        v, s = quant.quantize_rows(w)  # float -> FP8 is exactly quantize_rows ...
        assert torch.equal(raw_bytes(mb[layer_id].table.weight), raw_bytes(v))
        assert torch.equal(raw_bytes(mb[layer_id].table.scale), raw_bytes(s))
        # ... and within e4m3's half-ulp of the float table
        err = (mb[layer_id].table.to_float() - w).abs()
        block_scale = quant.scale_bytes_to_float(s).repeat_interleave(BLOCK, dim=1)
        assert err.le(w.abs() * 2**-4 + block_scale * 2**-10).all()
        assert torch.equal(mb[layer_id].wkv.weight, modules[layer_id].wkv.weight)

    bf = tmp_path / "bf16"
    convert_table(src, bf, to="float", dtype=torch.bfloat16, max_shard_bytes=1 << 20)
    assert (bf / INDEX_FILE).exists()
    _, mbf = load_engram_modules(bf, dtype=None)
    assert mbf[1].table.weight.dtype == torch.bfloat16 and mbf[1].wkv.weight.dtype == torch.float32


def test_convert_refuses(v41, tmp_path):
    src = v41[0]
    with pytest.raises(
        ValueError,
        match="format 'int3' is not one engram writes: choose one of fp8, int8, int8-row, int4, float",
    ):
        convert_table(src, tmp_path / "x", to="int3")
    with pytest.raises(ValueError, match="same directory"):
        convert_table(src, src, to="float")


def test_convert_command(v41, tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(
        ["convert", str(v41[0]), str(tmp_path / "f"), "--to", "float", "--max-shard-size", "2MB"]
    )
    assert args.max_shard_size == 2_000_000
    assert args.func(args) == 0
    assert "tables as float" in capsys.readouterr().out
    args = parser.parse_args(["convert", str(tmp_path / "f"), str(tmp_path / "q"), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["to"] == "fp8" and out["shards"] == ["model-00001-of-00001.safetensors"]
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "a", "b", "--max-shard-size", "lots"])
