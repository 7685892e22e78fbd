"""The Triton kernels of engram.kernels against their torch twins (engram.kernels.reference).

On a CUDA machine the kernels run compiled on the GPU; elsewhere under triton's interpreter on small
CPU shapes. The interpreter must be on before triton itself is imported (its standard library is
decorated then), and torch may import triton on its own in other tests, so without CUDA this file
sets TRITON_INTERPRET=1 when it is collected (before any test runs) and removes it after its last
test; the `kernels` fixture skips if triton was imported compiled all the same. Skipped when triton does not import. Exact for the
hash (also against `NgramHasher`) and the FP8 lookup; a stated tolerance for the gate's forward and
backward in float32, and in float32 and bfloat16 a bound against float64 math scaled by the gate's
conditioning (`bench_gate.rounding_scales`), also compiled at V4.1's width (marked gpu).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import EngramConfig, NgramHasher
from engram.benchmarks import bench_gate
from engram.kernels import reference
from engram.rowformat.fp8 import SCALE_DTYPE, VALUE_DTYPE
from engram.storage import lookup, quant

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's numpy overflow warnings
]

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_SET_INTERPRET = not CUDA and "TRITON_INTERPRET" not in os.environ
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # at collection: before anything can import triton
_KERNEL_MODULES = ("engram.kernels.triton_hash", "engram.kernels.triton_lookup", "engram.kernels.triton_gate")


@pytest.fixture(scope="module")
def kernels() -> Iterator[SimpleNamespace]:
    """The three kernel modules: compiled on CUDA, interpreted elsewhere (see the module docstring)."""
    try:
        triton_language = pytest.importorskip("triton.language")
        if not CUDA:
            from triton.runtime.interpreter import InterpretedFunction

            if not isinstance(triton_language.zeros, InterpretedFunction):
                pytest.skip(
                    "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 "
                    "in the environment"
                )
        mods = [
            importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            for name in _KERNEL_MODULES
        ]
        yield SimpleNamespace(hash=mods[0], lookup=mods[1], gate=mods[2])
    finally:
        if _SET_INTERPRET:
            os.environ.pop("TRITON_INTERPRET", None)


def to_dev(*arrays: np.ndarray | None) -> list[torch.Tensor | None]:
    return [None if a is None else torch.from_numpy(a).to(DEVICE) for a in arrays]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ------------------------------------------------------------------------------------------------ hash
@pytest.mark.parametrize("preset", ["tiny", "deepseek-v4.1"])
@pytest.mark.parametrize("with_dead", [False, True])
@pytest.mark.parametrize("with_window", [False, True])
def test_hash_exact(kernels, ds_compression, preset: str, with_dead: bool, with_window: bool) -> None:
    hasher = NgramHasher(EngramConfig.preset(preset), ds_compression)
    rng = np.random.default_rng(0)
    b, t = 3, 150  # > one program's 128 tokens, not a multiple of it
    xc = rng.integers(0, ds_compression.size, size=(b, t)).astype(np.int64)
    xc[0, :5] = hasher.pad
    dead = rng.random((b, t)) < 0.1 if with_dead else None
    if dead is not None:
        dead[1, :3] = True  # dead at the sequence start, next to the carried window
    window = rng.integers(0, ds_compression.size, size=(b, hasher.window_size)) if with_window else None
    tables = to_dev(hasher.multipliers, hasher.primes, hasher.offsets)
    xc_t, dead_t, win_t = to_dev(xc, dead, window)
    got = kernels.hash.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad)
    want = hasher.hash_compressed(xc, dead, window, backend="numpy")
    assert got.dtype == torch.int64 and tuple(got.shape) == want.shape
    assert np.array_equal(got.cpu().numpy(), want)
    assert torch.equal(reference.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad), got)
    out32 = torch.empty(want.shape, dtype=torch.int32, device=DEVICE)
    assert kernels.hash.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad, out=out32) is out32
    assert np.array_equal(out32.cpu().numpy(), want)


@pytest.mark.parametrize("with_dead", [False, True])
@pytest.mark.parametrize("with_window", [False, True])
def test_hash_starts_exact(kernels, with_dead: bool, with_window: bool) -> None:
    """Window restarts (`starts`) in the kernel: the numpy twin's bits, and the torch twin's."""
    config = EngramConfig.preset("tiny").replace(vocab_size=50, compressed_vocab_size=50, pad_token_id=3)
    hasher = NgramHasher(config)
    rng = np.random.default_rng(1)
    b, t = 3, 150
    xc = rng.integers(0, 50, size=(b, t)).astype(np.int64)
    starts = rng.random((b, t)) < 0.15
    starts[0, 0] = True  # a start at position 0 hides the carried window
    dead = rng.random((b, t)) < 0.1 if with_dead else None
    window = rng.integers(0, 50, size=(b, hasher.window_size)) if with_window else None
    tables = to_dev(hasher.multipliers, hasher.primes, hasher.offsets)
    xc_t, dead_t, win_t, st_t = to_dev(xc, dead, window, starts)
    got = kernels.hash.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad, starts=st_t)
    want = hasher.hash_compressed(xc, dead, window, starts=starts, backend="numpy")
    assert np.array_equal(got.cpu().numpy(), want)
    assert np.array_equal(hasher.hash_compressed(xc, dead, window, starts=starts, backend="numba"), want)
    assert torch.equal(reference.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad, starts=st_t), got)
    assert not np.array_equal(hasher.hash_compressed(xc, dead, window, backend="numpy"), want)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_hash_starts_property(kernels, data) -> None:
    """Random small shapes, ids, dead tokens, starts and windows: Triton == numba == numpy."""
    hasher = _STARTS_HASHER
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    arr = st.lists(st.integers(0, 15), min_size=b * t, max_size=b * t)
    flags = st.lists(st.sampled_from([False, False, True]), min_size=b * t, max_size=b * t)
    xc = np.array(data.draw(arr), dtype=np.int64).reshape(b, t)
    dead = np.array(data.draw(flags)).reshape(b, t) if data.draw(st.booleans()) else None
    starts = np.array(data.draw(flags)).reshape(b, t)
    window = None
    if data.draw(st.booleans()):
        window = np.array(data.draw(st.lists(st.integers(0, 15), min_size=b * 3, max_size=b * 3))).reshape(
            b, 3
        )
    want = hasher.hash_compressed(xc, dead, window, starts=starts, backend="numpy")
    assert np.array_equal(hasher.hash_compressed(xc, dead, window, starts=starts, backend="numba"), want)
    tables = to_dev(hasher.multipliers, hasher.primes, hasher.offsets)
    xc_t, dead_t, win_t, st_t = to_dev(xc, dead, window, starts)
    got = kernels.hash.hash_rows(xc_t, dead_t, win_t, *tables, hasher.pad, starts=st_t)
    assert np.array_equal(got.cpu().numpy(), want)


_STARTS_HASHER = NgramHasher(
    EngramConfig.preset("tiny").replace(
        vocab_size=16, compressed_vocab_size=16, pad_token_id=3, max_ngram_size=4
    )
)


def test_hash_golden_vectors(kernels, v41_hasher: NgramHasher, vectors: dict) -> None:
    """The published V4.1 rows of every golden case (one with dead image positions), through the kernel."""
    tables = to_dev(v41_hasher.multipliers, v41_hasher.primes, v41_hasher.offsets)
    layers = [str(lid) for lid in v41_hasher.config.layer_ids]
    for case in vectors["cases"]:
        xc = np.asarray(case["compressed_ids"], dtype=np.int64)[None]
        dead = np.asarray(case["dead_mask"], dtype=bool)[None] if "dead_mask" in case else None
        xc_t, dead_t = to_dev(xc, dead)
        got = kernels.hash.hash_rows(xc_t, dead_t, None, *tables, vectors["compressed_pad_id"]).cpu().numpy()
        for li, lid in enumerate(layers):
            assert np.array_equal(got[0, :, li], np.asarray(case["rows"][lid])), (case["text"], lid)


# ---------------------------------------------------------------------------------------------- lookup
# the gather's variants: the default; the ids sorted first (`dedup_order`: repeated rows read once);
# small programs; the integer conversions and the GPU's (sm_89+). Under the interpreter the GPU's are
# numpy's: its e4m3 NaN differs and its bf16 cast truncates, so there the every-byte test takes them on
# finite bytes and products that are normal floats (exact in bf16) only
GATHER_VARIANTS = ["default", "dedup", "block_n=4,num_warps=2", "hw_convert=False", "hw_convert=True"]


def gather_kw(kernels, variant: str, rows: torch.Tensor) -> dict:
    if variant == "default":
        return {}
    if variant == "dedup":
        return {"order": kernels.lookup.dedup_order(rows)}
    if variant.startswith("block_n"):
        return {"block_n": 4, "num_warps": 2}
    hw = variant.endswith("True")
    if hw and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the GPU's e4m3 conversion needs sm_89 or later")
    return {"hw_convert": hw}


@pytest.mark.parametrize("variant", GATHER_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_gather_every_byte(kernels, dtype: torch.dtype, variant: str) -> None:
    """Row b: all 256 value bytes under scale byte b (0..254); exact, NaN bytes NaN."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1)
    scales = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8).view(SCALE_DTYPE)
    rows = torch.randperm(255, generator=torch.Generator().manual_seed(0)).view(5, 51)
    if variant == "hw_convert=True" and not CUDA:
        values[(values & 0x7F) == 0x7F] = 0  # the interpreter's e4m3 NaN is not the GPU's
        rows = rows[rows >= 10].view(5, 49)  # scale >= 2^-117: every product a normal float
    values = values.view(VALUE_DTYPE)
    want = lookup.dequantize_gather(values, scales, rows, dtype, backend="torch")
    kw = gather_kw(kernels, variant, rows.to(DEVICE))
    got = kernels.lookup.fp8_gather(values.to(DEVICE), scales.to(DEVICE), rows.to(DEVICE), dtype, **kw).cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("variant", GATHER_VARIANTS)
