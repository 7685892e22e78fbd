"""A fuzz of `HashStream` (hypothesis state machine, bounded time): random chunked prefills, decode
steps, drafts, partial commits, rollbacks, resets and deliberately bad calls, on the numba and the
numpy backends at once, against the plain reference of tests/reference.py (its own primes and
multipliers, one position at a time). Every call that raises must leave the stream as it was.
Run without restarts and with windows restarting after id 1 (`restart_after_id`, as Qwen4-Exp's PLE
and `engram.hf`'s `boundaries="eos"` use it), with several draft rounds before a commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import reference as ref
from engram import EngramConfig, HashStream, NgramHasher

B = 3  # sequences
CONFIG = EngramConfig.preset("deepseek-v4.1")
VOCAB = CONFIG.vocab_size
# A few ids repeated often (repeated n-grams) plus any id; dead positions now and then.
ids_st = st.one_of(st.sampled_from([0, 1, 2, 5, 100, 129279]), st.integers(0, VOCAB - 1))
chunk_st = st.lists(ids_st, min_size=1, max_size=6)
dead_st = st.one_of(st.none(), st.lists(st.booleans(), min_size=6, max_size=6))
seqs_st = st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True)


class Reference:
    """Per sequence: committed (compressed id, dead, raw id) tokens and drafted ones; rows by
    tests/reference.py, one position at a time over the tokens since the last window start (the
    position after a restart id starts a window: nothing before it is seen)."""

    def __init__(self, hasher: NgramHasher) -> None:
        c = hasher.config
        self.lookup = hasher.compression.lookup
        self.pad = int(self.lookup[c.pad_token_id])
        self.restart = c.restart_after_id
        primes = ref.primes(c.layer_ids, c.engram_vocab_size, c.n_heads)
        self.layers = [
            (primes[layer], ref.multipliers(layer, c.max_ngram_size, c.compressed_vocab_size, c.seed))
            for layer in c.layer_ids
        ]
        self.n = c.max_ngram_size
        self.committed: list[list[tuple[int, bool, int]]] = [[] for _ in range(B)]
        self.drafts: list[list[tuple[int, bool, int]]] = [[] for _ in range(B)]

    def rows(self, b: int, new: list[tuple[int, bool, int]], after_drafts: bool) -> np.ndarray:
        """Rows (len(new), n_layers, 24) of `new` tokens after sequence b's history."""
        seq = self.committed[b] + (self.drafts[b] if after_drafts else []) + new
        first = len(seq) - len(new)
        out = np.empty((len(new), len(self.layers), CONFIG.rows_per_token), dtype=np.int64)
        for p in range(first, len(seq)):
            begin = max(0, p - (self.n - 1))  # a look-back reaches n-1 tokens back at most
            for k in range(begin + 1, p + 1):
                if seq[k - 1][2] == self.restart:
                    begin = k
            part = seq[begin : p + 1]
            for layer, (primes, mults) in enumerate(self.layers):
                rows = ref.hash_sequence(
                    [v for v, _, _ in part], [d for _, d, _ in part], self.pad, primes, mults, self.n
                )
                out[p - first, layer] = rows[-1]
        return out

    def tokens(self, ids: list[int], dead: list[bool] | None) -> list[tuple[int, bool, int]]:
        return [(int(self.lookup[i]), bool(dead[j]) if dead else False, int(i)) for j, i in enumerate(ids)]


def snapshot(s: HashStream) -> tuple:
    return (s.window.copy(), s.position.copy(), s.n_draft.copy())


