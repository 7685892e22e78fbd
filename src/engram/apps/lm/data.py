"""Training data: a corpus (the King James Bible by default, or any text files) split into train and
held-out documents, a byte-level BPE tokenizer trained on the training split (cached), token streams,
and batches that are a pure function of (seed, step). Knows nothing of models or training.
Design: docs/training.md.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engram.apps.lm.corpus import kjv_verses
from engram.checkpoint.input_files import input_file, path_kind, read_text_file

__all__ = [
    "EOS",
    "Document",
    "TokenStream",
    "cache_dir",
    "load_corpus",
    "split_documents",
    "train_bpe",
]

EOS = "<|endoftext|>"

_KJV_CATEGORIES = {
    "law": ("Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy"),
    "history": (
        "Joshua",
        "Judges",
        "Ruth",
        "1 Samuel",
        "2 Samuel",
        "1 Kings",
        "2 Kings",
        "1 Chronicles",
        "2 Chronicles",
        "Ezra",
        "Nehemiah",
        "Esther",
    ),
    "wisdom": ("Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon"),
    "prophets": (
        "Isaiah",
        "Jeremiah",
        "Lamentations",
        "Ezekiel",
        "Daniel",
        "Hosea",
        "Joel",
        "Amos",
        "Obadiah",
        "Jonah",
        "Micah",
        "Nahum",
        "Habakkuk",
        "Zephaniah",
        "Haggai",
        "Zechariah",
        "Malachi",
    ),
    "gospels": ("Matthew", "Mark", "Luke", "John", "Acts"),
    "epistles": (
        "Romans",
        "1 Corinthians",
        "2 Corinthians",
        "Galatians",
        "Ephesians",
        "Philippians",
        "Colossians",
        "1 Thessalonians",
        "2 Thessalonians",
        "1 Timothy",
        "2 Timothy",
        "Titus",
        "Philemon",
        "Hebrews",
        "James",
        "1 Peter",
        "2 Peter",
        "1 John",
        "2 John",
        "3 John",
        "Jude",
        "Revelation",
    ),
}
# About 9 % of the text, one or two books from every category.
KJV_HELD_OUT = (
    "Deuteronomy",
    "Ruth",
    "Esther",
    "Ecclesiastes",
    "Hosea",
    "Jonah",
    "Mark",
    "Galatians",
    "Hebrews",
)


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    category: str = "text"


def cache_dir() -> Path:
    """Where trained tokenizers are cached: $ENGRAM_CACHE, else ~/.cache/engram-lm."""
    return Path(os.environ.get("ENGRAM_CACHE", Path.home() / ".cache" / "engram-lm"))


def _kjv_documents() -> list[Document]:
    category = {book: cat for cat, books in _KJV_CATEGORIES.items() for book in books}
    books: dict[str, list[str]] = {}
    for v in kjv_verses():
        books.setdefault(v["book"], []).append(v["text"])
    return [Document(name, "\n".join(verses), category.get(name, "other")) for name, verses in books.items()]


def load_corpus(spec: str | None = None) -> list[Document]:
    """`None` or "kjv": the King James Bible by book. Otherwise a text file, a folder of *.txt
    files, or a glob pattern; each file is one document of category "text"."""
    if spec in (None, "kjv"):
        return _kjv_documents()
    path = Path(spec)
    kind = path_kind(path)  # an os.stat: nothing is opened (a FIFO would block for good)
    if kind == "a folder":
        files = sorted(f for f in path.rglob("*.txt") if path_kind(f) != "a folder")
    elif kind is not None:
        files = [input_file(path, "a text file, a folder of *.txt or a glob")]
    else:
        files = sorted(Path(p) for p in glob.glob(spec) if path_kind(p) != "a folder")
    if not files:
        raise FileNotFoundError(
            f"--corpus {spec!r} names no text file (give a file, a folder of *.txt, or a glob)"
        )
    # each file checked (a regular file) before it is read, and named if it is not UTF-8 text
    docs = [Document(f.name, read_text_file(f, "a text file")) for f in files]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise ValueError(f"--corpus {spec!r}: every file is empty")
    return docs


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held_out). The Bible splits by book; a single file by its last 10 %."""
    names = {d.name for d in docs}
    if set(KJV_HELD_OUT) <= names:
        held = set(KJV_HELD_OUT)
        return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]
    if len(docs) == 1:
        d = docs[0]
        cut = d.text.rfind("\n", 0, int(len(d.text) * 0.9))
        cut = cut if cut > 0 else int(len(d.text) * 0.9)
        return [Document(d.name, d.text[:cut], d.category)], [
            Document(d.name + ":held-out", d.text[cut:], d.category)
        ]
    held_idx = set(range(9, len(docs), 10)) or {len(docs) - 1}
    return [d for i, d in enumerate(docs) if i not in held_idx], [
        d for i, d in enumerate(docs) if i in held_idx
    ]


