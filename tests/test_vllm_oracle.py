"""engram-lm's DeepSeek-V4.1 addressing against vLLM's own implementation of it, used as an oracle.

vLLM 0.32 serves DeepSeek-V4.1 with its own Engram hasher (`vllm/models/deepseek_v41/common/engram.py`):
`build_compressed_token_map` (the tokenizer compression), `EngramLayout` (the per-head primes and table
offsets), `compute_hash_multipliers`, and `NgramHashState`, whose forward runs two Triton kernels over a
step's flat batch: one writes each token's compressed id (or DEAD) to its KV-cache slot, the other hashes
every position from the chunk itself, then the runner's `lookback_token_ids` (the V2 runner), then the
slot cache read through the block table (the V1 runner). It was written by vLLM's authors from DeepSeek's
reference code, shares no code with engram-lm, and is what a served checkpoint is hashed with, so
agreement here is an independent check of ours and of the compatibility that serving needs:

1. the compression map (129280 DeepSeek-V4 ids -> 99092) equals `TokenizerCompression.lookup`;
2. the primes, offsets and multipliers of the `deepseek-v4.1` preset equal `NgramHasher`'s (and each
   layer's `num_embeddings` is the sum of vLLM's primes);
3. `NgramHashState.forward` rows equal `NgramHasher.hash` of each whole request (sliced at its chunk)
   for real DeepSeek-V4 token ids (text with ids that compression merges, BOS, EOS and the pad id), with
   dead (image) tokens inside chunks and inside the look-back, through `lookback_token_ids` (V2) and
   through the slot cache + block table over two steps (V1: chunked prefill, a decode, a chunk reading
   the previous block, a prefix-cache hit on another request's blocks, a padded batch);
4. `engram.vllm.slots.SlotTokens.rows` fed the same V1 step tensors gives vLLM's rows.

vLLM has no Triton backend on CPU, so its kernels run in Triton's interpreter, in a subprocess: it must
see `TRITON_INTERPRET=1` before triton is imported, and `vllm.triton_utils` (placeholders on CPU) must be
pointed back at real Triton before vLLM's engram module is imported, which this pytest process cannot
guarantee. The subprocess gets the step tensors built here (`inputs.npz`, `spec.json`), builds vLLM's
state from the tokenizer and the config keys alone (nothing of engram's hashing), and writes its tables
and rows to `vllm_out.npz`. Runs only where vLLM is installed (the `vllm` marker; skipped elsewhere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from engram import EngramConfig, NgramHasher
from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.addressing.layout import Layout
from engram.vllm.slots import SlotTokens

pytestmark = [pytest.mark.vllm]

BLOCK = 16  # KV-cache block size of the V1 scenario (small, so runs and look-backs cross blocks)
MAX_BLOCKS = 4  # block-table width: 64 positions per request
NUM_BLOCKS = 32

# The vLLM side, run as `python vllm_side.py WORKDIR` with TRITON_INTERPRET=1.
VLLM_SIDE = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import numpy as np
import torch
import triton
import triton.language as tl
import vllm.triton_utils as tu
tu.triton, tu.tl = triton, tl  # vLLM put CPU placeholders there: real (interpreted) Triton instead
from types import SimpleNamespace
from transformers import PreTrainedTokenizerFast
from vllm.models.deepseek_v41.common import engram as V
from engram.addressing.compression import resolve_tokenizer  # loads the tokenizer.json, nothing more

work = sys.argv[1]
spec = json.load(open(os.path.join(work, "spec.json")))
inputs = np.load(os.path.join(work, "inputs.npz"))
tok = PreTrainedTokenizerFast(tokenizer_object=resolve_tokenizer(spec["tokenizer"]))
token_map, size = V.build_compressed_token_map(tok)
layout = V.EngramLayout(SimpleNamespace(**spec["config"]))
assert size == layout.compressed_vocab_size, (size, layout.compressed_vocab_size)
multipliers = V.compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, size)

# NgramHashState.__init__ wants a VllmConfig, an SWA cache module and AutoTokenizer: set its fields
st = V.NgramHashState.__new__(V.NgramHashState)
torch.nn.Module.__init__(st)
st.layout, st.lookback_depth, st.block_size = layout, layout.max_ngram_size - 1, spec["block_size"]
st.pad_id = token_map[layout.pad_token_id]
st.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int32), persistent=False)
st.register_buffer("primes", torch.tensor(layout.primes), persistent=False)
st.register_buffer("offsets", layout.offsets, persistent=False)
st.register_buffer("multipliers", multipliers, persistent=False)

out = {
    "token_map": np.asarray(token_map, dtype=np.int64),
    "size": np.int64(size),
    "pad_id": np.int64(st.pad_id),
    "primes": np.asarray(layout.primes, dtype=np.int64),
    "offsets": layout.offsets.numpy().astype(np.int64),
    "multipliers": multipliers.numpy(),
}
caches = {}  # one slot cache per V1 scenario, kept across its steps
for i, call in enumerate(spec["calls"]):
    t = {k: torch.from_numpy(inputs[f"{i}/{k}"]) for k in call["keys"]}
    name = call["cache"]
    st.use_slot_cache = name is not None
    st._cache = None if name is None else caches.setdefault(
        name, torch.zeros(spec["num_slots"], dtype=torch.int32))
    rows = st.forward(t["input_ids"], t["positions"], t["query_start_loc"], t["dead_mask"],
                      t["lookback_token_ids"], t["lookback_dead_mask"], t.get("slot_mapping"),
                      t.get("block_table"))
    out[f"rows{i}"] = rows.numpy()
np.savez(os.path.join(work, "vllm_out.npz"), **out)
"""

