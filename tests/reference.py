"""A plain, line-by-line implementation of SPEC §2-§4, written apart from the library's code.

Slow on purpose: Python ints, one position at a time. The tests compare the library with it.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

INT64_MAX = 2**63 - 1


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def primes(layer_ids, bases, n_heads):
    """{layer: [[p per head] per order]} searched as SPEC §3 says."""
    seen = set()
    out = {}
    for layer in layer_ids:
        out[layer] = []
        for base in bases:
            c = base - 1
            heads = []
            for _ in range(n_heads):
                p = c + 1
                while not (is_prime(p) and p not in seen):
                    p += 1
                seen.add(p)
                heads.append(p)
                c = p
            out[layer].append(heads)
    return out


def multipliers(layer_id, max_ngram, compressed_vocab, seed=0):
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    g = np.random.default_rng(seed + 10007 * layer_id)
    return [int(r) * 2 + 1 for r in g.integers(0, bound, size=max_ngram, dtype=np.int64)]


# Rust's char::is_whitespace, which the reference's Strip uses (Python's isspace adds \x1c-\x1f).
_RUST_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


def normalize(text: str) -> str:
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(ch for ch in s if unicodedata.category(ch) not in ("Mn", "Mc", "Me"))
    s = s.lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        return " "
    return s.strip(_RUST_WS)


def compression_lookup(decoded: list[str], vocab_strings: list[str]) -> list[int]:
    keys: dict[str, int] = {}
    out = []
    for text, raw in zip(decoded, vocab_strings, strict=True):
        key = raw if "\ufffd" in text else (normalize(text) or text)
        if key not in keys:
            keys[key] = len(keys)
        out.append(keys[key])
    return out


def hash_sequence(xc, dead, pad, layer_primes, layer_mults, max_ngram):
    """Rows [T][24] of one layer for one sequence of compressed ids (dead: list of bools or None)."""
    t_len = len(xc)
    dead = dead or [False] * t_len
    offsets = []
    acc = 0
    for order in layer_primes:
        for p in order:
            offsets.append(acc)
            acc += p
    rows = []
    for t in range(t_len):
        look = []
        blocked = False
        for i in range(max_ngram):
            pos = t - i
            if pos < 0 or dead[pos]:
                blocked = True
            look.append(pad if blocked else int(xc[pos]))
        out = []
        mix = (look[0] * layer_mults[0]) ^ (look[1] * layer_mults[1])
        col = 0
        for n in range(2, max_ngram + 1):
            if n > 2:
                mix ^= look[n - 1] * layer_mults[n - 1]
            assert 0 <= mix <= INT64_MAX
            for p in layer_primes[n - 2]:
                out.append(mix % p + offsets[col])
                col += 1
        rows.append(out)
    return rows