def train_bpe(texts: list[str], vocab_size: int = 4096, cache: Path | None = None) -> Tokenizer:
    """A byte-level BPE trained on `texts` (EOS as a special token), cached by content hash."""
    h = hashlib.sha256(f"bpe-v1|{vocab_size}|".encode())
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    path = (cache or cache_dir()) / "tokenizers" / f"bpe{vocab_size}-{h.hexdigest()[:16]}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
    return tok


class TokenStream:
    """One split as a single id stream: documents joined by EOS, with a category id per token."""

    def __init__(self, docs: list[Document], tokenizer: Tokenizer) -> None:
        eos = tokenizer.token_to_id(EOS)
        if eos is None:
            raise ValueError(
                f"the tokenizer has no {EOS!r} token to separate documents; add it as a special token"
            )
        self.categories = sorted({d.category for d in docs})
        self.doc_names = [d.name for d in docs]
        ids, cats = [], []
        # encode line by line (fast in batch), then join lines with their newline tokens
        for d in docs:
            encoded = tokenizer.encode_batch(
                [line + "\n" for line in d.text.split("\n")], add_special_tokens=False
            )
            doc_ids = [i for e in encoded for i in e.ids] + [eos]
            ids.append(np.array(doc_ids, dtype=np.int64))
            cats.append(np.full(len(doc_ids), self.categories.index(d.category), dtype=np.int8))
        self.ids = np.concatenate(ids)
        self.category_ids = np.concatenate(cats)
        # (n_docs + 1,) token offsets: document d holds ids[doc_offsets[d] : doc_offsets[d + 1]]
        self.doc_offsets = np.concatenate([[0], np.cumsum([a.size for a in ids])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.ids.size)

    def batch_starts(self, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
        """Window starts of training step `step`: a pure function of (seed, step)."""
        if len(self) < seq_len + 2:
            raise ValueError(f"the stream has {len(self)} tokens, fewer than one window of {seq_len + 1}")
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, len(self) - seq_len - 1, size=batch_size)

    def windows(self, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (B, seq_len), for windows starting at `starts`."""
        idx = starts[:, None] + np.arange(seq_len + 1)  # (B, T+1)
        w = self.ids[idx]
        return w[:, :-1], w[:, 1:]

    def eval_starts(self, seq_len: int, max_tokens: int | None = None, seed: int = 0) -> np.ndarray:
        """Non-overlapping window starts covering the stream; with `max_tokens`, a fixed sample of about
        max_tokens / seq_len of them spread over every document (`sample_starts`)."""
        starts = np.arange(0, len(self) - seq_len, seq_len)
        if max_tokens is None:
            return starts
        return self.sample_starts(starts, seq_len, max_tokens, seed)

    def sample_starts(self, starts: np.ndarray, seq_len: int, max_tokens: int, seed: int = 0) -> np.ndarray:
        """A seeded sample of the windows `starts`, stratified by document: each document gets a share
        of the max_tokens // seq_len windows in proportion to its windows (largest remainders), and at
        least one window overlapping it, so every document is scored. Sorted; a pure function of the
        arguments (a private RNG: the training batches and torch's RNG are untouched)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 (or None: the whole stream)")
        want = max(1, max_tokens // seq_len)
        if want >= len(starts):
            return starts
        n_docs = len(self.doc_offsets) - 1
        doc_of = np.searchsorted(self.doc_offsets, starts, side="right") - 1  # document of each start
        per_doc = np.bincount(doc_of, minlength=n_docs)
        quota = per_doc * want / len(starts)
        take = np.floor(quota).astype(np.int64)
        extra = want - int(take.sum())
        if extra > 0:
            take[np.argsort(-(quota - take), kind="stable")[:extra]] += 1
        rng = np.random.default_rng([seed, 0x5E1EC7])
        chosen: list[np.ndarray] = []
        for d in range(n_docs):
            if per_doc[d] == 0:
                # a document shorter than a window: the window that overlaps its first token
                chosen.append(
                    starts[np.searchsorted(starts, self.doc_offsets[d], side="right") - 1 : None][:1]
                )
                continue
            mine = starts[doc_of == d]
            chosen.append(rng.choice(mine, size=max(1, min(int(take[d]), mine.size)), replace=False))
        return np.unique(np.concatenate(chosen))