TEXT = (
    "The cat sat on the mat. the Cat SAT on THE MAT! A café in Paris, a Café in Rome, a CAFE in Berlin: "
    "naïve or Naive, the résumé of a Résumé.\n\nIn the beginning God created the heaven and the earth. "
    "And the earth was without form, and void; and darkness was upon the face of the deep. AND THE "
    "EARTH WAS WITHOUT FORM. and the Spirit of God moved upon the face of the waters.  And God said, "
    "Let there be light: and there was light. 12345 + 678 = 13023; x_1 = f(x_0) -> y."
)


def cat(xs: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate([np.asarray(x) for x in xs]).astype(dtype)


def dead_of(n: int, *spans: tuple[int, int]) -> np.ndarray:
    dead = np.zeros(n, dtype=bool)
    for a, b in spans:
        dead[a:b] = True
    return dead


def v2_call(seqs: list[np.ndarray], deads: list[np.ndarray], starts: list[int], depth: int) -> dict:
    """A flat V2 batch: each request from its chunk start to its end, the ids (and dead flags) of the
    `depth` positions before each start as look-back (column j = start - 1 - j; -1 before position 0)."""
    qsl, look, look_dead = [0], [], []
    for s, d, c in zip(seqs, deads, starts, strict=True):
        qsl.append(qsl[-1] + len(s) - c)
        look.append([s[c - 1 - j] if c - 1 - j >= 0 else -1 for j in range(depth)])
        look_dead.append([bool(d[c - 1 - j]) if c - 1 - j >= 0 else False for j in range(depth)])
    return {
        "input_ids": cat([s[c:] for s, c in zip(seqs, starts, strict=True)], np.int32),
        "positions": cat([np.arange(c, len(s)) for s, c in zip(seqs, starts, strict=True)], np.int64),
        "query_start_loc": np.asarray(qsl, dtype=np.int32),
        "dead_mask": cat([d[c:] for d, c in zip(deads, starts, strict=True)], bool),
        "lookback_token_ids": np.asarray(look, dtype=np.int32),
        "lookback_dead_mask": np.asarray(look_dead, dtype=bool),
    }


def v1_call(
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]], depth: int, pad: int = 0
) -> dict:
    """A flat V1 batch of runs (seq, dead, block-table row, begin, end): slots through the block table,
    no look-back ids (all -1: vLLM reads the slot cache), `pad` padding tokens (slot -1) at the end."""
    qsl, ids, pos, dead, slots = [0], [], [], [], []
    for s, d, row, a, b in runs:
        p = np.arange(a, b)
        ids.append(s[a:b])
        pos.append(p)
        dead.append(d[a:b])
        slots.append(row[p // BLOCK].astype(np.int64) * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + b - a)
    zeros = np.zeros(pad, dtype=np.int64)
    return {
        "input_ids": cat([*ids, zeros], np.int32),
        "positions": cat([*pos, zeros], np.int64),
        "query_start_loc": np.asarray(qsl, dtype=np.int32),
        "dead_mask": cat([*dead, zeros], bool),
        "lookback_token_ids": np.full((len(runs), depth), -1, dtype=np.int32),
        "lookback_dead_mask": np.zeros((len(runs), depth), dtype=bool),
        "slot_mapping": cat([*slots, zeros - 1], np.int64),
        "block_table": np.stack([r[2] for r in runs]).astype(np.int32),
    }


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    """Our side (config, hasher, the requests and the step tensors) and vLLM's outputs for them."""
    work = tmp_path_factory.mktemp("vllm_oracle")
    cfg = EngramConfig.preset("deepseek-v4.1")
    comp = TokenizerCompression.from_tokenizer("deepseek-v4")
    hasher = NgramHasher(cfg, comp)
    depth = cfg.max_ngram_size - 1

    ids = np.asarray(resolve_tokenizer("deepseek-v4").encode(TEXT).ids, dtype=np.int64)
    assert len(ids) >= 121, len(ids)  # the slices below reach token 121
    # distinct raw ids of the text that compression merges ("The"/" the"/" THE", " cat"/" Cat", ...)
    uniq = np.unique(ids)
    assert len(np.unique(comp.lookup[uniq])) <= len(uniq) - 5, "the text must hold ids compression merges"

    def seq(at: int, n: int, bos: bool = True) -> np.ndarray:
        s = ids[at : at + n].copy()
        if bos:
            s[0] = 0  # BOS
        return s

    # V2: chunk starts 0, 9 (dead ids in the look-back), 2 (short look-back), 30, 11 (a decode), 1
    v2_seqs = [seq(0, 40), seq(40, 17), seq(7, 5), seq(57, 64), seq(20, 12, bos=False), seq(90, 3)]
    v2_seqs[0][[12, 25]] = [1, cfg.pad_token_id]  # EOS and the pad id as tokens: hashed like any id
    v2_deads = [
        dead_of(40, (5, 8)),
        dead_of(17, (7, 9)),
        dead_of(5),
        dead_of(64, (31, 33), (60, 61)),
        dead_of(12, (9, 10)),
        dead_of(3),
    ]
    v2_starts = [0, 9, 2, 30, 11, 1]

    # V1: A, B, C, D prefilled in chunks over two steps; E, new in step 2, hits A's first two blocks
    # in the prefix cache (same 32 tokens) and starts at position 32, its look-back in A's slots.
    rng = np.random.default_rng(0)
    perm = rng.permutation(NUM_BLOCKS).astype(np.int32)
    a, b, c, d = seq(0, 64), seq(64, 17), seq(30, 5), seq(81, 30)
    e = np.concatenate([a[:32], ids[100:119]])
    tables = [perm[4 * i : 4 * i + MAX_BLOCKS] for i in range(4)]
    tables.append(np.concatenate([tables[0][:2], perm[16:18]]))  # E: A's blocks 0-1, then its own
    deads = [dead_of(64, (20, 22), (38, 40)), dead_of(17, (8, 9)), dead_of(5), dead_of(30, (14, 15))]
    deads.append(np.concatenate([deads[0][:32], dead_of(19, (5, 6))]))  # the shared prefix's flags
    seqs = [a, b, c, d, e]
    step1 = [(0, 0, 40), (1, 0, 9), (2, 0, 2), (3, 0, 16)]  # (request, begin, end)
    step2 = [(0, 40, 64), (1, 9, 10), (2, 2, 5), (3, 16, 30), (4, 32, 51)]
    v1_steps = [step1, step2]
    live = [np.zeros(len(s), dtype=bool) for s in seqs]

    def v1(dead: list[np.ndarray], pad: int) -> list[dict]:
        return [
            v1_call([(seqs[r], dead[r], tables[r], lo, hi) for r, lo, hi in step1], depth),
            v1_call([(seqs[r], dead[r], tables[r], lo, hi) for r, lo, hi in step2], depth, pad=pad),
        ]

    calls = [(None, v2_call(v2_seqs, v2_deads, v2_starts, depth))]
    calls += [("dead", x) for x in v1(deads, 0)] + [("live", x) for x in v1(live, 3)]

    spec = {
        "tokenizer": "deepseek-v4",
        "block_size": BLOCK,
        "num_slots": NUM_BLOCKS * BLOCK,
        "config": {  # the engram_* keys of DeepSeek-V4.1's config.json (engram_vocab_size one int there)
            "engram_layer_ids": list(cfg.layer_ids),
            "engram_num_embeddings": list(Layout(cfg).num_embeddings),
            "engram_max_ngram_size": cfg.max_ngram_size,
            "engram_n_heads": cfg.n_heads,
            "engram_head_dim": cfg.head_dim,
            "engram_compressed_vocab_size": cfg.compressed_vocab_size,
            "engram_pad_token_id": cfg.pad_token_id,
            "engram_vocab_size": cfg.engram_vocab_size[0],
        },
        "calls": [{"cache": name, "keys": sorted(x)} for name, x in calls],
    }
    assert len(set(cfg.engram_vocab_size)) == 1, "vLLM takes one prime-search base for every order"
    (work / "spec.json").write_text(json.dumps(spec))
    np.savez(work / "inputs.npz", **{f"{i}/{k}": v for i, (_, x) in enumerate(calls) for k, v in x.items()})
    script = work / "vllm_side.py"
    script.write_text(VLLM_SIDE)

    t0 = time.perf_counter()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(work)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"vLLM side failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = dict(np.load(work / "vllm_out.npz"))
    print(f"vLLM side (interpreted Triton): {time.perf_counter() - t0:.1f} s")
    return {
        "cfg": cfg,
        "comp": comp,
        "hasher": hasher,
        "out": out,
        "calls": [x for _, x in calls],
        "v2": (v2_seqs, v2_deads, v2_starts),
        "v1": (seqs, deads, v1_steps),
        "tables": tables,
    }


def compare(vllm_rows: np.ndarray, ours: np.ndarray, what: str) -> int:
    """Equal values (vLLM: [T, layers, cols] int32; ours: [T, n_layers, rows_per_token] int64)."""
    assert vllm_rows.dtype == np.int32 and ours.dtype == np.int64
    assert vllm_rows.shape == ours.shape, (what, vllm_rows.shape, ours.shape)
    np.testing.assert_array_equal(vllm_rows.astype(np.int64), ours, err_msg=what)
    return ours.size


def test_compression_map_equals_vllm(oracle):
    out, comp, cfg = oracle["out"], oracle["comp"], oracle["cfg"]
    assert int(out["size"]) == comp.size == cfg.compressed_vocab_size
    assert out["token_map"].shape == comp.lookup.shape == (cfg.vocab_size,)
    np.testing.assert_array_equal(out["token_map"], comp.lookup)
    assert int(out["pad_id"]) == oracle["hasher"].pad


def test_layout_and_multipliers_equal_vllm(oracle):
    out, h = oracle["out"], oracle["hasher"]
    np.testing.assert_array_equal(out["primes"], h.primes)  # [layers, orders, heads]
    np.testing.assert_array_equal(out["offsets"].reshape(h.offsets.shape), h.offsets)
    np.testing.assert_array_equal(out["multipliers"], h.multipliers)  # [layers, max_ngram]
    sums = out["primes"].reshape(len(h.primes), -1).sum(axis=1)
    np.testing.assert_array_equal(sums, np.asarray(Layout(oracle["cfg"]).num_embeddings))


def test_v2_lookback_rows_equal_ours(oracle):
    h = oracle["hasher"]
    seqs, deads, starts = oracle["v2"]
    want = np.concatenate([h.hash(s, d)[c:] for s, d, c in zip(seqs, deads, starts, strict=True)])
    n = compare(oracle["out"]["rows0"], want, "V2 path (lookback_token_ids)")
    print(f"V2: {n} row values equal")
    # the look-back mattered: hashing each chunk without its history differs at some chunk heads
    alone = np.concatenate([h.hash(s[c:], d[c:]) for s, d, c in zip(seqs, deads, starts, strict=True)])
    assert not np.array_equal(alone, want)


def v1_want(oracle: dict, dead: bool) -> list[np.ndarray]:
    h = oracle["hasher"]
    seqs, deads, steps = oracle["v1"]
    whole = [h.hash(s, d if dead else None) for s, d in zip(seqs, deads, strict=True)]
    return [np.concatenate([whole[r][lo:hi] for r, lo, hi in step]) for step in steps]


@pytest.mark.parametrize("dead", [True, False], ids=["dead-tokens", "live"])
def test_v1_slot_cache_rows_equal_ours(oracle, dead):
    first = 1 if dead else 3  # call indices of the scenario's two steps
    n = 0
    for k, want in enumerate(v1_want(oracle, dead)):
        rows = oracle["out"][f"rows{first + k}"][: len(want)]  # the live tokens (step 2 of "live" is padded)
        n += compare(rows, want, f"V1 path (slot cache), step {k + 1}")
    print(f"V1 {'with' if dead else 'without'} dead tokens: {n} row values equal")


def test_slot_tokens_rows_equal_vllm(oracle):
    """engram.vllm.slots.SlotTokens on the very tensors vLLM's V1 path got, step after step."""
    slots = SlotTokens(oracle["hasher"], BLOCK, NUM_BLOCKS * BLOCK)
    n = 0
    for k, (call, want) in enumerate(zip(oracle["calls"][3:5], v1_want(oracle, False), strict=True)):
        t = {key: torch.from_numpy(v) for key, v in call.items()}
        num = int(call["query_start_loc"][-1])
        rows = slots.rows(
            t["input_ids"], t["positions"], t["query_start_loc"], t["slot_mapping"], t["block_table"], num
        ).numpy()
        assert rows.shape[0] == len(call["input_ids"])
        vllm_rows = oracle["out"][f"rows{3 + k}"][:num]
        n += compare(vllm_rows, rows[:num], f"SlotTokens vs vLLM, step {k + 1}")
        np.testing.assert_array_equal(rows[:num], want)
    assert slots.lookback_reads == 3 + 3 + 2 + 3 + 3  # step 2: A, B, C (2 before position 2), D, E
    print(f"SlotTokens: {n} row values equal")
