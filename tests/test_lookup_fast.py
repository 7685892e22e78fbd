"""The numba lookup fast path (engram.kernels.cpu_lookup) against its torch twin, bit for bit.

`lookup.dequantize_gather(..., backend="numba")` must write exactly the bits of `backend="torch"` (the
reference twin, itself tested against the definition in test_quant.py) for every value byte, every
scale byte, NaN value bytes included, for float32 / bfloat16 / float16 output, any id shape and dtype,
any thread count, with and without deduplication; and raise the same errors. `lookup.gather_rows` must
equal `index_select`.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from engram.rowformat.fp8 import BLOCK, SCALE_DTYPE, VALUE_DTYPE
from engram.storage.lookup import dequantize_gather, gather_rows

numba = pytest.importorskip("numba")
kernels = pytest.importorskip("engram.kernels.cpu_lookup")

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that NaNs compare equal to themselves."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fp8_table(rows: int, dim: int, seed: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Random value bytes (every byte, NaN 0x7f / 0xff included) and finite scale bytes 0..254."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(0, 255, (rows, dim // block), generator=g, dtype=torch.int32).to(torch.uint8)
    return v.view(VALUE_DTYPE), s.view(SCALE_DTYPE)


def both(values, scales, rows, dtype, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    fast = dequantize_gather(values, scales, rows, dtype, backend="numba", **kw)
    ref = dequantize_gather(values, scales, rows, dtype, backend="torch", block=kw.get("block", BLOCK))
    return fast, ref


# ------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_value_byte_times_every_scale_byte(dtype: torch.dtype) -> None:
    """Row b holds all 256 value bytes under scale byte b (0..254): 65280 products, each bit-exact."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1).view(VALUE_DTYPE)
    scales = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8).view(SCALE_DTYPE)
    rows = torch.randperm(255, generator=torch.Generator().manual_seed(0))
    fast, ref = both(values, scales, rows, dtype)
    assert torch.equal(bits(fast), bits(ref))
    assert fast.isnan().sum() == 2 * 255  # the two NaN bytes stay NaN under every scale


