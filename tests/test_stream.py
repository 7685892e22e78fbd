from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import EngramConfig, HashStream, NgramHasher


@pytest.fixture(scope="module")
def hasher(ds_compression):
    return NgramHasher(EngramConfig.preset("deepseek-v4.1"), ds_compression)


# Small id and length ranges make repeated n-grams and long dead spans likely.
ids_st = st.lists(st.integers(0, 129279), min_size=1, max_size=40)


@st.composite
def sequence_and_cuts(draw):
    ids = draw(ids_st)
    dead = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    cuts = sorted(set(draw(st.lists(st.integers(1, len(ids)), max_size=8))) | {len(ids)})
    return np.array(ids), np.array(dead), cuts


@settings(max_examples=60, deadline=None)
@given(case=sequence_and_cuts())
def test_chunked_stream_equals_whole_sequence(hasher, case):
    ids, dead, cuts = case
    whole = hasher.hash(ids, dead)
    s = HashStream(hasher)
    parts, start = [], 0
    for end in cuts:
        parts.append(s.feed(ids[start:end], dead[start:end]))
        start = end
    assert np.array_equal(np.concatenate(parts), whole)
    assert s.position[0] == len(ids)


@settings(max_examples=60, deadline=None)
@given(case=sequence_and_cuts(), data=st.data())
def test_drafts_commit_and_rollback(hasher, case, data):
    """Drafting k tokens then committing j gives what feeding only those j would have."""
    ids, dead, _cuts = case
    whole = hasher.hash(ids, dead)
    s = HashStream(hasher)
    out, pos = [], 0
    while pos < len(ids):
        k = data.draw(st.integers(1, 6))
        draft_ids = ids[pos : pos + k]
        draft_dead = dead[pos : pos + k]
        # the draft sees the committed tokens: its rows are the whole-sequence rows
        assert np.array_equal(s.draft(draft_ids, draft_dead), whole[pos : pos + len(draft_ids)])
        # some rejected garbage drafted after them must not leak into later rows
        junk = np.array(data.draw(st.lists(st.integers(0, 129279), min_size=0, max_size=3)), dtype=np.int64)
        if junk.size:
            s.draft(junk)
        j = data.draw(st.integers(0, len(draft_ids)))
        s.commit(j)
        out.append(whole[pos : pos + j])
        pos += j
        if j == 0:  # feed one committed token so the loop makes progress
            out.append(s.feed(ids[pos : pos + 1], dead[pos : pos + 1]))
            pos += 1
    assert np.array_equal(np.concatenate(out), whole)


def test_rollback_restores_state(hasher):
    s = HashStream(hasher)
    s.feed(np.array([5, 6, 7]))
    before = s.window.copy()
    s.draft(np.array([8, 9, 10, 11]))
    s.draft(np.array([12]))
    s.rollback()
    assert np.array_equal(s.window, before) and s.position[0] == 3 and s.n_draft[0] == 0
    assert np.array_equal(s.feed(np.array([13])), hasher.hash(np.array([5, 6, 7, 13]))[3:])


def test_batched_decode_steps_and_ragged_prefill(hasher):
    rng = np.random.default_rng(0)
    b, t = 5, 30
    ids = rng.integers(0, 129280, size=(b, t))
    dead = rng.random((b, t)) < 0.1
    whole = hasher.hash(ids, dead)
    s = HashStream(hasher, batch_size=b)
    prefill = [3, 0, 10, 1, 7]  # ragged prefill, one sequence at a time
    for i, p in enumerate(prefill):
        if p:
            assert np.array_equal(s.feed(ids[i, :p], dead[i, :p], seqs=i), whole[i, :p])
    # bring everyone to position 10 with per-sequence chunks, then decode in lock-step
    for i, p in enumerate(prefill):
        if p < 10:
            s.feed(ids[i, p:10], dead[i, p:10], seqs=i)
    for step in range(10, t):
        rows = s.step(torch.from_numpy(ids[:, step]), torch.from_numpy(dead[:, step]))
        assert isinstance(rows, torch.Tensor)
        assert np.array_equal(rows.numpy(), whole[:, step])
    assert (s.position == t).all()


def test_per_sequence_commit_counts(hasher):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 129280, size=(3, 12))
    whole = hasher.hash(ids)
    s = HashStream(hasher, batch_size=3)
    s.feed(ids[:, :4])
    assert np.array_equal(s.draft(ids[:, 4:9]), whole[:, 4:9])
    s.commit(np.array([0, 2, 5]))
    assert s.position.tolist() == [4, 6, 9]
    assert np.array_equal(s.feed(ids[0, 4:12], seqs=0), whole[0, 4:12])
    assert np.array_equal(s.feed(ids[1, 6:12], seqs=1), whole[1, 6:12])
    assert np.array_equal(s.feed(ids[2, 9:12], seqs=2), whole[2, 9:12])


def test_state_is_bounded(hasher):
    s = HashStream(hasher, batch_size=2)
    for _ in range(50):
        s.feed(np.random.default_rng(0).integers(0, 129280, size=(2, 100)))
    assert s.window.shape == (2, 3)  # O(max_ngram), not O(sequence length)
    assert s.position.tolist() == [5000, 5000]
    s.draft(np.zeros((2, 4), dtype=np.int64))
    s.commit(4)
    assert s._draft_vals.shape[1] == 4  # drafts in flight only


def test_reset(hasher):
    s = HashStream(hasher)
    s.feed(np.array([1, 2, 3]))
    s.reset()
    assert np.array_equal(s.feed(np.array([9, 8])), hasher.hash(np.array([9, 8])))


def test_errors(hasher):
    s = HashStream(hasher, batch_size=2)
    with pytest.raises(ValueError, match="seqs=<index>"):
        s.feed(np.array([1, 2]))
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        s.feed(np.array([1, 2]), seqs=2)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        s.step(np.array([1, 2, 3]))
    s.draft(np.array([[1], [2]]))
    with pytest.raises(RuntimeError, match="commit"):
        s.feed(np.array([[1], [2]]))
    with pytest.raises(ValueError, match="cannot commit 2 tokens"):
        s.commit(2)
    with pytest.raises(ValueError, match="129280"):
        s.step(np.array([1, 129280]))
    with pytest.raises(ValueError, match="batch_size"):
        HashStream(hasher, batch_size=0)
    with pytest.raises(TypeError, match=r"batch_size must be an int.*None"):
        HashStream(hasher, None)  # type: ignore[arg-type]


def test_a_restart_id_ending_one_draft_round_restarts_the_next(ds_compression):
    """Issue 18's case: `draft([1])`, `draft([121788])`, `commit(2)`, `feed([8753])` with windows
    restarting after id 1 gives the rows of hashing the three tokens at once (the second draft
    round once let the restart id back into the committed window)."""
    config = EngramConfig.preset("deepseek-v4.1").replace(restart_after_id=1)
    for backend in ("auto", "numpy"):
        hasher = NgramHasher(config, ds_compression, backend=backend)
        whole = hasher.hash(np.array([[1, 121788, 8753]]))
        one_round = HashStream(hasher)
        one_round.draft(np.array([1, 121788]))
        one_round.commit(2)
        s = HashStream(hasher)
        assert np.array_equal(s.draft(np.array([1])), whole[0, :1])
        assert np.array_equal(s.draft(np.array([121788])), whole[0, 1:2])
        s.commit(2)
        assert np.array_equal(s.window, one_round.window)
        assert np.array_equal(s.feed(np.array([8753])), whole[0, 2:])
