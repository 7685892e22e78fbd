"""Tests for engram.checkpoint.files: the thin wrapper over the `safetensors` package's file API.

Round trips are bitwise (every FP8 byte value included), files are cross-read with plain `safetensors`
(`safe_open` / `save_file`, an independent reader and writer), and every refusal names the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engram.checkpoint.files import (
    DTYPES,
    TensorEntry,
    dtype_name,
    listed_names,
    load_tensors,
    member_file,
    open_tensors,
    save_tensors,
)


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor of every dtype an Engram checkpoint holds; the 1-byte ones hold all 256 byte values."""
    g = torch.Generator().manual_seed(0)
    byte_values = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        if dtype == torch.bool:
            out[name] = torch.rand(5, 3, generator=g) > 0.5
        elif dtype.itemsize == 1:
            out[name] = byte_values.view(
                dtype
            ).clone()  # float8 NaNs, infinities, e8m0's 0xFF: bits, not values
        elif dtype.is_floating_point:
            out[name] = (torch.randn(4, 6, generator=g) * 1e3).to(dtype)
        else:
            out[name] = torch.randint(
                torch.iinfo(dtype).min, torch.iinfo(dtype).max, (7,), generator=g, dtype=dtype
            )
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    out["not_contiguous"] = torch.randn(4, 6, generator=g).t()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or a.numel() == 0 or a.dim() == 0:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_round_trip_every_dtype_bitwise(tmp_path):
    tensors = every_dtype()
    path = tmp_path / "t.safetensors"
    nbytes = save_tensors(path, tensors, metadata={"note": "x"})
    assert nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    f = open_tensors(path)
    assert f.keys() == sorted(tensors) and list(f) == f.keys() and "F8_E8M0" in f and "nope" not in f
    assert f.metadata == {"format": "pt", "note": "x"}  # format "pt": Hugging Face loaders expect it
    for name, t in tensors.items():
        assert f.entry(name) == TensorEntry(path, name, dtype_name(t.dtype), tuple(t.shape))
        assert f.entry(name).torch_dtype == t.dtype
        assert same_bits(f.tensor(name), t), name
        if t.dim():
            assert same_bits(f.slice(name)[1:3], t[1:3]), name
    loaded = load_tensors(path)
    assert sorted(loaded) == sorted(tensors) and all(same_bits(loaded[k], t) for k, t in tensors.items())


