"""vLLM 0.32's DeepSeek-V4.1 Engram hasher (Triton, interpreted on CPU) vs engram-lm's NgramHasher."""
import os, sys, time
os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
import numpy as np, torch
import triton, triton.language as tl
import vllm.triton_utils as tu                # vLLM replaced triton by placeholders on CPU:
tu.triton, tu.tl = triton, tl                 # point its names back at real Triton before the import
from types import SimpleNamespace
from vllm.models.deepseek_v41.common import engram as V
from engram.config import EngramConfig
from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout

t0 = time.time()
ours_c = TokenizerCompression.from_tokenizer("deepseek-v4")
from transformers import PreTrainedTokenizerFast
hf_tok = PreTrainedTokenizerFast(tokenizer_object=resolve_tokenizer("deepseek-v4"))
vmap, vsize = V.build_compressed_token_map(hf_tok)
print("compression map: vllm size", vsize, "ours", ours_c.size, "equal", np.array_equal(np.array(vmap), ours_c.lookup),
      f"({time.time()-t0:.0f}s)")

cfg = EngramConfig.preset("deepseek-v4.1")
lay = Layout(cfg)
ns = SimpleNamespace(engram_layer_ids=list(cfg.layer_ids), engram_num_embeddings=list(lay.num_embeddings),
                     engram_max_ngram_size=cfg.max_ngram_size, engram_n_heads=cfg.n_heads,
                     engram_head_dim=cfg.head_dim, engram_compressed_vocab_size=cfg.compressed_vocab_size,
                     engram_pad_token_id=cfg.pad_token_id, engram_vocab_size=cfg.engram_vocab_size[0])
vl = V.EngramLayout(ns)
hasher = NgramHasher(cfg, ours_c)
vm = V.compute_hash_multipliers(vl.layer_ids, vl.max_ngram_size, vl.compressed_vocab_size)
print("multipliers equal", np.array_equal(vm.numpy(), hasher.multipliers))
print("primes equal", np.array_equal(np.array(vl.primes).reshape(hasher.primes.shape), hasher.primes),
      "offsets equal", np.array_equal(vl.offsets.numpy().reshape(hasher.offsets.shape), hasher.offsets))

# NgramHashState without its __init__ (which wants a VllmConfig, an SWA cache module, AutoTokenizer)
st = V.NgramHashState.__new__(V.NgramHashState)
torch.nn.Module.__init__(st)
st.layout, st.lookback_depth, st.use_slot_cache, st._cache = vl, vl.max_ngram_size - 1, False, None
st.block_size = 32
st.pad_id = int(ours_c.lookup[cfg.pad_token_id])
st.register_buffer("token_map", torch.tensor(vmap, dtype=torch.int32), persistent=False)
st.register_buffer("primes", torch.tensor(vl.primes), persistent=False)
st.register_buffer("offsets", vl.offsets, persistent=False)
st.register_buffer("multipliers", vm, persistent=False)

rng = np.random.default_rng(0)
depth = st.lookback_depth
seqs = [rng.integers(0, cfg.vocab_size, size=L) for L in (40, 17, 5, 64)]
starts = [0, 9, 2, 30]                       # chunk start of each request (prefix already computed)
ids, pos, qsl, look = [], [], [0], []
for s, c in zip(seqs, starts):
    ids.append(s[c:]); pos.append(np.arange(c, len(s))); qsl.append(qsl[-1] + len(s) - c)
    look.append([s[c - 1 - j] if c - 1 - j >= 0 else -1 for j in range(depth)])  # col j = start-1-j
ids_t = torch.tensor(np.concatenate(ids), dtype=torch.int32)
t1 = time.time()
out = st.forward(ids_t, torch.tensor(np.concatenate(pos)), torch.tensor(qsl, dtype=torch.int32),
                 torch.zeros(len(ids_t), dtype=torch.bool), torch.tensor(look, dtype=torch.int32),
                 torch.zeros(len(seqs), depth, dtype=torch.bool), None, None)
ref = np.concatenate([hasher.hash(s)[c:] for s, c in zip(seqs, starts)])
print("hash rows", tuple(out.shape), "equal", np.array_equal(out.numpy().astype(np.int64), ref.reshape(out.shape)),
      f"(interpreted kernel {time.time()-t1:.1f}s for {len(ids_t)} tokens)")

# V1 path: slot-keyed cache through block tables (no lookback_token_ids): step 1 prefills the first
# part of every request, step 2 continues from the slots step 1 wrote.
B, nblk = 32, 16
st.use_slot_cache, st.block_size = True, B
st._cache = torch.zeros(nblk * B, dtype=torch.int32)
perm = rng.permutation(nblk)
bt = torch.tensor(perm[: len(seqs) * 3].reshape(len(seqs), 3), dtype=torch.int32)  # 3 blocks/request

def step(chunks):
    ids, pos, qsl, slots = [], [], [0], []
    for r, (a, b) in enumerate(chunks):
        p = np.arange(a, b); ids.append(seqs[r][a:b]); pos.append(p); qsl.append(qsl[-1] + b - a)
        slots.append(bt[r, p // B].numpy().astype(np.int64) * B + p % B)
    ids_t = torch.tensor(np.concatenate(ids), dtype=torch.int32)
    return st.forward(ids_t, torch.tensor(np.concatenate(pos)), torch.tensor(qsl, dtype=torch.int32),
                      torch.zeros(len(ids_t), dtype=torch.bool),
                      torch.full((len(chunks), depth), -1, dtype=torch.int32),
                      torch.zeros(len(chunks), depth, dtype=torch.bool),
                      torch.tensor(np.concatenate(slots)), bt)

o1 = step([(0, c) for c in (20, 9, 2, 33)])
ch2 = [(20, 40), (9, 10), (2, 5), (33, 64)]
o2 = step(ch2)
ref2 = np.concatenate([hasher.hash(s)[a:b] for s, (a, b) in zip(seqs, ch2)])
print("V1 slot-cache path equal", np.array_equal(o2.numpy().astype(np.int64), ref2.reshape(o2.shape)))
