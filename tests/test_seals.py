"""A seal cannot be stripped (issue 46 item 5): a converted file whose `engram_seal` and `engram_crc32`
were removed, then a table byte flipped, is refused in every row format: what only a sealing writer
writes (`engram_table_format.*`, `engram_base_model`, INT8 / 4-bit tables) demands the seal, and an FP8
table of an unsealed file is checked against the table fingerprint it records. A float file without
them is indistinguishable from a part saved before seals existed: it loads with a note, as documented."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest

from cli_setup import refused
from engram.checkpoint.convert import convert_table, make_scaled_v41_checkpoint
from engram.checkpoint.v41 import CRC32_KEY, SEAL_KEY, load_engram_modules, recorded_metadata
from engram.storage.integrity import UnscannedTableWarning

FORMATS = ("fp8", "int8", "int8-row", "int4", "float")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """A scaled V4.1 checkpoint (base 128) converted to every format."""
    root = tmp_path_factory.mktemp("seals")
    make_scaled_v41_checkpoint(root / "src", base=128, hidden_size=64, seed=0)
    out = {}
    for fmt in FORMATS:
        convert_table(root / "src", root / fmt, to=fmt)
        out[fmt] = root / fmt
    return out


def header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), 8 + n


def rewrite_header(path: Path, edit) -> None:
    """The file with its header's metadata edited by `edit(meta)` (the tensors' bytes unchanged)."""
    h, start = header(path)
    body = path.read_bytes()[start:]
    edit(h["__metadata__"])
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def flip_table_byte(path: Path) -> None:
    h, start = header(path)
    name = next(k for k in h if k.endswith("engram.embed.weight"))
    a, b = h[name]["data_offsets"]
    with path.open("r+b") as f:
        f.seek(start + (a + b) // 2)
        byte = f.read(1)[0]
        f.seek(start + (a + b) // 2)
        f.write(bytes([byte ^ 0x01]))


def stripped(src: Path, dst: Path, *, flip: bool = True) -> Path:
    shutil.copytree(src, dst)
    (shard,) = dst.glob("*.safetensors")

    def strip(meta: dict) -> None:
        del meta[SEAL_KEY], meta[CRC32_KEY]

    rewrite_header(shard, strip)
    if flip:
        flip_table_byte(shard)
    return dst


@pytest.mark.parametrize("fmt", ["int8", "int8-row", "int4"])
def test_a_stripped_seal_is_refused_in_the_integer_formats(converted, fmt, tmp_path):
    d = stripped(converted[fmt], tmp_path / "x")
    with pytest.raises(ValueError, match=f"no {SEAL_KEY} and no {CRC32_KEY}.*its seal was removed") as e:
        load_engram_modules(d)
    assert str(e.value).count("seal was removed") == 1  # one line for the one file
    # the format key gone too: the tensors themselves (INT8 / 4-bit values) were written with seals
    (shard,) = d.glob("*.safetensors")
    rewrite_header(shard, lambda m: [m.pop(k) for k in list(m) if k.startswith("engram_table_format")])
    with pytest.raises(ValueError, match=r"a table of (I8|U8) values.*seal was removed"):
        load_engram_modules(d)


def test_a_stripped_fp8_table_is_checked_against_its_fingerprint(converted, tmp_path):
    with pytest.raises(ValueError, match="do not match the table fingerprint"):
        load_engram_modules(stripped(converted["fp8"], tmp_path / "flipped"))
    # unflipped: a file from before seals (no CRC32s) loads, with the note
    with pytest.warns(UnscannedTableWarning, match="records no CRC32s"):
        load_engram_modules(stripped(converted["fp8"], tmp_path / "intact", flip=False))


def test_a_float_file_without_seal_loads_with_a_note_as_files_from_before(converted, tmp_path):
    with pytest.warns(UnscannedTableWarning, match="records no CRC32s"):
        load_engram_modules(stripped(converted["float"], tmp_path / "x"))


def test_the_sealed_files_load_and_a_stripped_base_model_entry_is_refused(converted, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fmt in FORMATS:
            load_engram_modules(converted[fmt])
    d = stripped(converted["float"], tmp_path / "x", flip=False)
    (shard,) = d.glob("*.safetensors")
    rewrite_header(shard, lambda m: m.update({"engram_base_model": "{}"}))
    with pytest.raises(ValueError, match=r"holds engram_base_model.*seal was removed"):
        recorded_metadata(d, "engram_base_model")


def test_run_layer_refuses_a_stripped_file_in_one_line(converted, tmp_path, capsys):
    d = stripped(converted["int4"], tmp_path / "x")
    line = refused(capsys, ["run-layer", "--checkpoint", str(d)], "seal was removed", "engram_table_format.1")
    assert "note:" not in capsys.readouterr().err and line.count(".safetensors") == 1