class StreamMachine(RuleBasedStateMachine):
    hashers: tuple[NgramHasher, NgramHasher] | None = None

    def __init__(self) -> None:
        super().__init__()
        fast, plain = self.hashers  # type: ignore[misc]
        self.streams = [HashStream(fast, B), HashStream(plain, B)]
        self.ref = Reference(fast)

    # ------------------------------------------------------------------ helpers
    def expect_unchanged(self, call, error: type[Exception] | tuple[type[Exception], ...]) -> None:
        for s in self.streams:
            before = snapshot(s)
            with pytest.raises(error):
                call(s)
            after = snapshot(s)
            assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), (
                "a failed call changed state"
            )

    # ------------------------------------------------------------------ committed tokens
    @rule(seqs=seqs_st, data=st.data())
    def feed(self, seqs, data):
        t = data.draw(st.integers(1, 5))
        ids = np.array([data.draw(st.lists(ids_st, min_size=t, max_size=t)) for _ in seqs])
        dead = np.array([data.draw(st.lists(st.booleans(), min_size=t, max_size=t)) for _ in seqs])
        if any(self.ref.drafts[b] for b in seqs):
            self.expect_unchanged(lambda s: s.feed(ids, dead, seqs=seqs), RuntimeError)
            return
        want = np.stack(
            [
                self.ref.rows(b, self.ref.tokens(list(ids[i]), list(dead[i])), False)
                for i, b in enumerate(seqs)
            ]
        )
        for s in self.streams:
            assert np.array_equal(s.feed(ids, dead, seqs=seqs), want)
        for i, b in enumerate(seqs):
            self.ref.committed[b] += self.ref.tokens(list(ids[i]), list(dead[i]))

    @rule(ids=st.lists(ids_st, min_size=B, max_size=B), dead=st.lists(st.booleans(), min_size=B, max_size=B),
          kind=st.sampled_from(["numpy", "torch", "out32", "nodead"]))  # fmt: skip
    def step(self, ids, dead, kind):
        ids_np = np.array(ids)
        dead_np = None if kind == "nodead" else np.array(dead)
        if any(self.ref.drafts):
            self.expect_unchanged(lambda s: s.step(ids_np, dead_np), RuntimeError)
            return
        new = [self.ref.tokens([ids[b]], None if dead_np is None else [dead[b]]) for b in range(B)]
        want = np.stack([self.ref.rows(b, new[b], False)[0] for b in range(B)])
        for s in self.streams:
            if kind == "torch":
                got = s.step(
                    torch.from_numpy(ids_np), None if dead_np is None else torch.from_numpy(dead_np)
                ).numpy()
            elif kind == "out32":
                out = np.empty((B, CONFIG.n_layers, CONFIG.rows_per_token), dtype=np.int32)
                got = s.step(ids_np, dead_np, out=out)
                assert got is out
            else:
                got = s.step(ids_np, dead_np)
            assert np.array_equal(got, want)
        for b in range(B):
            self.ref.committed[b] += new[b]

    # ------------------------------------------------------------------ drafts
    @rule(seqs=seqs_st, data=st.data())
    def draft(self, seqs, data):
        t = data.draw(st.integers(1, 4))
        ids = np.array([data.draw(st.lists(ids_st, min_size=t, max_size=t)) for _ in seqs])
        dead = np.array([data.draw(st.lists(st.booleans(), min_size=t, max_size=t)) for _ in seqs])
        toks = [self.ref.tokens(list(ids[i]), list(dead[i])) for i in range(len(seqs))]
        want = np.stack([self.ref.rows(b, toks[i], True) for i, b in enumerate(seqs)])
        for s in self.streams:
            assert np.array_equal(s.draft(ids, dead, seqs=seqs), want)
        for i, b in enumerate(seqs):
            self.ref.drafts[b] += toks[i]

    @rule(seqs=seqs_st, rounds=st.integers(2, 3), data=st.data())
    def drafts_then_commit(self, seqs, rounds, data):
        """Several draft rounds before one commit (a restart id may end any round)."""
        for _ in range(rounds):
            self.draft(seqs, data)
        self.commit(seqs, data)

    @rule(seqs=seqs_st, data=st.data())
    def commit(self, seqs, data):
        n = [data.draw(st.integers(0, len(self.ref.drafts[b]))) for b in seqs]
        for s in self.streams:
            s.commit(np.array(n), seqs=seqs)
        for k, b in zip(n, seqs, strict=True):
            self.ref.committed[b] += self.ref.drafts[b][:k]
            self.ref.drafts[b] = []

    @rule(seqs=st.one_of(st.none(), seqs_st))
    def rollback(self, seqs):
        for s in self.streams:
            s.rollback(seqs)
        for b in range(B) if seqs is None else seqs:
            self.ref.drafts[b] = []

    @rule(seqs=seqs_st)
    def reset(self, seqs):
        for s in self.streams:
            s.reset(seqs)
        for b in seqs:
            self.ref.committed[b], self.ref.drafts[b] = [], []

    # ------------------------------------------------------------------ bad calls
    @rule(bad=st.sampled_from([-1, VOCAB, VOCAB + 7]), at=st.integers(0, B - 1))
    def step_with_a_bad_id(self, bad, at):
        ids = np.zeros(B, dtype=np.int64)
        ids[at] = bad
        self.expect_unchanged(lambda s: s.step(ids), (ValueError, RuntimeError))

    @rule(kind=st.sampled_from(["float", "shape", "dead", "out_shape", "out_dtype", "out_readonly"]))
    def step_with_a_bad_argument(self, kind):
        ids = np.zeros(B, dtype=np.int64)
        out = np.empty((B, CONFIG.n_layers, CONFIG.rows_per_token), dtype=np.int64)
        calls = {
            "float": lambda s: s.step(ids.astype(np.float64)),
            "shape": lambda s: s.step(np.zeros(B + 1, dtype=np.int64)),
            "dead": lambda s: s.step(ids, np.zeros(B + 1, dtype=bool)),
            "out_shape": lambda s: s.step(ids, out=out[:, :, :-1]),
            "out_dtype": lambda s: s.step(ids, out=out.astype(np.float32)),
            "out_readonly": lambda s: s.step(ids, out=np.broadcast_to(out, out.shape)),
        }
        self.expect_unchanged(calls[kind], (ValueError, TypeError, RuntimeError))

    @rule(kind=st.sampled_from(["bad_id", "dup_seqs", "seq_range", "rows", "dead_shape", "float"]))
    def feed_or_draft_with_a_bad_argument(self, kind):
        ids = np.zeros((2, 3), dtype=np.int64)
        args = {
            "bad_id": (np.full((2, 3), VOCAB), None, [0, 1]),
            "dup_seqs": (ids, None, [1, 1]),
            "seq_range": (ids, None, [0, B]),
            "rows": (ids, None, [0, 1, 2]),
            "dead_shape": (ids, np.zeros((2, 4), dtype=bool), [0, 1]),
            "float": (ids.astype(np.float32), None, [0, 1]),
        }[kind]
        self.expect_unchanged(lambda s: s.feed(*args), (ValueError, TypeError, RuntimeError))
        self.expect_unchanged(lambda s: s.draft(*args), (ValueError, TypeError))

    @rule(
        method=st.sampled_from(["commit", "rollback", "reset"]),
        seqs=st.sampled_from([[0, 0], [B], [-1], [0.5], [True, False]]),
    )
    def select_with_bad_seqs(self, method, seqs):
        args = {"commit": (0,), "rollback": (), "reset": ()}[method]
        self.expect_unchanged(lambda s: getattr(s, method)(*args, seqs=seqs), (ValueError, TypeError))

    @precondition(lambda self: any(self.ref.drafts))
    @rule(data=st.data())
    def commit_too_many(self, data):
        b = next(i for i in range(B) if self.ref.drafts[i])
        too_many = len(self.ref.drafts[b]) + data.draw(st.integers(1, 3))
        self.expect_unchanged(lambda s: s.commit(too_many, seqs=[b]), ValueError)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def counts_match(self):
        for s in self.streams:
            assert s.position.tolist() == [len(c) for c in self.ref.committed]
            assert s.n_draft.tolist() == [len(d) for d in self.ref.drafts]


@pytest.mark.parametrize("restart_after_id", [None, 1])
def test_stream_fuzz(ds_compression, restart_after_id):
    config = CONFIG.replace(restart_after_id=restart_after_id)
    StreamMachine.hashers = (
        NgramHasher(config, ds_compression),
        NgramHasher(config, ds_compression, backend="numpy"),
    )
    run = StreamMachine.TestCase
    run.settings = settings(
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run().runTest()


@pytest.mark.parametrize("batch_size", [None, 0, -1, 1.5, True, "2"])
def test_bad_batch_size_is_refused(v41_hasher, batch_size):
    with pytest.raises((TypeError, ValueError), match="batch_size"):
        HashStream(v41_hasher, batch_size)
