"""Issue 46 item 8, each case a refusal in one line: text that is not UTF-8 on the command line, NaN bytes
in an FP8 table (values and scales: one rule), a row file's page size of 0, a tokenizer folder whose
tokenizer.json links out of it (the model folder's rule), `engram convert` of a folder without config.json
(the CLI's fix, not `config=`), and one damaged file reported once, not once per tensor after it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from cli_setup import refused
from engram.cli import main
from engram.model.table import FP8Table, QuantTable
from engram.storage.quant import dequantize_rows
from engram.storage.rowfile import RowFileHeader

NOT_UTF8 = "in the beginning \udcff"  # what Python makes of the byte 0xFF in argv (surrogateescape)


def test_text_that_is_not_utf8_is_refused_in_one_line(capsys, tmp_path):
    refused(
        capsys, ["hash", "--text", NOT_UTF8], "argument --text", "not UTF-8 text (byte 0xFF at character 17)"
    )
    refused(
        capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", NOT_UTF8], "--prompt", "not UTF-8"
    )
    refused(capsys, ["run-layer", "--text", NOT_UTF8], "argument --text", "give the text in UTF-8")


def _fp8(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("value_byte, scale_byte", [(0x7F, 127), (0xFF, 127), (0, 255)])
def test_nan_bytes_are_refused_alike_in_values_and_scales(value_byte, scale_byte):
    """One rule: no stored byte dequantises to NaN (e4m3 0x7F / 0xFF, ue8m0 255), refused when the table
    is made and when rows are dequantised."""
    values = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.full((4, 1), 127, dtype=torch.uint8)
    values[2, 3], scales[2, 0] = value_byte, scale_byte
    with pytest.raises(ValueError, match=r"FP8Table: 1 of its \d+ (values|scales) are the byte .*NaN"):
        FP8Table(*_fp8(values, scales))
    with pytest.raises(ValueError, match=r"QuantTable.*NaN.*quantise float rows with from_float"):
        QuantTable(*_fp8(values, scales))
    with pytest.raises(ValueError, match=r"(value byte 0x[7F]F|scale byte 255) .*at row 2"):
        dequantize_rows(*_fp8(values, scales))
    values[2, 3], scales[2, 0] = 0x7E, 127  # 448, the largest finite e4m3 value, at scale 1
    assert torch.isfinite(FP8Table(*_fp8(values, scales)).gather(torch.tensor([2]))).all()


@pytest.mark.parametrize("page", [0, 100, 513, -4096, True])
def test_a_row_file_page_size_that_holds_no_header_is_a_value_error(page):
    with pytest.raises(ValueError, match=rf"page_bytes must be a multiple of 512 .*got {page!r}"):
        RowFileHeader(10, 256, page_bytes=page)
    assert RowFileHeader(10, 256, page_bytes=512).rows_per_group == 1


def test_a_tokenizer_folder_linking_out_is_refused_as_the_model_folder_is(tmp_path):
    pytest.importorskip("transformers")
    import hf_setup as S
    from engram.hf import add_engram, load_engram, save_engram

    model = add_engram(S.llama(), S.engram_config((0, 2)), compression=S.compression())
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    save_engram(model, folder)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    S.tokenizer().save(str(outside / "tokenizer.json"))
    (folder / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    for given in (None, folder, str(folder)):
        fresh = S.llama()
        with pytest.raises(ValueError, match=r"'tokenizer.json', a symlink to .*elsewhere.*outside"):
            load_engram(fresh, folder, tokenizer=given)
        assert not hasattr(fresh, "engram")
    assert hasattr(load_engram(S.llama(), folder, tokenizer=str(outside / "tokenizer.json")), "engram")


def test_convert_of_a_folder_without_config_names_the_cli_fix(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    (run / "checkpoints" / "step-0000002" / "state.json").write_text("{}")
    line = refused(capsys, ["convert", str(run), str(tmp_path / "x")], "is a training run of `engram train`")
    assert "config=" not in line and "config.json + *.safetensors" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(capsys, ["convert", str(empty), str(tmp_path / "y")], "has no config.json")
    assert "config=" not in line
    refused(capsys, ["run-layer", "--checkpoint", str(empty)], "has no config.json", "V4.1 format")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_one_damaged_file_is_one_line(tmp_path, capsys):
    from engram.checkpoint.convert import make_scaled_v41_checkpoint

    d = tmp_path / "ckpt"
    make_scaled_v41_checkpoint(d, base=64, hidden_size=32, seed=0)
    (shard,) = d.glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[20:30] = b"xxxxxxxxxx"  # its header no longer JSON: its tensors cannot be listed
    shard.write_bytes(bytes(raw))
    try:
        code = main(["run-layer", "--checkpoint", str(d)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.count("\n  - ") == 1 and "not a readable safetensors file" in err and "missing" not in err


def test_a_broken_seal_is_the_one_problem_of_its_file(tmp_path):
    """An edited layout fingerprint breaks the seal: the seal is reported, not the fingerprint beside it."""
    import json

    from engram.checkpoint.convert import make_scaled_v41_checkpoint
    from engram.checkpoint.v41 import load_engram_modules

    d = tmp_path / "ckpt"
    make_scaled_v41_checkpoint(d, base=64, hidden_size=32, seed=0)
    (shard,) = d.glob("*.safetensors")
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8 : 8 + n])
    h["__metadata__"]["engram_layout_fingerprint"] = "0" * 64
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(ValueError, match=r"\(1 problem\(s\)\):\n  - .*does not match its seal") as e:
        load_engram_modules(d)
    assert "fingerprint" not in str(e.value)


def test_nothing_is_left_behind_by_the_refusals(tmp_path):
    assert list(Path(tmp_path).iterdir()) == []
