"""Tests for engram.addressing.collisions.analyze_collisions against a brute-force count written here.

The brute force works on Python ints, one position at a time: it builds every n-gram with the pads
of SPEC §4 at the sequence start, XORs it into its 64-bit mix, puts every distinct mix into its row
of every head (mix mod prime), and counts pairs of distinct mixes per shared row. Primes and
multipliers come from `tests/reference.py`, not from the library.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference as ref
from engram import EngramConfig, NgramHasher, TokenizerCompression
from engram.addressing.collisions import HeadReport, OrderReport, analyze_collisions

INT64_MAX = 2**63 - 1
SYNTH_V, SYNTH_C = 1000, 700  # synthetic tokenizer: 1000 ids onto 700 compressed ids (ids c and c+700 merge)


# ---------------------------------------------------------------------------- brute force
def brute_force(
    config: EngramConfig,
    lookup: np.ndarray,
    token_ids,
    multipliers: dict[int, list[int]] | None = None,
) -> list[dict]:
    """The expected `OrderReport.to_dict()` of every (layer, order), counted the slow way."""
    primes = ref.primes(config.layer_ids, config.engram_vocab_size, config.n_heads)
    pad = int(lookup[config.pad_token_id])
    xc = [int(lookup[int(t)]) for t in token_ids]
    n_max = config.max_ngram_size
    out = []
    for lid in config.layer_ids:
        if multipliers is None:
            m = ref.multipliers(lid, n_max, config.compressed_vocab_size, config.seed)
        else:
            m = multipliers[lid]
        for n in config.orders:
            ngrams, mixes = set(), set()
            for t in range(len(xc)):
                look = [xc[t - i] if t - i >= 0 else pad for i in range(n)]  # x_t, x_{t-1}, ...
                ngrams.add(tuple(look))
                mix = 0
                for i in range(n):
                    mix ^= look[i] * m[i]
                assert 0 <= mix <= INT64_MAX
                mixes.add(mix)
            heads = []
            # (mix a, mix b) -> number of heads where the two share a row
            heads_shared: Counter[tuple[int, int]] = Counter()
            pairs_one = 0
            for p in primes[lid][n - 2]:
                rows: dict[int, list[int]] = defaultdict(list)
                for mix in sorted(mixes):
                    rows[mix % p].append(mix)
                shared = [members for members in rows.values() if len(members) > 1]
                heads.append(
                    {
                        "prime": p,
                        "rows_used": len(rows),
                        "rows_shared": len(shared),
                        "mixes_in_shared_rows": sum(len(members) for members in shared),
                    }
                )
                for members in shared:
                    for a, b in itertools.combinations(members, 2):
                        heads_shared[(a, b)] += 1
                        pairs_one += 1
            three_smallest = sorted(primes[lid][n - 2])[:3]
            max_shared = max(heads_shared.values(), default=0)
            out.append(
                {
                    "layer_id": lid,
                    "order": n,
                    "positions": len(xc),
                    "distinct_ngrams": len(ngrams),
                    "distinct_mixes": len(mixes),
                    "heads": heads,
                    "pairs_sharing_one_head": pairs_one,
                    "pairs_sharing_two_heads": sum(1 for v in heads_shared.values() if v == 2),
                    "max_heads_shared": max_shared,
                    "crt_guaranteed": len(three_smallest) == 3 and math.prod(three_smallest) > INT64_MAX,
                    "crt_ok": max_shared <= 2,
                    "ngrams_sharing_a_mix": len(ngrams) - len(mixes),
                }
            )
    return out


def check_against_brute_force(hasher: NgramHasher, token_ids, multipliers=None) -> list[OrderReport]:
    reports = analyze_collisions(hasher, token_ids)
    assert all(isinstance(r, OrderReport) for r in reports)
    assert all(isinstance(h, HeadReport) for r in reports for h in r.heads)
    got = [r.to_dict() for r in reports]
    expected = brute_force(hasher.config, hasher.compression.lookup, token_ids, multipliers)
    assert [(d["layer_id"], d["order"]) for d in got] == [(d["layer_id"], d["order"]) for d in expected]
    for g, e in zip(got, expected, strict=True):
        assert g == e, f"layer {e['layer_id']} order {e['order']}"
    json.dumps(got)  # plain Python types: what `engram collisions --json` prints
    return reports


def synthetic_hasher(**changes) -> NgramHasher:
    config = EngramConfig.preset("tiny").replace(vocab_size=SYNTH_V, compressed_vocab_size=SYNTH_C, **changes)
    comp = TokenizerCompression(lookup=np.arange(SYNTH_V) % SYNTH_C, fingerprint="test")
    return NgramHasher(config, comp)


def sample_ids(rng: np.random.Generator, n_tokens: int, subset: np.ndarray) -> np.ndarray:
    """Zipf-like draws from a small subset of ids, so short n-grams repeat and long ones mostly do not."""
    weights = 1.0 / np.arange(1, subset.size + 1)
    return rng.choice(subset, size=n_tokens, p=weights / weights.sum())


@pytest.fixture(scope="module")
def synth_ids() -> np.ndarray:
    rng = np.random.default_rng(1234)
    # 60 ids, among them the pad id 2 and pairs that merge under compression (5/705, 40/740)
    subset = np.unique(np.concatenate([[2, 5, 705, 40, 740], rng.choice(SYNTH_V, size=55, replace=False)]))
    rng.shuffle(subset)
    return sample_ids(rng, 4000, subset)


# ---------------------------------------------------------------------------- tiny preset
def test_tiny_synthetic_map_matches_brute_force(synth_ids):
    hasher = synthetic_hasher()
    assert hasher.primes.tolist() == [list(map(list, ref.primes((1,), (4096, 4096), 4)[1]))]
    reports = check_against_brute_force(hasher, synth_ids)
    two, three = reports
    assert (two.order, three.order) == (2, 3)
    # the data exercises what is counted: repeated n-grams, shared rows, pairs in two heads
    assert two.distinct_ngrams < 60 * 60 < two.positions
    assert two.distinct_ngrams < three.distinct_ngrams < three.positions
    assert all(h.rows_shared > 0 for r in reports for h in r.heads)
    assert three.pairs_sharing_one_head > 1000
    assert three.pairs_sharing_two_heads > 0
    assert not two.crt_guaranteed and not three.crt_guaranteed


def test_tiny_counts_compressed_ngrams():
    # ids 5 and 705 compress to the same id: (5, 6) and (705, 6) are one 2-gram, one mix
    hasher = synthetic_hasher()
    reports = check_against_brute_force(hasher, [5, 6, 705, 6, 5, 6])
    two = reports[0]
    # 2-grams (x_t, x_{t-1}): (5,P) (6,5) (5,6) (6,5) (5,6) (6,5) -> 3 distinct
    assert two.distinct_ngrams == 3
    assert two.distinct_mixes == 3
    assert two.positions == 6


def test_tiny_real_map_matches_brute_force(ds_compression, vectors):
    hasher = NgramHasher(EngramConfig.preset("tiny"), ds_compression)
    rng = np.random.default_rng(7)
    common = np.unique(np.concatenate([c["token_ids"] for c in vectors["cases"]]))
    ids = np.concatenate(
        [
            sample_ids(rng, 2500, common),
            vectors["cases"][0]["token_ids"] * 3,  # the same sentence three times
            rng.integers(0, 129280, size=500),  # rare ids from the whole vocabulary
        ]
    )
    reports = check_against_brute_force(hasher, ids)
    assert reports[0].distinct_ngrams < reports[0].positions
    assert sum(h.rows_shared for r in reports for h in r.heads) > 0


def test_mixes_shared_by_different_ngrams_are_counted_once():
    # With multipliers all 1 the mix is x_t ^ x_{t-1} (^ x_{t-2}): (a, b) and (b, a) share a mix.
    hasher = synthetic_hasher()
    hasher.multipliers = np.ones_like(hasher.multipliers)
    ids = np.random.default_rng(3).integers(0, 64, size=1500)
    reports = check_against_brute_force(hasher, ids, multipliers={1: [1, 1, 1]})
    for r in reports:
        assert r.distinct_mixes < r.distinct_ngrams
        assert r.ngrams_sharing_a_mix == r.distinct_ngrams - r.distinct_mixes > 0
        assert r.to_dict()["ngrams_sharing_a_mix"] == r.ngrams_sharing_a_mix
        # mixes are < 64, primes ~4100: every mix gets its own row in every head
        assert all(h.rows_used == r.distinct_mixes and h.rows_shared == 0 for h in r.heads)
        assert (r.pairs_sharing_one_head, r.max_heads_shared) == (0, 0)


# ---------------------------------------------------------------------------- CRT violations
def test_small_primes_share_three_and_more_heads():
    # bases 11: primes 11, 13, 17, 19 (2-grams) and 23, 29, 31, 37 (3-grams); CRT cannot hold
    hasher = synthetic_hasher(engram_vocab_size=(11, 11))
    assert hasher.primes[0].tolist() == [[11, 13, 17, 19], [23, 29, 31, 37]]
    ids = np.random.default_rng(11).integers(0, SYNTH_V, size=400)
    reports = check_against_brute_force(hasher, ids)
    for r in reports:
        assert r.max_heads_shared >= 3
        assert r.crt_ok is False
        assert r.crt_guaranteed is False
        assert r.pairs_sharing_two_heads > 0
        assert all(h.rows_used == h.prime for h in r.heads)  # a few hundred mixes fill every row


def _three_head_pair(mult: list[int], primes: list[int], n_ids: int = 1000) -> tuple[tuple[int, int], ...]:
    """Two 2-grams (x_{t-1}, x_t) over compressed ids < n_ids whose different mixes agree modulo the
    product of three of the primes (so they share a row in 3+ heads): a birthday search."""
    x = np.arange(n_ids, dtype=np.int64)
    mix = ((x[:, None] * mult[0]) ^ (x[None, :] * mult[1])).ravel()  # index x_t * n_ids + x_{t-1}
    for trio in itertools.combinations(primes, 3):
        key = mix % math.prod(trio)
        order = np.argsort(key, kind="stable")
        for k in np.flatnonzero(key[order][1:] == key[order][:-1]).tolist():
            i, j = int(order[k]), int(order[k + 1])
            if mix[i] != mix[j]:
                (ti, pi), (tj, pj) = divmod(i, n_ids), divmod(j, n_ids)
                return (pi, ti), (pj, tj)
    raise AssertionError("no 2-gram pair shares three heads")  # pragma: no cover


def test_tiny_preset_pair_sharing_three_heads_breaks_crt(ds_compression):
    config = EngramConfig.preset("tiny")
    hasher = NgramHasher(config, ds_compression)
    primes = ref.primes(config.layer_ids, config.engram_vocab_size, config.n_heads)[1]
    mult = ref.multipliers(1, 3, config.compressed_vocab_size)
    # 4099 * 4111 * 4127 < 2**63: two different mixes can agree modulo three primes
    assert math.prod(sorted(primes[0])[:3]) < INT64_MAX
    (a0, a1), (b0, b1) = _three_head_pair(mult, primes[0])
    mix_a, mix_b = (a1 * mult[0]) ^ (a0 * mult[1]), (b1 * mult[0]) ^ (b0 * mult[1])
    assert mix_a != mix_b
    assert sum(mix_a % p == mix_b % p for p in primes[0]) >= 3
    # a tokenizer id for each compressed id: its first member
    _, first = np.unique(ds_compression.lookup, return_index=True)
    ids = first[[a0, a1, b0, b1]]
    reports = check_against_brute_force(hasher, ids)
    two = reports[0]
    assert two.max_heads_shared >= 3
    assert two.crt_ok is False
    assert two.crt_guaranteed is False
    assert two.pairs_sharing_one_head >= 3


# ---------------------------------------------------------------------------- DeepSeek-V4.1
@pytest.fixture(scope="module")
def kjv_ids(ds_tokenizer) -> np.ndarray:
    from engram.apps.lm.corpus import kjv_text

    return np.array(ds_tokenizer.encode(kjv_text(max_chars=60_000), add_special_tokens=False).ids)


def test_v41_real_text_crt_holds(v41_hasher, kjv_ids):
    assert kjv_ids.size > 10_000
    reports = analyze_collisions(v41_hasher, kjv_ids)
    assert [(r.layer_id, r.order) for r in reports] == [(lid, n) for lid in (1, 14) for n in (2, 3, 4)]
    for r in reports:
        assert r.crt_guaranteed is True
        assert r.crt_ok is True
        assert r.max_heads_shared <= 2
        assert r.positions == kjv_ids.size
        assert r.distinct_mixes == r.distinct_ngrams  # no 64-bit mix collision in a few thousand n-grams
        layer_index = (1, 14).index(r.layer_id)
        assert [h.prime for h in r.heads] == v41_hasher.primes[layer_index, r.order - 2].tolist()
    # the Bible repeats itself: far fewer distinct 2-grams than positions
    assert reports[0].distinct_ngrams < 0.6 * kjv_ids.size


def test_v41_matches_brute_force(v41_hasher, kjv_ids):
    rng = np.random.default_rng(5)
    ids = np.concatenate([kjv_ids[:2000], rng.integers(0, 129280, size=2000)])
    reports = check_against_brute_force(v41_hasher, ids)
    assert all(r.crt_guaranteed and r.crt_ok for r in reports)


# ---------------------------------------------------------------------------- small and odd inputs
def test_single_token():
    reports = check_against_brute_force(synthetic_hasher(), [17])
    for r in reports:
        assert (r.positions, r.distinct_ngrams, r.distinct_mixes) == (1, 1, 1)
        assert all((h.rows_used, h.rows_shared, h.mixes_in_shared_rows) == (1, 0, 0) for h in r.heads)
        assert (r.pairs_sharing_one_head, r.pairs_sharing_two_heads, r.max_heads_shared) == (0, 0, 0)
        assert r.crt_ok is True


def test_repeated_token_and_pad_token():
    hasher = synthetic_hasher()
    # a run of one token: (x, P), (x, x) -> 2 distinct 2-grams; (x,P,P), (x,x,P), (x,x,x) -> 3 3-grams
    two, three = check_against_brute_force(hasher, [9] * 12)
    assert (two.distinct_ngrams, three.distinct_ngrams) == (2, 3)
    # the pad id itself as a token: (P, P) at t = 0 equals the start padding
    two, three = check_against_brute_force(hasher, [2, 2, 2])
    assert (two.distinct_ngrams, three.distinct_ngrams) == (1, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(0, SYNTH_V - 1), min_size=1, max_size=80),
    base=st.sampled_from([5, 11, 60, 4096]),
)
def test_random_sequences_match_brute_force(ids, base):
    check_against_brute_force(_hasher_with_base(base), ids)


_HASHERS: dict[int, NgramHasher] = {}


def _hasher_with_base(base: int) -> NgramHasher:
    if base not in _HASHERS:
        _HASHERS[base] = synthetic_hasher(engram_vocab_size=(base, base))
    return _HASHERS[base]


def test_input_errors():
    hasher = synthetic_hasher()
    with pytest.raises(ValueError, match=str(SYNTH_V)):
        analyze_collisions(hasher, [1, 2, SYNTH_V])
    with pytest.raises(ValueError, match="-1"):
        analyze_collisions(hasher, [1, -1])
    with pytest.raises(ValueError, match="empty"):
        analyze_collisions(hasher, np.array([], dtype=np.int64))
    with pytest.raises(TypeError):
        analyze_collisions(hasher, np.array([1.0, 2.0]))