def test_plain_safetensors_reads_our_files_and_we_read_its(tmp_path):
    tensors = every_dtype()
    ours = tmp_path / "ours.safetensors"
    save_tensors(ours, tensors)
    with safe_open(str(ours), "pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert same_bits(f.get_tensor(name), t), name
    theirs = tmp_path / "theirs.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(theirs))
    f = open_tensors(theirs)
    assert all(same_bits(f.tensor(k), t) for k, t in tensors.items())


def _mapping_of(ptr: int) -> str | None:
    """The file backing address `ptr` in this process (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) > 5 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_tensors_are_memory_mapped_not_copied(tmp_path):
    big = torch.randint(0, 256, (1024, 32 * 1024), dtype=torch.uint8)  # 32 MiB
    path = tmp_path / "big.safetensors"
    save_tensors(path, {"w": big.view(torch.float8_e4m3fn), "s": torch.ones(3)})
    f = open_tensors(path)
    w = f.tensor("w")
    assert _mapping_of(w.data_ptr()) == str(path.resolve())  # the file's pages, not a copy
    rows = f.slice("w")[100:110]
    assert _mapping_of(rows.data_ptr()) == str(path.resolve())
    assert same_bits(rows, big[100:110].view(torch.float8_e4m3fn))
    assert _mapping_of(load_tensors(path)["w"].data_ptr()) == str(path.resolve())
    before = path.read_bytes()
    w.view(torch.uint8)[0].fill_(7)  # copy-on-write: this process's page changes, the file does not
    assert path.read_bytes() == before and w.view(torch.uint8)[0, 0] == 7


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.safetensors"
    save_tensors(path, {"a": torch.ones(64), "b": torch.zeros(3, dtype=torch.int64)})
    size = path.stat().st_size
    for cut in (size - 1, size // 2, 12, 3, 0):
        os.truncate(path, cut)
        with pytest.raises(ValueError) as e:
            open_tensors(path)
        msg = str(e.value)
        assert msg.startswith(f"{path}: not a readable safetensors file ({cut} bytes") and msg.endswith(
            "re-copy or re-convert it"
        ), msg
        if cut > 12:  # the header is whole: the listing of what the damaged file holds survives
            assert "truncated" in msg and listed_names(path) == ["a", "b"]
        else:
            assert listed_names(path) == []
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors: no such safetensors file"):
        open_tensors(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="a folder, not a safetensors file"):
        open_tensors(tmp_path)


def test_foreign_file_is_refused_without_its_bytes_as_a_number(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("these are notes, not tensors\n" * 3)
    with pytest.raises(ValueError) as e:
        open_tensors(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: not a readable safetensors file") and "is it a safetensors file?" in msg
    assert not re.search(r"\d{6,}", msg.replace(str(path), "")), msg  # the text read as a length: not shown
    assert listed_names(path) == []
    (tmp_path / "junk.safetensors").write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ValueError, match=r"junk\.safetensors: not a readable safetensors file"):
        open_tensors(tmp_path / "junk.safetensors")


def test_wrong_dtype_shape_or_name_is_refused_naming_both(tmp_path):
    path = tmp_path / "t.safetensors"
    save_tensors(path, {"w": torch.zeros(4, 32, dtype=torch.float8_e4m3fn), "s": torch.zeros(4, 1)})
    f = open_tensors(path)
    assert f.expect("w", torch.float8_e4m3fn, ["rows", 32]).shape == (4, 32)  # a str matches any size
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: tensor 's' has dtype F32, expected F8_E8M0$"
    ):
        f.expect("s", torch.float8_e8m0fnu, [4, 1])
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \[4, 32\], expected \[4, 16\]"):
        f.expect("w", torch.float8_e4m3fn, [4, 16])
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \[4, 32\], expected \['rows'\]"):
        f.expect("w", torch.float8_e4m3fn, ["rows"])
    for call in (f.entry, f.tensor, f.slice):
        with pytest.raises(ValueError, match=r"t.safetensors: no tensor 'x' \(the file holds: s, w\)"):
            call("x")
    with pytest.raises(TypeError, match="complex64 is not one an Engram checkpoint holds"):
        f.expect("w", torch.complex64, [4, 32])


def test_save_refusals_name_the_file_and_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    with pytest.raises(
        TypeError, match=r"t.safetensors: tensor 'c' has dtype torch.complex64.*cast it first"
    ):
        save_tensors(path, {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"tensor 'l' is a list, expected a torch.Tensor"):
        save_tensors(path, {"l": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="metadata 'n' is not str -> str"):
        save_tensors(path, {"a": torch.ones(2)}, metadata={"n": 3})  # type: ignore[dict-item]
    with pytest.raises(FileNotFoundError, match=r"the folder .*nope does not exist; create it first"):
        save_tensors(tmp_path / "nope" / "t.safetensors", {"a": torch.ones(2)})
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"t.safetensors: could not write .*share memory.*\.clone\(\)"):
        save_tensors(path, {"a": x, "b": x})
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"dir.safetensors: could not write the safetensors file"):
        save_tensors(tmp_path / "dir.safetensors", {"a": x})  # safetensors' own error, wrapped
    assert not path.exists()  # nothing was written by a refused save
    save_tensors(path, {"a": x[:2], "b": x[2:]})  # views that do not overlap are fine
    assert load_tensors(path)["b"].tolist() == [1.0, 1.0]


@pytest.mark.gpu
def test_save_from_the_gpu(tmp_path):
    t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).cuda()
    save_tensors(tmp_path / "g.safetensors", {"s": t})
    assert same_bits(open_tensors(tmp_path / "g.safetensors").tensor("s"), t.cpu())


# ------------------------------------------------------------------ names a checkpoint holds


def test_member_file_accepts_plain_names_and_links_inside(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "link.safetensors").symlink_to("a.safetensors")
    assert member_file(tmp_path, "a.safetensors", "the index maps 't' to") == tmp_path / "a.safetensors"
    assert member_file(tmp_path, "link.safetensors", "the index maps 't' to") == tmp_path / "link.safetensors"


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "sub/a.safetensors", "..", ".", ""])
def test_member_file_refuses_paths(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (tmp_path / "x.safetensors").write_bytes(b"x")
    (ckpt / "sub" / "a.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError) as e:
        member_file(ckpt, name, "index.json maps 't' to")
    msg = str(e.value)
    assert msg.startswith(f"index.json maps 't' to {name!r}, which is not a plain file name")
    assert f"inside its own folder {ckpt}" in msg
    with pytest.raises(TypeError, match="a int, expected a file name"):
        member_file(ckpt, 3, "index.json maps 't' to")


def test_member_file_refuses_links_out_and_special_files(tmp_path, mkfifo):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (ckpt / "out.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(
        ValueError, match=r"'out.safetensors', a symlink to .*outside.safetensors, outside the"
    ):
        member_file(ckpt, "out.safetensors", "state.json names")
    mkfifo(ckpt / "pipe.safetensors")
    with pytest.raises(
        ValueError, match=r"state.json names 'pipe.safetensors': a named pipe \(FIFO\), not a"
    ):
        member_file(ckpt, "pipe.safetensors", "state.json names")
    (ckpt / "dir.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"'dir\.safetensors': a folder, not a file"):
        member_file(ckpt, "dir.safetensors", "state.json names")
    with pytest.raises(FileNotFoundError, match=rf"'gone.safetensors', which does not exist in {ckpt}"):
        member_file(ckpt, "gone.safetensors", "state.json names")
    # open_tensors itself never opens a FIFO (it would block until a writer came)
    with pytest.raises(ValueError, match=r"pipe.safetensors: a named pipe \(FIFO\), not a safetensors file"):
        open_tensors(ckpt / "pipe.safetensors")
    assert listed_names(ckpt / "pipe.safetensors") == []


def test_file_watch_sees_truncation_of_the_opened_file(tmp_path):
    """TensorFile.watch(): silent while the file holds its bytes (or grows, or its path is replaced:
    the descriptor still sees the mapped file), a ValueError naming the file and both sizes once it
    is truncated; copies share it, a pickled one reopens the path."""
    import copy
    import pickle

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(100, dtype=torch.float32)}, str(path))
    f = open_tensors(path)
    watch = f.watch()
    assert watch.size == f.size == path.stat().st_size
    watch.check()
    assert copy.deepcopy(watch) is watch and pickle.loads(pickle.dumps(watch)).size == watch.size
    with open(path, "ab") as out:
        out.write(b"\0" * 8)
    watch.check()  # larger is fine: the mapped bytes are all there
    os.truncate(path, 100)
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(path))} was truncated after it was opened: 100 bytes, expected {watch.size}; .*Restore the file",
    ):
        watch.check()
    other = tmp_path / "other.safetensors"
    save_file({"a": torch.arange(100, dtype=torch.float32)}, str(other))
    watch = open_tensors(other).watch()
    os.replace(path, other)  # the path now names the truncated file; the watched one is intact
    watch.check()