@pytest.mark.parametrize(
    ("idt", "dim", "block"), [(torch.int64, 96, 32), (torch.int32, 256, 32), (torch.int64, 96, 48)]
)
def test_fp8_gather_table(kernels, idt: torch.dtype, dim: int, block: int, variant: str) -> None:
    """Random tables: 96 wide (3 blocks: a masked tile), V4.1's 256 (8 x 32) with int32 ids, and
    blocks of 48 (not a power of two), repeated ids among them."""
    g = torch.Generator().manual_seed(1)
    values, scales = quant.quantize_rows(torch.randn(300, dim, generator=g) * 10, block=block)
    rows = torch.randint(0, 300, (7, 24), generator=g).to(idt)
    rows[3] = rows[0]  # repeated rows
    kw = gather_kw(kernels, variant, rows.to(DEVICE))
    for dtype in (torch.float32, torch.bfloat16):
        want = lookup.dequantize_gather(values, scales, rows, dtype, backend="torch", block=block)
        got = kernels.lookup.fp8_gather(values.to(DEVICE), scales.to(DEVICE), rows.to(DEVICE), dtype, **kw)
        assert torch.equal(bits(got.cpu()), bits(want))
        assert torch.equal(bits(reference.fp8_gather(values, scales, rows, dtype)), bits(want))
    assert kernels.lookup.fp8_gather(values, scales, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, dim)
    with pytest.raises(ValueError, match="order must be"):
        kernels.lookup.fp8_gather(values, scales, rows, order=(rows.reshape(-1)[:5], rows.reshape(-1)[:5]))


