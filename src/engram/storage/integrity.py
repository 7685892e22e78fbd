"""What a loaded checkpoint's tensors hold: NaN / Inf scans (float and FP8 bytes; the integer row formats'
scales, which must be finite and positive: `check_quant_table`) shared by every loader,
in chunks, of a whole table or one read in pieces (a row file); tables over `SCAN_LIMIT_BYTES` only
when asked; `table_fingerprint`, the content hash that ties a row file to the table it was written
from; `tensor_crc32` (a tensor's bytes, in blocks if need be) and `crc32_combine` (the CRC32 of two
byte strings from theirs: rows written by several processes give the whole tensor's). Knows no
checkpoint formats, configs or models. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import hashlib
import json
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from engram.rowformat.formats import RowFormat

__all__ = [
    "SCAN_LIMIT_BYTES",
    "UnscannedTableWarning",
    "check_finite",
    "check_fp8_rows",
    "check_fp8_table",
    "check_quant_rows",
    "check_quant_table",
    "crc32_combine",
    "fingerprint_blocks",
    "scan_table",
    "table_fingerprint",
    "tensor_crc32",
]

SCAN_LIMIT_BYTES = 256 * 2**20
_CHUNK_BYTES = 64 * 2**20  # bytes scanned at a time
_CRC_CHUNK = 16 * 2**20  # bytes a zlib.crc32 call takes (about 3 GB/s on one core)
_FIX = "the file is damaged: re-copy it, or resume / convert from an intact checkpoint"


class UnscannedTableWarning(UserWarning):
    """A table was loaded without scanning it for NaN / Inf or checking its CRC32s (it is larger than
    SCAN_LIMIT_BYTES), or from a file that records no CRC32s."""


def _chunks(flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(start, piece) over a 1-D tensor, about _CHUNK_BYTES each."""
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
    return [(a, flat[a : a + step]) for a in range(0, flat.numel(), step)]


def _count(flat: torch.Tensor, test: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int]:
    """(how many, flat index of the first) of the values of 1-D `flat` where `test` is True, chunk by chunk
    (bounded temporaries); (0, -1) when none."""
    bad, first = 0, -1
    for start, piece in _chunks(flat):
        hit = test(piece)
        if bool(hit.any()):  # sync point (a loader's check, not a hot path)
            idx = torch.nonzero(hit).reshape(-1)
            if first < 0:
                first = start + int(idx[0])
            bad += idx.numel()
    return bad, first


def _position(index: int, shape: torch.Size) -> str:
    """A flat index as a position: "row 3, column 7" for a matrix, "[i, j, k]" otherwise."""
    pos = []
    for size in reversed(shape):
        pos.append(index % size)
        index //= size
    pos.reverse()
    if len(pos) == 2:
        return f"row {pos[0]}, column {pos[1]}"
    return f"position {pos}" if pos else "its only value"