def test_decode_matches_torch_conversion() -> None:
    """Scale byte 127 (1.0): the kernel's decode is torch's float8_e4m3fn -> float32, NaN bits included."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256).view(VALUE_DTYPE)
    scales = torch.full((1, 8), 127, dtype=torch.uint8).view(SCALE_DTYPE)
    fast = dequantize_gather(values, scales, torch.zeros(1, dtype=torch.long), backend="numba")
    assert torch.equal(bits(fast[0]), bits(values[0].float()))


@pytest.mark.parametrize("idt", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5), (40,), (), (0, 4), (4096,)])
def test_matches_torch_backend(idt: torch.dtype, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    values, scales = fp8_table(300, 64, seed=1)
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 300, shape, generator=g).to(idt)
    fast, ref = both(values, scales, rows, dtype)
    assert fast.shape == (*shape, 64) and fast.dtype == dtype
    assert torch.equal(bits(fast), bits(ref))


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_and_repeats(threads: int, dtype: torch.dtype) -> None:
    """Zipfian ids (most positions repeat a hot row), 5000 positions: dedup windows and thread chunks
    cross each other; the result must not depend on either."""
    values, scales = fp8_table(2000, 256, seed=3)
    rng = np.random.default_rng(4)
    rows = torch.from_numpy((rng.zipf(1.3, size=(5000,)) * 7919) % 2000)
    fast, ref = both(values, scales, rows, dtype, threads=threads)
    assert torch.equal(bits(fast), bits(ref))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_modes(stream: bool, dedup: bool, dtype: torch.dtype) -> None:
    """The kernel itself, deduplicating or not, with plain or streaming stores, over uneven ranges."""
    values, scales = fp8_table(50, 128, seed=5)
    rows = torch.randint(0, 50, (3000,), generator=torch.Generator().manual_seed(6))
    ref = dequantize_gather(values, scales, rows, dtype, backend="torch")
    out = torch.zeros(3000, 128, dtype=dtype)  # torch allocations are 64-byte aligned: streaming is allowed
    o = out.numpy() if dtype == torch.float32 else out.view(torch.uint16).numpy()
    nan_pos, nan_neg, bf16_nan = kernels.torch_nan_bits()
    args = (values.view(torch.uint8).numpy(), scales.view(torch.uint8).numpy(), rows.numpy(), o)
    for start, end in [(0, 1), (1, 1100), (1100, 2999), (2999, 3000)]:
        code, pos = kernels.gather_fp8_range(
            *args, np.uint32(nan_pos), np.uint32(nan_neg), np.uint16(bf16_nan), dedup, stream, start, end
        )
        assert (code, pos) == (kernels.OK, -1)
    assert torch.equal(bits(out), bits(ref))


def test_streaming_chosen_for_large_aligned_outputs() -> None:
    assert kernels.stream_out(torch.empty(1 << 13, 256))  # 8 MiB, 1 KiB rows
    assert not kernels.stream_out(torch.empty(64, 256))  # small: left in the cache for its consumer
    assert not kernels.stream_out(torch.empty(1 << 15, 40))  # 160-byte rows are not whole cache lines
    assert not kernels.stream_out(torch.empty((1 << 22) + 1)[1:].view(1 << 14, 256))  # base 4 bytes off


@pytest.mark.parametrize("block", [16, 64])
def test_other_block_widths(block: int) -> None:
    values, scales = fp8_table(30, 128, seed=7, block=block)
    rows = torch.randint(0, 30, (9, 4), generator=torch.Generator().manual_seed(8))
    fast, ref = both(values, scales, rows, torch.float32, block=block)
    assert torch.equal(bits(fast), bits(ref))


def test_out_is_written_and_returned() -> None:
    values, scales = fp8_table(20, 64, seed=9)
    rows = torch.tensor([[3, 3, 19], [0, 5, 3]])
    for dtype in OUT_DTYPES:
        out = torch.full((2, 3, 64), 7.0, dtype=dtype)
        assert dequantize_gather(values, scales, rows, dtype, out, backend="numba") is out
        assert torch.equal(bits(out), bits(dequantize_gather(values, scales, rows, dtype, backend="torch")))


def test_memory_mapped_table(tmp_path) -> None:
    """A read-only file-backed table (what MmapFP8Table maps) is read in place."""
    values, scales = fp8_table(64, 256, seed=10)
    path = tmp_path / "values.bin"
    path.write_bytes(values.view(torch.uint8).numpy().tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(64, 256))
    with warnings.catch_warnings():  # torch warns (once) that the array is not writable: intended
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(mm).view(VALUE_DTYPE)
    rows = torch.tensor([63, 0, 63, 17])
    fast = dequantize_gather(mapped, scales, rows, torch.bfloat16, backend="numba")
    assert torch.equal(
        bits(fast), bits(dequantize_gather(values, scales, rows, torch.bfloat16, backend="torch"))
    )


def test_auto_backend_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    values, scales = fp8_table(10, 64, seed=11)
    rows = torch.tensor([1, 2, 1])
    ref = dequantize_gather(values, scales, rows, backend="torch")
    assert torch.equal(bits(dequantize_gather(values, scales, rows)), bits(ref))  # auto
    # a non-contiguous table: auto takes the torch path, numba refuses
    wide_v = torch.cat([values.view(torch.uint8)] * 2, dim=1)[:, :64].view(VALUE_DTYPE)
    assert not wide_v.is_contiguous()
    assert torch.equal(bits(dequantize_gather(wide_v, scales, rows)), bits(ref))
    with pytest.raises(ValueError, match=r"contiguous CPU tables.*not contiguous"):
        dequantize_gather(wide_v, scales, rows, backend="numba")
    with pytest.raises(ValueError, match=r"backend='cuda' is not one of 'auto', 'numba', 'torch'"):
        dequantize_gather(values, scales, rows, backend="cuda")
    with pytest.raises(ValueError, match="threads=0"):
        dequantize_gather(values, scales, rows, threads=0)
    with pytest.raises(TypeError, match="threads"):
        dequantize_gather(values, scales, rows, threads=1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", ["numba", "torch", "auto"])
def test_same_errors(backend: str) -> None:
    values, scales = fp8_table(10, 64, seed=12)
    with pytest.raises(ValueError, match=r"row id -1 at position \(1, 0\) is out of range \[0, 10\)"):
        dequantize_gather(values, scales, torch.tensor([[0, 1], [-1, 10]]), backend=backend)
    with pytest.raises(ValueError, match=r"row id 10 at position \(1, 1\) is out of range \[0, 10\)"):
        dequantize_gather(values, scales, torch.tensor([[0, 1], [3, 10]], dtype=torch.int32), backend=backend)
    bad = scales.view(torch.uint8).clone()
    bad[4, 1] = 255
    bad_scales = bad.view(SCALE_DTYPE)
    for dtype in OUT_DTYPES:
        with pytest.raises(ValueError, match=r"NaN scale.*table row 4, block 1"):
            dequantize_gather(values, bad_scales, torch.tensor([0, 4, 4, 4]), dtype, backend=backend)
    ok = dequantize_gather(values, bad_scales, torch.tensor([0, 5]), backend=backend)  # only requested rows
    assert ok.shape == (2, 64)


def test_bad_row_found_by_any_thread() -> None:
    values, scales = fp8_table(10, 64, seed=13)
    rows = torch.zeros(5000, dtype=torch.long)
    rows[4000] = 99
    with pytest.raises(ValueError, match=r"row id 99 at position \(4000,\)"):
        dequantize_gather(values, scales, rows, backend="numba", threads=3)


# ----------------------------------------------------------------------------------------- gather_rows
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize(("threads", "dim"), [(1, 48), (2, 48), (2, 256), (16, 256)])
def test_gather_rows(wdt: torch.dtype, backend: str, threads: int, dim: int) -> None:
    """dim 256: an output of 4.5 MiB or more with whole cache-line rows, written with streaming stores;
    16 threads: the chunks of a 16-core machine (the GPU machine's default), on any machine."""
    g = torch.Generator().manual_seed(14)
    weight = torch.randn(500, dim, generator=g).to(wdt)
    rows = torch.randint(0, 500, (3, 3000), generator=g)
    got = gather_rows(weight, rows, backend=backend, threads=threads)
    assert got.dtype == wdt and got.shape == (3, 3000, dim)
    assert torch.equal(got, weight[rows])
    out = torch.empty_like(got)
    assert gather_rows(weight, rows.int(), out, backend=backend) is out
    assert torch.equal(out, got)


def test_gather_rows_no_autograd_and_errors() -> None:
    weight = torch.randn(10, 8, requires_grad=True)
    got = gather_rows(weight, torch.tensor([1, 9]))
    assert not got.requires_grad
    assert torch.equal(got, weight.detach()[[1, 9]])
    for backend in ("numba", "torch"):
        with pytest.raises(ValueError, match=r"row id 10 at position \(0, 1\) is out of range \[0, 10\)"):
            gather_rows(weight, torch.tensor([[0, 10]]), backend=backend)
    with pytest.raises(TypeError, match="floating-point table"):
        gather_rows(torch.zeros(4, 4, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(TypeError, match="rows must be int64 or int32 row ids"):
        gather_rows(weight, torch.tensor([0.0]))
    assert gather_rows(weight, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, 8)


def test_import_engram_stays_light() -> None:
    """`import engram` imports neither the numba lookup kernels nor triton (both load on first use)."""
    code = (
        "import sys, engram, engram.storage.quant, engram.model.table, engram.model.module; "
        "bad = [m for m in ('engram.kernels.cpu_lookup', 'triton', 'engram.kernels.triton_gate') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