@pytest.mark.parametrize("fmt", ["int8", "int8-row", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int_gather_every_byte(kernels, fmt: str, dtype: torch.dtype) -> None:
    """The integer formats: every value byte (int8, or 512 nibbles) under bfloat16 scales from subnormals
    to 2^120, D = 256 / 512; exact against the numba-free torch backend and the plain twin."""
    from engram.rowformat.formats import RowFormat

    rf = RowFormat(fmt)
    g = torch.Generator().manual_seed(2)
    dim = 256 * rf.values_per_byte
    values = torch.randperm(256, generator=g).to(torch.uint8).repeat(40, 1)
    if rf is not RowFormat.INT4_BLOCK32:
        values = values.view(torch.int8)
    exps = torch.randint(-133, 121, (40, rf.scales_per_row(dim)), generator=g).double()
    scales = ((1 + torch.randint(0, 128, exps.shape, generator=g).double() / 128) * 2.0**exps).to(
        torch.bfloat16
    )
    rows = torch.randint(0, 40, (3, 17), generator=g)
    want = lookup.dequantize_gather(values, scales, rows, dtype, backend="torch")
    got = kernels.lookup.int_gather(values.to(DEVICE), scales.to(DEVICE), rows.to(DEVICE), dtype).cpu()
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(reference.int_gather(values, scales, rows, dtype)), bits(want))


@pytest.mark.parametrize("fmt", ["int8", "int8-row", "int4"])
def test_int_gather_table(kernels, fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    values, scales = quant.quantize(torch.randn(300, 96, generator=g) * 0.1, fmt)  # D = 96: a masked tile
    rows = torch.randint(0, 300, (7, 24), generator=g).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        want = lookup.dequantize_gather(values, scales, rows, dtype, backend="torch")
        got = kernels.lookup.int_gather(values.to(DEVICE), scales.to(DEVICE), rows.to(DEVICE), dtype)
        assert torch.equal(bits(got.cpu()), bits(want))
    assert kernels.lookup.int_gather(values, scales, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, 96)
    with pytest.raises(TypeError, match="int8 or uint8/bfloat16"):
        kernels.lookup.int_gather(values.float(), scales, rows)


# ------------------------------------------------------------------------------------------------ gate
def gate_inputs(b: int, t: int, hc: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, t, hc + 1, dim, generator=g)  # key and v are views of it, as in the module
    kv[0, 0, :hc] = torch.randn(dim, generator=g) * 0.01  # a tiny |z|: the clamp's branch
    h = torch.randn(b, t, hc, dim, generator=g)
    h[-1, -1] = kv[-1, -1, :hc] * 3  # aligned h and key: a large gate
    w = 1 + 0.1 * torch.randn(hc, dim, generator=g)
    dead = torch.rand(b, t, generator=g) < 0.25
    dead[0, 0] = dead[-1, -1] = False
    return {"h": h, "kv": kv, "w": w, "dead": dead}


def gate_probes(b: int, t: int, hc: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients run_gate's loss sends into out (B, T, hc, dim) and gates (B, T, hc), float32."""
    probe_out = torch.linspace(-1, 1, b * t * hc * dim, device=DEVICE).view(b, t, hc, dim)
    return probe_out, torch.linspace(2, -1, b * t * hc, device=DEVICE).view(b, t, hc)


def run_gate(fn, x: dict[str, torch.Tensor], with_dead: bool) -> tuple[torch.Tensor, ...]:
    h, kv, w = (x[k].to(DEVICE).requires_grad_() for k in ("h", "kv", "w"))
    hc = h.shape[2]
    out, gates = fn(
        h, kv[:, :, :hc], kv[:, :, hc], w, x["dead"].to(DEVICE) if with_dead else None, 1e-6, 1e-6
    )
    probe_out, probe_g = gate_probes(*h.shape)
    loss = (out * probe_out).sum() + (gates * probe_g).sum()
    grads = torch.autograd.grad(loss, (h, kv, w))
    return (out, gates, *grads)


@pytest.mark.parametrize("with_dead", [False, True])
@pytest.mark.parametrize(("b", "t", "hc", "dim"), [(2, 5, 4, 96), (1, 40, 1, 64), (3, 1, 3, 300)])
def test_gate_forward_backward(kernels, with_dead: bool, b: int, t: int, hc: int, dim: int) -> None:
    """float32: outputs and the grads of h, kv (through the key / v views) and w within 1e-5 relative
    to the largest value (different summation orders; the eager path rounds each product)."""
    x = gate_inputs(b, t, hc, dim, seed=2)
    got = run_gate(kernels.gate.fused_gate, x, with_dead)
    want = run_gate(reference.gate, x, with_dead)
    for name, a, e in zip(("out", "gates", "dh", "dkv", "dw"), got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        tol = 1e-5 * max(1.0, float(e.detach().abs().max()))
        assert float((a - e).detach().abs().max()) <= tol, name
    if with_dead:
        dead = x["dead"].to(DEVICE)
        assert bool((got[1][dead] == 0).all())  # a dead token's gates are 0 and its streams pass through
        assert torch.equal(got[0][dead], x["h"].to(DEVICE)[dead])


def test_gate_strided_inputs(kernels) -> None:
    """key and v whose (B, T) do not flatten to one token axis (time-major storage) and a
    non-contiguous h: read through copies, gradients still reach the originals."""
    g = torch.Generator().manual_seed(5)
    b, t, hc, dim = 3, 4, 2, 64
    kv_tm = torch.randn(t, b, hc + 1, dim, generator=g).to(DEVICE).requires_grad_()  # time-major
    h_tm = torch.randn(t, b, hc, dim, generator=g).to(DEVICE).requires_grad_()
    w = (1 + 0.1 * torch.randn(hc, dim, generator=g)).to(DEVICE).requires_grad_()
    results = []
    for fn in (kernels.gate.fused_gate, reference.gate):
        kv, h = kv_tm.transpose(0, 1), h_tm.transpose(0, 1)  # (B, T, ...) views
        out, gates = fn(h, kv[:, :, :hc], kv[:, :, hc], w, None, 1e-6, 1e-6)
        loss = (out * out).sum() + gates.sum()
        results.append((out, gates, *torch.autograd.grad(loss, (h_tm, kv_tm, w))))
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)  # (out * out) doubles the rounding


def gate_error_units(fn, x: dict[str, torch.Tensor]) -> dict[str, float]:
    """bench_gate.error_units of fn's outputs and gradients (run_gate, with dead tokens) against float64
    math on the same inputs, per output: units of rounding x the gate's conditioning."""
    got = run_gate(fn, x, True)
    x64 = {k: (v.double() if v.is_floating_point() else v).to(DEVICE) for k, v in x.items()}
    truth = run_gate(reference.gate, x64, True)
    hc, kv = x64["h"].shape[2], x64["kv"]
    scales = bench_gate.rounding_scales(
        x64["h"], kv[:, :, :hc], kv[:, :, hc], x64["w"], x64["dead"], *gate_probes(*x64["h"].shape)
    )
    return {
        name: bench_gate.error_units(a, t.detach(), s)
        for name, a, t, s in zip(bench_gate.OUTPUTS, got, truth, scales, strict=True)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "t", "hc", "dim"), [(2, 6, 4, 128), (1, 24, 3, 1000)])
def test_gate_against_float64(kernels, dtype: torch.dtype, b: int, t: int, hc: int, dim: int) -> None:
    """Fused and eager, forward and backward, within bench_gate.BOUND units of their dtype's rounding
    times the gate's conditioning of float64 math on the same (rounded) inputs."""
    x = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in gate_inputs(b, t, hc, dim, seed=3).items()
    }
    for name, fn in (("fused", kernels.gate.fused_gate), ("eager", reference.gate)):
        units = gate_error_units(fn, x)
        assert max(units.values()) <= bench_gate.BOUND, (name, units)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gate_against_float64_at_v41_width(kernels, dtype: str) -> None:
    """Compiled at V4.1's width (2048 tokens x hc 4 x dim 5120, bench_gate's inputs): fused and eager,
    forward and backward, within bench_gate.BOUND of float64 math. Gates of |z| near 0 make the
    float32 gradient ill-conditioned (eager fp32 was off by 2.3 in dh at 8192 tokens on a CPU), which
    the bound scales by; a TF32 dot or a lost term is far outside it."""
    x = bench_gate.make_inputs(2048, 4, 5120, bench_gate.DTYPES[dtype])
    for name, fn in (("fused", kernels.gate.fused_gate), ("eager", reference.gate)):
        units = bench_gate.float64_errors(x, bench_gate.step(fn, x, True))
        assert max(units) <= bench_gate.BOUND, (name, dict(zip(bench_gate.OUTPUTS, units, strict=True)))


def test_gate_matches_engram_module(kernels) -> None:
    """The module's own V4.1 forward equals the fused gate fed its wkv output."""
    from engram.model.module import Engram

    config = EngramConfig.preset("tiny")
    torch.manual_seed(4)
    layer = Engram(config, config.layer_ids[0], device=DEVICE)
    with torch.no_grad():
        layer.q_weight.normal_(1, 0.2)
    b, t = 2, 7
    h = torch.randn(b, t, config.hc_mult, config.hidden_size, device=DEVICE)
    rows = torch.randint(0, layer.table.num_rows, (b, t, config.rows_per_token), device=DEVICE)
    dead = torch.rand(b, t, device=DEVICE) < 0.3
    want, want_g = layer(h, rows, dead, return_gates=True)
    kv = layer.wkv(layer.lookup(rows, h.dtype)).view(b, t, config.hc_mult + 1, config.hidden_size)
    w = layer.q_weight * layer.k_weight
    got, got_g = kernels.gate.fused_gate(
        h, kv[:, :, : config.hc_mult], kv[:, :, config.hc_mult], w, dead, config.norm_eps, config.gate_clamp
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-6)


def test_gate_bad_shapes(kernels) -> None:
    h = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"v \(1, 2, 4\) \(expected \(1, 2, 8\)\)"):
        kernels.gate.fused_gate(h, h, torch.zeros(1, 2, 4), torch.ones(4, 8))
    with pytest.raises(ValueError, match="dead must be bool"):
        kernels.gate.fused_gate(h, h, torch.zeros(1, 2, 8), torch.ones(4, 8), torch.zeros(1, 2))