def check_finite(t: torch.Tensor, where: str) -> None:
    """ValueError unless every value of `t` is finite (integer and bool tensors always are); `where` names
    the tensor (e.g. "model.safetensors: tensor 'wkv.weight'")."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    flat = t.detach().reshape(-1)
    bad, first = _count(flat, lambda piece: ~torch.isfinite(piece))
    if bad:
        value = float(flat[first])
        raise ValueError(
            f"{where}: {bad} of its {flat.numel()} values are NaN or Inf (the first, {value}, at "
            f"{_position(first, t.shape)}); {_FIX}"
        )


# (what, the NaN test on its bytes, the NaN bytes in words) of an FP8 table's two tensors
_FP8_NAN: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor], str], ...] = (
    ("values", lambda b: (b & 0x7F) == 0x7F, "0x7F / 0xFF, NaN in e4m3"),
    ("scales", lambda b: b == 0xFF, "255, NaN in ue8m0"),
)


def check_fp8_table(weight: torch.Tensor, scale: torch.Tensor, where: str, fix: str = _FIX) -> None:
    """ValueError if an FP8 table's values (float8_e4m3fn [rows, dim]) hold a NaN byte (0x7F / 0xFF) or its
    scales (float8_e8m0fnu [rows, dim // 32]) the NaN byte 255; reads every byte (`scan_table` decides).
    `fix`: what the message tells to do (default: a damaged file's)."""
    for t, (name, test, nan) in zip((weight, scale), _FP8_NAN, strict=True):
        flat = t.reshape(-1).view(torch.uint8)
        bad, first = _count(flat, test)
        if bad:
            raise ValueError(
                f"{where}: {bad} of its {flat.numel()} {name} are the byte {nan} (the first at "
                f"{_position(first, t.shape)}); {fix}"
            )


def check_fp8_rows(
    pieces: Iterable[tuple[int, torch.Tensor, torch.Tensor]], where: str, fix: str = _FIX
) -> None:
    """`check_fp8_table` over a table read in pieces (a row file): (first row, values (n, dim), scales
    (n, dim // 32)), FP8 or their uint8 bytes. Every piece is read; the error counts over all of them and
    names the first bad row, and `fix`."""
    bad, total, first = [0, 0], [0, 0], ["", ""]
    for row0, values, scales in pieces:
        for k, (t, (_, test, _)) in enumerate(zip((values, scales), _FP8_NAN, strict=True)):
            flat = t.reshape(-1).view(torch.uint8)
            n, i = _count(flat, test)
            total[k] += flat.numel()
            if n and not bad[k]:
                first[k] = f"row {row0 + i // t.shape[1]}, column {i % t.shape[1]}"
            bad[k] += n
    for k, (name, _, nan) in enumerate(_FP8_NAN):
        if bad[k]:
            raise ValueError(
                f"{where}: {bad[k]} of its {total[k]} {name} are the byte {nan} (the first at {first[k]}); {fix}"
            )


def _bad_int_scale(s: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits (int16 / uint16 view, any shape) -> bool: not a finite positive number (0, NaN,
    inf, negative: the bits 0 and 0x7F80..0xFFFF)."""
    b = s.view(torch.int16).to(torch.int32) & 0xFFFF
    return (b == 0) | (b >= 0x7F80)


def _int_scale_problem(t: torch.Tensor, first: int, bad: int, shape_txt: str) -> str:
    value = float(t.reshape(-1)[first])
    return f"{bad} of its {t.numel()} scales are not finite and positive (the first, {value}, at {shape_txt})"


def check_quant_table(
    weight: torch.Tensor, scale: torch.Tensor, fmt: RowFormat, where: str, fix: str = _FIX
) -> None:
    """`check_fp8_table` for any row format: an integer format's values are all valid, its bfloat16
    scales must be finite and positive (NaN, inf, zero or negative: the file is damaged)."""
    if fmt is RowFormat.FP8:
        check_fp8_table(weight, scale, where, fix)
        return
    flat = scale.reshape(-1)
    bad, first = _count(flat, _bad_int_scale)
    if bad:
        raise ValueError(
            f"{where}: {_int_scale_problem(flat, first, bad, _position(first, scale.shape))}; {fix}"
        )


def check_quant_rows(
    pieces: Iterable[tuple[int, torch.Tensor, torch.Tensor]], fmt: RowFormat, where: str, fix: str = _FIX
) -> None:
    """`check_fp8_rows` for any row format: pieces (first row, values, scales) of a table read in pieces
    (a row file), the scales of an integer format as bfloat16 (or their bytes, two a scale)."""
    if fmt is RowFormat.FP8:
        check_fp8_rows(pieces, where, fix)
        return
    bad, total, first = 0, 0, ""
    for row0, _, scales in pieces:
        s = scales if scales.dtype == torch.bfloat16 else scales.contiguous().view(torch.bfloat16)
        flat = s.reshape(-1)
        n, i = _count(flat, _bad_int_scale)
        total += flat.numel()
        if n and not bad:
            first = f"{float(flat[i])} at row {row0 + i // s.shape[1]}, block {i % s.shape[1]}"
        bad += n
    if bad:
        raise ValueError(
            f"{where}: {bad} of its {total} scales are not finite and positive (the first, {first}); {fix}"
        )


def table_fingerprint(weight: torch.Tensor, scale: torch.Tensor) -> str:
    """sha256 (64 hex digits) of an FP8 table's shape and bytes: values (rows, dim), then scales. One pass
    over the bytes (about 1 s a GB), in chunks; what a row file records of the table it was written from."""

    def pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
        flat = t.detach().cpu().reshape(-1).view(torch.uint8)
        return (piece for _, piece in _chunks(flat))

    return fingerprint_blocks(weight.shape, scale.shape, pieces(weight), pieces(scale))


def fingerprint_blocks(
    weight_shape: Sequence[int],
    scale_shape: Sequence[int],
    weight_blocks: Iterable[torch.Tensor],
    scale_blocks: Iterable[torch.Tensor],
) -> str:
    """`table_fingerprint` of a table given as blocks of its values, then of its scales, in row order
    (e.g. read from a file a block at a time: `TensorFile.iter_rows`, so the file is never mapped)."""
    h = hashlib.sha256(json.dumps([list(weight_shape), list(scale_shape)]).encode())
    for blocks in (weight_blocks, scale_blocks):
        for b in blocks:
            h.update(memoryview(b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def scan_table(nbytes: int, verify: bool, where: str) -> bool:
    """Whether to scan a table of `nbytes` bytes: always with `verify`, else up to SCAN_LIMIT_BYTES. When
    not, warn (`UnscannedTableWarning`) naming the table and how to scan it."""
    if verify or nbytes <= SCAN_LIMIT_BYTES:
        return True
    warnings.warn(
        f"{where} ({nbytes / 2**30:.1f} GiB) was not scanned for NaN / Inf nor checked against its CRC32s: "
        f"tables over {SCAN_LIMIT_BYTES // 2**20} MiB are scanned only with --verify (verify=True)",
        UnscannedTableWarning,
        stacklevel=3,
    )
    return False


# ---------------------------------------------------------------------------------------- CRC32s
def tensor_crc32(t: torch.Tensor, crc: int = 0) -> int:
    """CRC32 of a tensor's bytes (C order), in chunks (a memory-mapped tensor is read as it goes).
    `crc`: the CRC32 of the bytes before these (a tensor read in blocks of rows: each block's
    `tensor_crc32(block, crc)` in turn gives the whole tensor's)."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    for a in range(0, flat.numel(), _CRC_CHUNK):
        crc = zlib.crc32(memoryview(flat[a : a + _CRC_CHUNK].numpy()), crc)
    return crc


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) in bytes (zlib's
    `crc32_combine`, which Python's zlib does not expose: crc1 advanced over len2 zero bytes by
    squaring the GF(2) operator of one zero bit, log2(len2) steps, then xor crc2)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator of one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four
    while True:  # apply len2 zero bytes: one operator per set bit of len2
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2
