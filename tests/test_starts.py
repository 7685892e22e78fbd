"""Window restarts (`starts`, `restart_after_id`): the hasher's backends against a plain reference
written from the rule, and `HashStream` (chunks, steps, drafts, commits, rollbacks, resets) against
hashing the whole sequence at once. Tiny raw-id configs (identity compression), so it runs fast."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import EngramConfig, HashStream, NgramHasher

VOCAB = 12
PAD = 3
BASE = EngramConfig.preset("tiny").replace(
    vocab_size=VOCAB, compressed_vocab_size=VOCAB, pad_token_id=PAD, tokenizer=None, max_ngram_size=4
)
HASHERS = {
    (rid, backend): NgramHasher(BASE.replace(restart_after_id=rid), backend=backend)
    for rid in (None, 5)
    for backend in ("numba", "numpy")
}


def plain_rows(hasher: NgramHasher, ids, dead, starts) -> np.ndarray:
    """Rows (T, L, heads) of one sequence of raw ids, one position at a time, from the rule: look-back
    i of position t reads ids[t-i] if t-i >= 0, no position in t-i..t is dead, no start lies in
    t-i+1..t and no restart id in t-i..t-1; otherwise the pad id."""
    c = hasher.config
    n, rid = c.max_ngram_size, c.restart_after_id
    out = []
    for t in range(len(ids)):
        look = []
        for i in range(n):
            s = t - i
            ok = s >= 0 and not any(dead[s : t + 1]) and not any(starts[s + 1 : t + 1])
            ok = ok and (rid is None or rid not in ids[s:t])
            look.append(int(ids[s]) if ok else PAD)
        layers = []
        for li in range(c.n_layers):
            m = [int(x) for x in hasher.multipliers[li]]
            mix = (look[0] * m[0]) & (2**64 - 1)
            row = []
            for o in range(n - 1):
                mix ^= (look[o + 1] * m[o + 1]) & (2**64 - 1)
                signed = mix - 2**64 if mix >= 2**63 else mix
                for k in range(c.n_heads):
                    p, off = int(hasher.primes[li, o, k]), int(hasher.offsets[li, o, k])
                    row.append(signed % p + off)
            layers.append(row)
        out.append(layers)
    return np.array(out, dtype=np.int64)


ids_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(ids=ids_st, data=st.data(), rid=st.sampled_from([None, 5]))
def test_hash_matches_plain_rule(ids, data, rid) -> None:
    t = len(ids)
    dead = [False] * t
    if data.draw(st.booleans()):
        dead = data.draw(st.lists(st.sampled_from([False, False, False, True]), min_size=t, max_size=t))
    starts = data.draw(st.lists(st.sampled_from([False, False, True]), min_size=t, max_size=t))
    want = plain_rows(HASHERS[rid, "numpy"], ids, dead, starts)
    for backend in ("numba", "numpy"):
        h = HASHERS[rid, backend]
        got = h.hash(np.array(ids), np.array(dead), starts=np.array(starts))
        assert np.array_equal(got, want), backend
        # [B, T] with a second row: rows are independent
        got2 = h.hash(
            np.array([ids, ids[::-1]]), np.array([dead, dead[::-1]]), starts=np.array([starts, starts])
        )
        assert np.array_equal(got2[0], want)


def test_restart_after_id_is_derived_starts() -> None:
    ids = np.array([[1, 5, 7, 8, 9, 5, 5, 4, 2]])
    auto = HASHERS[5, "numba"].hash(ids)
    starts = np.zeros_like(ids, dtype=bool)
    starts[:, 1:] = ids[:, :-1] == 5
    assert np.array_equal(auto, HASHERS[None, "numba"].hash(ids, starts=starts))
    # the restart id itself still looks back into its own window
    assert not np.array_equal(auto[0, 1], HASHERS[None, "numba"].hash(np.array([5]))[0])
    assert np.array_equal(HASHERS[None, "numba"].hash(ids), HASHERS[None, "numpy"].hash(ids))


def test_starts_bad_input() -> None:
    h = HASHERS[None, "numpy"]
    with pytest.raises(ValueError, match="starts has shape"):
        h.hash(np.array([1, 2, 3]), starts=np.array([True, False]))
    with pytest.raises(TypeError, match="starts must be boolean"):
        h.hash(np.array([1, 2, 3]), starts=np.array([1, 0, 0]))
    with pytest.raises(ValueError, match="restart_after_id=12 is outside"):
        BASE.replace(restart_after_id=12)


# ------------------------------------------------------------------------------------------ streams
B = 2
op_st = st.one_of(
    st.tuples(st.just("feed"), st.integers(1, 5)),
    st.tuples(st.just("step"), st.just(1)),
    st.tuples(st.just("draft"), st.integers(1, 4)),
    st.tuples(st.just("reset"), st.integers(0, B - 1)),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=12), data=st.data(), rid=st.sampled_from([None, 5]))
def test_stream_equals_whole(ops, data, rid) -> None:
    """Random feeds, steps, drafts (then a partial commit or a rollback) and resets, with random
    starts and dead tokens: every row equals hashing each sequence's committed history whole."""
    tok = st.integers(0, VOCAB - 1)
    flag = st.sampled_from([False, False, False, True])
    for backend in ("numba", "numpy"):
        h = HASHERS[rid, backend]
        stream = HashStream(h, B)
        hist: list[list[tuple[int, bool, bool]]] = [[] for _ in range(B)]  # (id, dead, start)

        def whole(h: NgramHasher, past: list, new: list[tuple[int, bool, bool]]) -> np.ndarray:
            seq = past + new
            rows = h.hash(
                np.array([x[0] for x in seq]),
                np.array([x[1] for x in seq]),
                starts=np.array([x[2] for x in seq]),
            )
            return rows[len(past) :]

        for op, k in ops:
            if op == "reset":
                stream.reset(k)
                hist[k] = []
                continue
            new = [[(data.draw(tok), data.draw(flag), data.draw(flag)) for _ in range(k)] for _ in range(B)]
            ids = np.array([[x[0] for x in row] for row in new])
            dead = np.array([[x[1] for x in row] for row in new])
            starts = np.array([[x[2] for x in row] for row in new])
            if op == "step":
                got = stream.step(ids[:, 0], dead[:, 0], starts=starts[:, 0])[:, None]
            elif op == "feed":
                got = stream.feed(ids, dead, starts=starts)
            else:
                got = stream.draft(ids, dead, starts=starts)
            for b in range(B):
                assert np.array_equal(got[b], whole(h, hist[b], new[b])), (backend, op, b)
            if op == "draft":
                keep = [data.draw(st.integers(0, k)) for _ in range(B)]
                if data.draw(st.booleans()):
                    stream.rollback()
                    keep = [0] * B
                else:
                    stream.commit(keep)
                for b in range(B):
                    hist[b] += new[b][: keep[b]]
            else:
                for b in range(B):
                    hist[b] += new[b]