def test_dispatch_helpers() -> None:
    from engram import kernels as k

    assert isinstance(k.triton_available(), bool)
    assert not k.use_triton(torch.zeros(1))  # CPU tensors never take the kernels


def test_dispatch_gather_and_gate(kernels, monkeypatch):
    """Where `use_triton` says yes (CUDA; forced here), lookup and the module take the kernels and
    give what the eager paths give."""
    import engram.kernels as kmod
    from engram.model.module import Engram

    monkeypatch.setattr(kmod, "use_triton", lambda *tensors: True)
    gen = torch.Generator().manual_seed(5)
    values, scales = quant.quantize_rows(torch.randn(300, 64, generator=gen))
    values, scales = values.to(DEVICE), scales.to(DEVICE)
    rows = torch.randint(0, 300, (4, 7), generator=gen).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        got = lookup.dequantize_gather(values, scales, rows, dtype)
        want = lookup.dequantize_gather(values.cpu(), scales.cpu(), rows.cpu(), dtype, backend="torch")
        assert torch.equal(got.cpu(), want)
        assert torch.equal(lookup.dequantize_gather(values, scales, rows, dtype, dedup=True).cpu(), want)
    with pytest.raises(ValueError, match="row id 300"):
        lookup.dequantize_gather(values, scales, torch.full_like(rows, 300))
    for fmt in ("int8", "int4"):  # the integer formats take the Triton gather too
        v, s = quant.quantize(torch.randn(300, 64, generator=gen), fmt)
        got = lookup.dequantize_gather(v.to(DEVICE), s.to(DEVICE), rows, torch.bfloat16)
        want = lookup.dequantize_gather(v, s, rows.cpu(), torch.bfloat16, backend="torch")
        assert torch.equal(got.cpu(), want)

    config = EngramConfig.preset("tiny")
    m = Engram(config, 1).to(DEVICE)
    with torch.no_grad():
        m.q_weight.normal_(generator=None)
    h = torch.randn(2, 5, config.hc_mult, config.hidden_size, device=DEVICE, requires_grad=True)
    layer = m.table.num_rows
    r = torch.randint(0, layer, (2, 5, config.rows_per_token), device=DEVICE)
    fused, g_fused = m(h, r, return_gates=True)
    m.use_kernels = False
    eager, g_eager = m(h, r, return_gates=True)
    assert torch.allclose(fused, eager, atol=1e-5) and torch.allclose(g_fused, g_eager, atol=1e-6)


