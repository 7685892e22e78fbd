"""The numba fast path (engram.kernels.cpu_hash) against its numpy twin and the plain reference.

Every comparison is exact: the kernels must give the same int64 rows as `hash_compressed_numpy`
and `tests/reference.py` for every input, the division-free reduction must equal `%`, and the
decode step must equal hashing the whole sequence at once.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from engram import EngramConfig, HashStream, NgramHasher

numba = pytest.importorskip("numba")
kernels = pytest.importorskip("engram.kernels.cpu_hash")

INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------- fixtures, helpers
@pytest.fixture(scope="module")
def tiny(ds_compression) -> NgramHasher:
    return NgramHasher(EngramConfig.preset("tiny"), ds_compression)


@pytest.fixture(scope="module")
def small_primes(ds_compression) -> NgramHasher:
    """Primes below FASTMOD_MIN_PRIME: the kernels take the hardware-% branch."""
    config = EngramConfig.preset("tiny").replace(engram_vocab_size=(50, 50), layer_ids=(1, 3))
    return NgramHasher(config, ds_compression)


def reference_rows(hasher: NgramHasher, xc: np.ndarray, dead: np.ndarray | None) -> np.ndarray:
    """(B, T, layers, heads) from the plain implementation, for compressed ids xc (B, T)."""
    c = hasher.config
    primes = ref.primes(c.layer_ids, c.engram_vocab_size, c.n_heads)
    mults = {
        lid: ref.multipliers(lid, c.max_ngram_size, c.compressed_vocab_size, c.seed) for lid in c.layer_ids
    }
    out = []
    for b in range(xc.shape[0]):
        d = None if dead is None else [bool(v) for v in dead[b]]
        seq = [int(v) for v in xc[b]]
        layers = [
            ref.hash_sequence(seq, d, hasher.pad, primes[lid], mults[lid], c.max_ngram_size)
            for lid in c.layer_ids
        ]
        out.append(np.stack([np.array(rows) for rows in layers], axis=1))
    return np.stack(out)


def both(hasher: NgramHasher, xc, dead=None, window=None, **kw) -> tuple[np.ndarray, np.ndarray]:
    fast = hasher.hash_compressed(xc, dead, window, backend="numba", **kw)
    slow = hasher.hash_compressed_numpy(xc, dead, window)
    return fast, slow


@st.composite
def batches(draw, vocab: int = 99092, max_b: int = 4, max_t: int = 24, any_int64: bool = False):
    """(xc (B, T), dead (B, T) or None, window (B, n-1) or None) for a 4-gram hasher."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    ids = st.integers(-(2**63), INT64_MAX) if any_int64 else st.integers(0, vocab - 1)
    xc = np.array(draw(st.lists(ids, min_size=b * t, max_size=b * t)), dtype=np.int64).reshape(b, t)
    dead = None
    if draw(st.booleans()):
        p = draw(st.sampled_from([0.05, 0.3, 0.9]))
        dead = np.array(draw(st.lists(st.floats(0, 1), min_size=b * t, max_size=b * t))).reshape(b, t) < p
    window = None
    if draw(st.booleans()):
        window = np.array(draw(st.lists(ids, min_size=b * 3, max_size=b * 3)), dtype=np.int64).reshape(b, 3)
    return xc, dead, window


# ---------------------------------------------------------------------------- whole sequences
@settings(max_examples=80, deadline=None)
@given(case=batches())
def test_numba_equals_numpy_with_windows(v41_hasher, case):
    xc, dead, window = case
    fast, slow = both(v41_hasher, xc, dead, window)
    assert fast.dtype == np.int64 and np.array_equal(fast, slow)


@settings(max_examples=40, deadline=None)
@given(case=batches(any_int64=True))
def test_numba_equals_numpy_for_any_int64(v41_hasher, case):
    """Bit-identical even off the spec's domain (wrapping products, negative mixes: floor mod)."""
    xc, dead, window = case
    fast, slow = both(v41_hasher, xc, dead, window)
    assert np.array_equal(fast, slow)


