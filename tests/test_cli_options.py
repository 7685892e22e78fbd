"""engram.cli.options: the one size rule (decimal K/M/G/T, binary Ki/Mi/Gi/Ti) and the shared options."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram.cli import build_parser
from engram.cli.options import (
    byte_size,
    input_file,
    output_file,
    output_folder,
    parse_size,
    positive_float,
    row_count,
    set_threads,
    whole_number,
)

DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@pytest.mark.parametrize(
    ("text", "rows"),
    [("1", 1), ("65536", 65536), ("64K", 64_000), ("64Ki", 65_536), ("64ki", 65_536), ("1.5M", 1_500_000),
     ("1.5Mi", 1_572_864), (" 4 Mi ", 4 << 20), ("2g", 2 * 10**9), ("1T", 10**12), ("1Ti", 1 << 40)],
)  # fmt: skip
def test_examples(text, rows):
    assert parse_size(text) == rows == parse_size(text, bytes_=True)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 << 30), ("2gib", 2 << 30), ("512B", 512),
     ("1.5 KB", 1500), ("1KiB", 1024)],
)  # fmt: skip
def test_byte_suffix(text, nbytes):
    assert parse_size(text, bytes_=True) == nbytes
    with pytest.raises(ValueError, match=f"{text!r}: a row count takes no B suffix"):
        parse_size(text)


@given(n=st.integers(1, 10**6), unit=st.sampled_from(sorted({**DECIMAL, **BINARY, "": 1})), b=st.booleans())
def test_rule(n, unit, b):
    """K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024, with or without B, any case."""
    want = n * {**DECIMAL, **BINARY, "": 1}[unit]
    text = f"{n}{unit}" + ("B" if b else "")
    assert parse_size(text, bytes_=True) == want
    assert parse_size(text.lower(), bytes_=True) == want == parse_size(text.upper(), bytes_=True)
    if not b:
        assert parse_size(text) == want


@given(n=st.integers(-(10**6), 0), unit=st.sampled_from(["", "K", "Mi", "GB"]))
def test_refuses_zero_and_negative(n, unit):
    with pytest.raises(ValueError, match=r"must be at least 1; write e\.g\."):
        parse_size(f"{n}{unit}", bytes_=True)


@pytest.mark.parametrize(
    ("text", "match"),
    [("lots", "'lots' is not a row count; write e.g. 65536, 64K"), ("0", "'0': a row count must be at least 1"),
     ("0.0K", "at least 1"), ("-3", "'-3': a row count must be at least 1"), ("1e6", "is not a row count"),
     ("0.3", "'0.3' is 0.3, not a whole number"), ("1.0001K", "1000.1, not a whole number"),
     ("64Kx", "is not a row count"), ("64 Pi", "is not a row count"), ("", "'' is not a row count"),
     ("K", "is not a row count"), ("1.5", "not a whole number")],
)  # fmt: skip
def test_refuses_garbage(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text)


def test_argparse_types_show_the_message(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="'5GB': a row count takes no B suffix"):
        row_count("5GB")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'nope' is not a byte size; write e\.g\. 5GB"):
        byte_size("nope")
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["cache-sim", "--cache-rows", "0"])
    assert "argument --cache-rows: '0': a row count must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "a", "b", "--max-shard-size=-5GB"])
    assert "argument --max-shard-size: '-5GB': a byte size must be at least 1" in capsys.readouterr().err


def test_defaults_keep_their_numbers():
    parser = build_parser()
    assert parser.parse_args(["cache-sim"]).cache_rows == [1 << 16, 1 << 18, 1 << 20, 1 << 22]
    assert parser.parse_args(["cache-sim", "--cache-rows", "64Ki", "1M"]).cache_rows == [65536, 10**6]
    assert parser.parse_args(["convert", "a", "b"]).max_shard_size == 5 * 10**9
    assert parser.parse_args(["convert", "a", "b", "--max-shard-size", "2GiB"]).max_shard_size == 2 << 30


def test_help_states_the_rule(capsys):
    for cmd in ("cache-sim", "convert"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        assert "powers of 1000" in capsys.readouterr().out


def test_threads(monkeypatch):
    """--threads N wins; without it, default_threads() (the idle cores) is what torch gets."""
    import torch

    import engram.kernels.threads

    before = torch.get_num_threads()
    monkeypatch.setattr(engram.kernels.threads, "default_threads", lambda: 1)
    try:
        assert set_threads(argparse.Namespace(threads=None)) == 1 and torch.get_num_threads() == 1
        assert set_threads(argparse.Namespace(threads=2)) == 2 and torch.get_num_threads() == 2
        assert set_threads(argparse.Namespace()) == 1  # a command without the option
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="--threads 0: give at least 1"):
        set_threads(argparse.Namespace(threads=0))


def test_whole_number():
    count = whole_number(1, 10, fix=" (a hint)")
    assert count("1") == 1 and count("10") == 10 and whole_number(0)("0") == 0
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"^11 is out of range; give a whole number from 1 to 10 \(a hint\)$"
    ):
        count("11")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^-2 is out of range; give a whole number >= 1$"):
        whole_number(1)("-2")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'1\.5' is not a whole number"):
        count("1.5")
    assert positive_float("0.5") == 0.5
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)


def test_paths(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert input_file(str(f)) == str(f)
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; give a file"):
        input_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        input_file(str(tmp_path / "nope"))
    assert output_folder(str(tmp_path / "new" / "deeper")) == str(
        tmp_path / "new" / "deeper"
    )  # created later
    with pytest.raises(argparse.ArgumentTypeError, match="is a file; give a folder"):
        output_folder(str(f))
    with pytest.raises(argparse.ArgumentTypeError, match=f"{f} is a file, not a folder"):
        output_folder(str(f / "sub"))
    assert output_file(str(tmp_path / "map.safetensors"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; give a file path in it"):
        output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match=f"the folder {tmp_path / 'nope'} does not exist"):
        output_file(str(tmp_path / "nope" / "map.safetensors"))
    with pytest.raises(argparse.ArgumentTypeError, match=f"{f} is a file, not a folder"):
        output_file(str(f / "map.safetensors"))