def test_hasher_triton_path(kernels, ds_compression):
    """`NgramHasher.hash` of CUDA tensors goes through `_hash_triton`; here it runs on CPU tensors."""
    hasher = NgramHasher(EngramConfig.preset("deepseek-v4.1"), ds_compression)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 129280, (3, 40), generator=gen).to(DEVICE)
    dead = (torch.rand(3, 40, generator=gen) < 0.1).to(DEVICE)
    want = hasher.hash(ids.cpu().numpy(), dead.cpu().numpy())
    got = hasher._hash_triton(ids, dead, np.dtype(np.int64))
    assert got.dtype == torch.int64 and np.array_equal(got.cpu().numpy(), want)
    got32 = hasher._hash_triton(ids[1], None, np.dtype(np.int32))
    assert got32.dtype == torch.int32 and np.array_equal(
        got32.cpu().numpy(), hasher.hash(ids[1].cpu().numpy())
    )
    with pytest.raises(ValueError, match=r"id 129280 at position \(0, 2\)"):
        hasher._hash_triton(torch.tensor([[1, 2, 129280]], device=DEVICE), None, np.dtype(np.int64))
    with pytest.raises(TypeError, match="integer token ids"):
        hasher._hash_triton(torch.zeros(3, device=DEVICE), None, np.dtype(np.int64))


def test_hasher_triton_path_restarts(kernels):
    """`NgramHasher.hash` of CUDA tensors with `starts` and `restart_after_id` (`_hash_triton`)."""
    config = EngramConfig.preset("qwen4-exp-tiny")
    hasher = NgramHasher(config)
    gen = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 8, (3, 40), generator=gen)  # id 1 (EOS, the restart id) often
    starts = torch.rand(3, 40, generator=gen) < 0.1
    want = hasher.hash(ids.numpy(), starts=starts.numpy())
    got = hasher._hash_triton(ids.to(DEVICE), None, np.dtype(np.int64), starts.to(DEVICE))
    assert np.array_equal(got.cpu().numpy(), want)
    assert np.array_equal(
        hasher._hash_triton(ids[0].to(DEVICE), None, np.dtype(np.int64)).cpu(), hasher.hash(ids[0])
    )
    with pytest.raises(TypeError, match="starts must be boolean"):
        hasher._hash_triton(ids.to(DEVICE), None, np.dtype(np.int64), starts.int().to(DEVICE))