@settings(max_examples=30, deadline=None)
@given(case=batches(max_b=3, max_t=16))
def test_numba_equals_reference(v41_hasher, case):
    xc, dead, _ = case
    assert np.array_equal(
        v41_hasher.hash_compressed(xc, dead, backend="numba"), reference_rows(v41_hasher, xc, dead)
    )


@pytest.mark.parametrize("preset", ["tiny", "demo-v1", "small_primes"])
def test_other_layouts(preset, ds_compression, small_primes):
    hasher = (
        small_primes if preset == "small_primes" else NgramHasher(EngramConfig.preset(preset), ds_compression)
    )
    assert hasher.kernel_tables("numba").fast == (preset != "small_primes")
    rng = np.random.default_rng(7)
    xc = rng.integers(0, 99092, size=(3, 40))
    dead = rng.random((3, 40)) < 0.2
    window = rng.integers(0, 99092, size=(3, hasher.window_size))
    fast, slow = both(hasher, xc, dead, window)
    assert np.array_equal(fast, slow)
    assert np.array_equal(hasher.hash_compressed(xc, dead, backend="numba"), reference_rows(hasher, xc, dead))


def test_extremes(v41_hasher, ds_compression):
    top = int(np.argmax(ds_compression.lookup))  # tokenizer id of the largest compressed id
    assert ds_compression.lookup[top] == 99091
    cases = [
        (np.full((2, 9), top), None),
        (np.full((2, 9), top), np.ones((2, 9), dtype=bool)),  # all dead
        (np.array([[top]]), None),  # T = 1
        (np.array([[top]]), np.array([[True]])),
        (np.array([[5], [top], [2]]), np.array([[False], [True], [False]])),
        (np.array([[top, 0, top, 0, top]]), np.array([[False, True, False, False, True]])),
    ]
    for ids, dead in cases:
        xc = ds_compression.lookup[ids]
        fast = v41_hasher.hash(ids, dead, backend="numba")
        assert np.array_equal(fast, v41_hasher.hash(ids, dead, backend="numpy"))
        assert np.array_equal(fast, reference_rows(v41_hasher, xc, dead))
        window = np.full((ids.shape[0], 3), 99091)
        assert np.array_equal(*both(v41_hasher, xc, dead, window))
    all_dead = v41_hasher.hash(np.full(6, top), np.ones(6, dtype=bool), backend="numba")
    assert (all_dead == all_dead[0]).all()  # every dead position sees only pads
    assert np.array_equal(all_dead[0], v41_hasher.hash(np.array([2]))[0])


def test_int32_output_equals_int64(v41_hasher):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 129280, size=(5, 300))
    dead = rng.random(ids.shape) < 0.1
    rows64 = v41_hasher.hash(ids, dead)
    for backend in ("numba", "numpy"):
        rows32 = v41_hasher.hash(ids, dead, out_dtype=np.int32, backend=backend)
        assert rows32.dtype == np.int32 and np.array_equal(rows32, rows64)
    t = v41_hasher.hash(torch.from_numpy(ids), torch.from_numpy(dead), out_dtype=torch.int32)
    assert t.dtype == torch.int32 and np.array_equal(t.numpy(), rows64)
    out = np.empty((5, 300, 2, 24), dtype=np.int32)
    xc = v41_hasher.compression.lookup[ids]
    assert v41_hasher.hash_compressed(xc, dead, out=out) is out and np.array_equal(out, rows64)


def test_threads_equal_single_thread(v41_hasher):
    rng = np.random.default_rng(4)
    xc = rng.integers(0, 99092, size=(7, 1001))  # ranges split mid-row
    dead = rng.random(xc.shape) < 0.05
    window = rng.integers(0, 99092, size=(7, 3))
    one = v41_hasher.hash_compressed(xc, dead, window, threads=1)
    assert np.array_equal(one, v41_hasher.hash_compressed_numpy(xc, dead, window))
    for threads in (2, 3, 8, 7007, 10_000):
        assert np.array_equal(v41_hasher.hash_compressed(xc, dead, window, threads=threads), one)
    many = rng.integers(0, 99092, size=(4, 8192))  # above the auto threshold: threads=None splits
    assert np.array_equal(v41_hasher.hash_compressed(many), v41_hasher.hash_compressed(many, threads=1))


def test_bad_options(v41_hasher):
    ids = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="backend='cuda'"):
        v41_hasher.hash(ids, backend="cuda")
    with pytest.raises(ValueError, match="threads=0"):
        v41_hasher.hash(ids, threads=0)
    with pytest.raises(TypeError, match="threads"):
        v41_hasher.hash(ids, threads=1.5)
    with pytest.raises(TypeError, match="int64 or int32"):
        v41_hasher.hash(ids, out_dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        v41_hasher.hash_compressed(
            np.zeros((2, 3), dtype=np.int64), out=np.empty((2, 3, 2, 23), dtype=np.int64)
        )
    with pytest.raises(ValueError, match="window has shape"):
        v41_hasher.hash_compressed(np.zeros((2, 3), dtype=np.int64), window=np.zeros((2, 2), dtype=np.int64))
    huge = NgramHasher(v41_hasher.config.replace(engram_vocab_size=300_000_000), v41_hasher.compression)
    assert not huge.int32_ok  # 24 primes of 3e8 per layer: > 2^31 rows
    with pytest.raises(ValueError, match="int32 cannot hold"):
        huge.hash(ids, out_dtype=np.int32)
    assert np.array_equal(huge.hash(ids), huge.hash(ids, backend="numpy"))


def test_numpy_backend_stream_equals_numba(v41_hasher):
    h = NgramHasher(v41_hasher.config, v41_hasher.compression, backend="numpy")
    ids = np.random.default_rng(5).integers(0, 129280, size=(2, 20))
    assert h.kernel_tables() is None
    assert np.array_equal(h.hash(ids, out_dtype=np.int32), v41_hasher.hash(ids))
    s, fast = HashStream(h, 2), HashStream(v41_hasher, 2)
    out = np.empty((2, 2, 24), dtype=np.int32)
    for t in range(20):
        if t == 7:  # a bad out raises before anything is committed (the numpy path goes through feed)
            with pytest.raises(ValueError, match="out must be"):
                s.step(ids[:, t], out=np.empty((2, 2, 23), dtype=np.int32))
        assert np.array_equal(s.step(ids[:, t], out=out), fast.step(ids[:, t]))


def test_import_compiles_nothing():
    code = "import sys, engram; engram.NgramHasher; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- the reduction
@numba.njit
def _fastmod_many(xs, p, inv, out):
    for i in range(xs.shape[0]):
        out[i] = kernels.fastmod(xs[i], p, inv)


def _check_fastmod(xs: np.ndarray, p: int) -> None:
    got = np.empty_like(xs)
    _fastmod_many(xs, p, 1.0 / p, got)
    want = xs % p  # hardware division
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"fastmod({int(xs[bad[0]])}, {p}) = {int(got[bad[0]])}, want {int(want[bad[0]])}"


def _adversarial(p: int) -> np.ndarray:
    """x near 2^63 (where doubles are 1024 apart), at multiples of p and double rounding ties."""
    top = INT64_MAX // p
    near_mult = [(k * p + d) for k in range(max(top - 40, 0), top + 1) for d in (-1, 0, 1, p // 2, p - 1)]
    near_top = [INT64_MAX - j for j in range(2048)]
    ties = [(m << 10) + d for m in range((1 << 53) - 64, 1 << 53) for d in (-1, 0, 1, 511, 512, 513)]
    ties += [
        (m << s) + (1 << (s - 1)) + d
        for s in range(1, 11)
        for m in (1 << 52, (1 << 53) - 1)
        for d in (-1, 0, 1)
    ]
    small = [0, 1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2**31, 2**32 + 1, 2**53 + 1]
    xs = [x for x in near_mult + near_top + ties + small if 0 <= x <= INT64_MAX]
    return np.array(xs, dtype=np.int64)


def _v41_primes(v41_hasher) -> list[int]:
    return sorted({int(p) for p in v41_hasher.primes.reshape(-1)})


def test_fastmod_every_v41_prime(v41_hasher):
    rng = np.random.default_rng(6)
    random_x = np.concatenate(
        [
            rng.integers(0, INT64_MAX, size=20_000, dtype=np.int64, endpoint=True),
            rng.integers(2**62, INT64_MAX, size=20_000),
        ]
    )
    primes = _v41_primes(v41_hasher)
    assert len(primes) == 48
    for p in primes:
        _check_fastmod(_adversarial(p), p)
        _check_fastmod(random_x, p)


@pytest.mark.parametrize("p", [4099, 4111, 646_403, 2_147_483_647, 2**61 - 1, 9_223_372_036_854_775_783])
def test_fastmod_other_primes(p):
    """Down to the smallest prime the kernels take it for, up to the largest int64 prime."""
    assert p >= kernels.FASTMOD_MIN_PRIME
    _check_fastmod(_adversarial(p), p)
    _check_fastmod(np.random.default_rng(p % 1000).integers(0, INT64_MAX, size=20_000, dtype=np.int64), p)


@settings(max_examples=300, deadline=None)
@given(x=st.integers(0, INT64_MAX), p=st.integers(kernels.FASTMOD_MIN_PRIME, 2**31 - 1))
def test_fastmod_property(x, p):
    """Any modulus >= FASTMOD_MIN_PRIME (the proof needs no primality) and any x < 2^63."""
    assert kernels.fastmod(x, p, 1.0 / p) == x % p


def test_fastmod_error_bound():
    """The module doc's bound: x - trunc(fl(fl(x) * fl(1/p))) * p lies in (-3073, p + 3073)."""
    worst = 0
    rng = np.random.default_rng(8)
    for p in [4099, 65_537, 16_000_057, 2_147_483_647]:
        xs = np.concatenate([_adversarial(p), rng.integers(2**62, INT64_MAX, size=10_000)])
        q = (xs.astype(np.float64) * (1.0 / p)).astype(np.int64)
        r = [int(x) - int(qq) * p for x, qq in zip(xs.tolist(), q.tolist(), strict=True)]
        worst = max(worst, max(-min(r), max(v - p + 1 for v in r)))
        assert all(-3073 < v < p + 3073 for v in r)
    assert worst < kernels.FASTMOD_MIN_PRIME


# ---------------------------------------------------------------------------- hash_range's reductions
@numba.njit
def _splitmod_many(xs, wrap, inv_hi, pf, out):
    low = np.uint64((1 << kernels.SPLIT_SHIFT) - 1)
    for i in range(xs.shape[0]):
        x = np.uint64(xs[i])
        hi = np.float64(np.int64(x >> np.uint64(kernels.SPLIT_SHIFT)))
        lo = np.float64(np.int64(x & low))
        out[i] = kernels.splitmod(hi, lo, wrap, inv_hi, pf)


def _check_splitmod(xs: np.ndarray, p: int) -> None:
    wrap, inv_hi, pf = kernels.split_tables(np.array([p]))
    got = np.empty_like(xs)
    _splitmod_many(xs, wrap[0], inv_hi[0], pf[0], got)
    want = xs % p
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"splitmod({int(xs[bad[0]])}, {p}) = {int(got[bad[0]])}, want {int(want[bad[0]])}"


def test_splitmod_every_v41_prime(v41_hasher):
    rng = np.random.default_rng(11)
    random_x = np.concatenate(
        [
            rng.integers(0, INT64_MAX, size=20_000, dtype=np.int64, endpoint=True),
            rng.integers(2**62, INT64_MAX, size=20_000),
        ]
    )
    for p in _v41_primes(v41_hasher):
        _check_splitmod(_adversarial(p), p)
        _check_splitmod(random_x, p)


@pytest.mark.parametrize("p", [1, 2, 3, 47, 4099, 12_289, 646_403, 16_777_259, 2**31 - 1])
def test_splitmod_other_primes(p):
    """From p = 1 to the largest int32 prime (splitmod's whole range), x near 2^63 and at multiples of p."""
    assert p < kernels.SPLIT_MAX_PRIME
    _check_splitmod(_adversarial(p), p)
    _check_splitmod(np.random.default_rng(p % 1000).integers(0, INT64_MAX, size=20_000, dtype=np.int64), p)


@settings(max_examples=300, deadline=None)
@given(x=st.integers(0, INT64_MAX), p=st.integers(1, kernels.SPLIT_MAX_PRIME - 1))
def test_splitmod_property(x, p):
    _check_splitmod(np.array([x], dtype=np.int64), p)


def test_reduction_for(tiny):
    assert kernels.reduction_for(np.array([16_000_057, 16_000_463])) == kernels.REDUCE_SPLIT
    assert kernels.reduction_for(np.array([2, 53])) == kernels.REDUCE_SPLIT
    assert kernels.reduction_for(np.array([53, 2**31 + 11])) == kernels.REDUCE_FLOOR  # beyond splitmod
    assert tiny.kernel_tables("numba").reduce == kernels.REDUCE_SPLIT


@pytest.mark.parametrize("preset", ["deepseek-v4.1", "demo-v1", "tiny", "small_primes"])
def test_every_reduction_equals_numpy(preset, ds_compression, small_primes):
    """hash_range with each reduction: the same rows as the numpy twin, across chunk boundaries
    (T > CHUNK, odd chunk ends), with dead tokens, window restarts, a carried window, ranges split
    mid-row by threads, and int32 rows."""
    hasher = (
        small_primes if preset == "small_primes" else NgramHasher(EngramConfig.preset(preset), ds_compression)
    )
    tables = hasher.kernel_tables("numba")
    rng = np.random.default_rng(12)
    b, t = 3, kernels.CHUNK * 2 + 37
    xc = rng.integers(0, 99092, size=(b, t))
    dead = rng.random((b, t)) < 0.05
    starts = rng.random((b, t)) < 0.02
    window = rng.integers(0, 99092, size=(b, hasher.window_size))
    pad, mult, primes, offsets, n_heads, _, split = tables.range_args
    for d, s, w in [(None, None, None), (dead, None, window), (dead, starts, window), (None, starts, None)]:
        want = hasher.hash_compressed_numpy(xc, d, w, s)
        for mode in (kernels.REDUCE_SPLIT, kernels.REDUCE_FLOOR):
            for threads in (1, 2, 5):
                out = np.empty_like(want)
                kernels.hash_rows(xc, d, w, pad, mult, primes, offsets, n_heads, mode, split, out, threads, s)
                assert np.array_equal(out, want), (mode, threads)
            out32 = np.empty(want.shape, dtype=np.int32)
            kernels.hash_rows(xc, d, w, pad, mult, primes, offsets, n_heads, mode, split, out32, 1, s)
            assert np.array_equal(out32, want), mode


def test_negative_mixes_take_the_floor_path(v41_hasher):
    """Ids off the spec's domain make negative mixes: their chunk is reduced with floor mod, the rest
    with splitmod, and every row equals numpy's."""
    rng = np.random.default_rng(13)
    xc = rng.integers(0, 99092, size=(2, kernels.CHUNK * 3))
    xc[1, kernels.CHUNK + 5] = -1  # (-1 * m_0) ^ (x * m_1) < 0: that token's mixes are negative
    want = v41_hasher.hash_compressed_numpy(xc)
    out = np.empty_like(want)
    kernels.hash_rows(xc, None, None, *v41_hasher.kernel_tables("numba").range_args, out)
    assert np.array_equal(out, want)


# ---------------------------------------------------------------------------- decode steps
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_steps_equal_whole_sequence(v41_hasher, data):
    b = data.draw(st.integers(1, 6))
    t = data.draw(st.integers(1, 20))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 129280, size=(b, t))
    ids[rng.random((b, t)) < 0.2] = int(np.argmax(v41_hasher.compression.lookup))
    dead = rng.random((b, t)) < data.draw(st.sampled_from([0.0, 0.2, 0.7]))
    whole = v41_hasher.hash(ids, dead, backend="numpy")
    prefill = data.draw(st.integers(0, t - 1))
    s = HashStream(v41_hasher, batch_size=b)
    if prefill:
        assert np.array_equal(s.feed(ids[:, :prefill], dead[:, :prefill]), whole[:, :prefill])
    out32 = np.empty((b, 2, 24), dtype=np.int32)
    for pos in range(prefill, t):
        if data.draw(st.booleans()):
            rows = s.step(ids[:, pos], dead[:, pos])
        else:
            rows = s.step(ids[:, pos], dead[:, pos], out=out32)
            assert rows is out32
        assert np.array_equal(rows, whole[:, pos])
    assert (s.position == t).all()
    later = HashStream(v41_hasher, batch_size=b)  # the window the kernel leaves equals feed()'s
    later.feed(ids, dead)
    assert np.array_equal(s.window, later.window)


def test_step_tiny_and_torch(tiny):
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 129280, size=(3, 15))
    dead = rng.random(ids.shape) < 0.3
    whole = tiny.hash(ids, dead)
    s = HashStream(tiny, batch_size=3)
    out = torch.empty(3, 1, 8, dtype=torch.int64)
    for pos in range(15):
        rows = s.step(torch.from_numpy(ids[:, pos]).int(), torch.from_numpy(dead[:, pos]), out=out)
        assert rows is out and np.array_equal(rows.numpy(), whole[:, pos])
    assert np.array_equal(
        s.step(ids[:, 0].tolist()),
        tiny.hash(np.concatenate([ids, ids[:, :1]], 1), np.concatenate([dead, [[False]] * 3], 1))[:, 15],
    )


def test_step_drafts_and_errors_leave_state_alone(v41_hasher):
    rng = np.random.default_rng(10)
    ids = rng.integers(0, 129280, size=(2, 12))
    whole = v41_hasher.hash(ids)
    s = HashStream(v41_hasher, batch_size=2)
    s.feed(ids[:, :4])
    state = (s.window.copy(), s.position.copy())
    with pytest.raises(ValueError, match=r"id 129280 at position \(1,\)"):
        s.step(np.array([5, 129280]))
    with pytest.raises(ValueError, match=r"id -1 at position \(0,\)"):
        s.step(np.array([-1, 5]))
    with pytest.raises(TypeError, match="float64"):
        s.step(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="boolean"):
        s.step(np.array([1, 2]), np.array([0, 1]))
    with pytest.raises(TypeError, match="int64 or int32"):
        s.step(np.array([1, 2]), out=np.empty((2, 2, 24), dtype=np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        s.step(np.array([1, 2]), out=np.empty((2, 2, 48), dtype=np.int64)[:, :, ::2])
    assert np.array_equal(s.window, state[0]) and np.array_equal(s.position, state[1])
    assert np.array_equal(s.draft(ids[:, 4:7]), whole[:, 4:7])
    with pytest.raises(RuntimeError, match="commit"):
        s.step(ids[:, 4])
    assert np.array_equal(s.window, state[0]) and np.array_equal(s.position, state[1])
    s.commit(np.array([3, 1]), seqs=[0, 1])
    s.rollback()
    s.feed(ids[1, 5:7], seqs=1)
    for pos in range(7, 12):
        assert np.array_equal(s.step(ids[:, pos]), whole[:, pos])
