"""Saving and loading the Engram part of an HF model alone, in the V4.1 checkpoint format.

`save_engram` writes the modules (float tables and projections) as safetensors with a config.json
of DeepSeek-V4.1's `engram_*` keys (`engram.checkpoint.v41`), the tokenizer compression map and
the attachment options (into `engram/` when the folder is an HF model's: HF's files are never
touched); `export_fp8` writes the same with FP8 tables (values + ue8m0 scales), `export_quantised`
in another row format (INT8, 4-bit), which `MmapFP8Table` / `MmapQuantTable` and the `engram.systems`
tiers serve from host memory or SSD; `load_engram`
attaches either to a backbone. `check_part` is the one check of a part against a backbone (hidden
size, layers, vocabulary, compression map and tokenizer, attachment options) that `load_engram` and
the vLLM plugin (`engram.vllm.folder`) both run before anything is loaded.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.checkpoint.files import member_file, member_folder, member_path
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.json_file import read_json
from engram.checkpoint.tokenizer_fit import COMPRESSION_FILE
from engram.checkpoint.v41 import (
    BASE_MODEL_KEY,
    foreign_config,
    load_engram_modules,
    read_checkpoint_config,
    recorded_metadata,
    save_checkpoint,
)
from engram.config import EngramConfig
from engram.hf.adapter import is_peft_model, save_beside_adapter
from engram.hf.attach import (
    add_engram,
    boundary_config,
    engram_dtype,
    find_decoder_layers,
    get_attachment,
    model_hidden_size,
)
from engram.hf.base import base_record, check_model_base
from engram.rowformat.formats import RowFormat, as_row_format

__all__ = [
    "COMPRESSION_FILE",
    "OPTIONS_FILE",
    "PART_FOLDER",
    "TOKENIZER_FILE",
    "CheckedPart",
    "OlderFolderWarning",
    "ReadPart",
    "TokenizerNotCheckedWarning",
    "attach_part",
    "check_part",
    "config_sizes",
    "engram_part",
    "export_fp8",
    "export_quantised",
    "folder_model_type",
    "load_engram",
    "read_engram",
    "read_folder_engram",
    "read_options",
    "row_sharded_layer",
    "save_engram",
    "save_part",
    "warn_if_older_folder",
]

OPTIONS_FILE = "engram_hf.json"  # how the part was attached: boundaries, eos_token_id
PART_FOLDER = "engram"  # the part's folder inside an HF model folder (`save_pretrained`'s)
TOKENIZER_FILE = "tokenizer.json"  # an HF model folder's tokenizer, which the compression map must fit


class OlderFolderWarning(UserWarning):
    """An HF folder written before Engram models had their own model type: its config.json names the
    bare backbone, so `from_pretrained` alone loads it without Engram (`engram hf-upgrade` fixes that)."""


def folder_model_type(directory: str | os.PathLike[str]) -> str | None:
    """The `model_type` of an HF folder's config.json, read as JSON (no transformers); None when there is
    none or it cannot be read (the folder's readers refuse a damaged config.json themselves)."""
    path = Path(directory) / "config.json"
    if path_kind(path) != "a file":
        return None
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return model_type if isinstance(model_type, str) else None


def warn_if_older_folder(directory: str | os.PathLike[str]) -> None:
    """An OlderFolderWarning when `directory` is an HF model folder with an Engram part (`engram/`) whose
    config.json is not an Engram model's (model type `engram`)."""
    d = Path(directory)
    if path_kind(d / PART_FOLDER) != "a folder" or path_kind(d / "config.json") != "a file":
        return
    if folder_model_type(d) not in ("engram", None):
        warnings.warn(
            f"{d} was written before Engram models had their own model type: AutoModelForCausalLM."
            f"from_pretrained loads it without Engram; `engram hf-upgrade {d}` makes it load with Engram",
            OlderFolderWarning,
            stacklevel=3,
        )


class TokenizerNotCheckedWarning(UserWarning):
    """An Engram part was loaded with no tokenizer to check its compression map against: a map built
    for another tokenizer of the same size would hash every n-gram wrong, and nothing would say so."""


def engram_part(directory: str | os.PathLike[str]) -> Path:
    """The folder of the Engram part for `directory`: `directory` itself, or its `engram/` subfolder
    when it is an HF model folder (`model.save_pretrained(directory)`), so that the part sits beside
    HF's files without touching them."""
    d = Path(directory)
    return d / PART_FOLDER if foreign_config(d) else d


def row_sharded_layer(att: Any) -> int | None:
    """The first layer whose table holds fewer rows than its layout's (this process's shard of a
    row-sharded table: `engram.distributed`), or None."""
    for lid, m in att.layers.items():
        w = getattr(m.table, "weight", None)
        if isinstance(w, torch.Tensor) and w.shape[0] != m.table.num_rows:
            return int(lid)
    return None


def _save(
    model: nn.Module, directory: str | os.PathLike[str], fp8: bool, row_format: RowFormat | None = None
) -> Path:
    att = get_attachment(model)
    sharded = row_sharded_layer(att)
    if sharded is not None:
        lid, m = sharded, att.module(sharded)
        raise ValueError(
            f"layer {lid}'s table holds {m.table.weight.shape[0]} of its {m.table.num_rows} rows (row-sharded "
            "across processes): save it with engram.distributed.save_engram / export_fp8 / export_quantised, "
            "which every rank calls"
        )
    out = engram_part(directory)
    modules = {int(k): m for k, m in att.layers.items()}
    # the model it was trained on, under the seal with every tensor's CRC32 (engram.hf.base)
    save_checkpoint(
        out,
        att.config,
        modules,
        fp8=fp8,
        row_format=row_format,
        extra_metadata={BASE_MODEL_KEY: base_record(model)},
    )
    att.compression.save(out / COMPRESSION_FILE)
    options = {"boundaries": att.rows.boundaries, "eos_token_id": att.rows.eos_token_id}
    (out / OPTIONS_FILE).write_text(json.dumps(options, indent=2) + "\n")
    return out


def save_engram(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write the Engram part of a model (tables in their float dtype) to a folder.

    The part is safetensors with a config.json of DeepSeek-V4.1's `engram_*` keys, the tokenizer
    compression map and the attachment options. Into an HF model folder the part goes to
    `directory/engram/` (what `save_pretrained` of an Engram model writes there too): no file of
    HF's is touched. A peft model's Engram (trained beside its adapter) goes into the adapter's
    weight file in `directory` (after `peft_model.save_pretrained(directory)`), where
    `AutoPeftModelForCausalLM.from_pretrained(directory)` loads it.

    Args:
        model: A model with Engram attached, or a peft model around one.
        directory: The folder (the part's own, or an HF model folder).

    Returns:
        The part's folder; for a peft model, the adapter weight file's path.

    Raises:
        ValueError: The model has no Engram attached, or a table is row-sharded across processes
            (save it with `engram.distributed.save_engram`, which every rank calls).
    """
    if is_peft_model(model):
        return save_beside_adapter(model, directory)
    return _save(model, directory, fp8=False)


def export_fp8(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write the Engram part with its tables quantised to V4.1's FP8 (e4m3 values, one ue8m0 scale per 32).

    Readable by `MmapFP8Table` and `engram.systems.offload_engram`.

    Args:
        model: A model with Engram attached.
        directory: The folder (as `save_engram`: `directory/engram/` inside an HF model folder).

    Returns:
        The part's folder.

    Raises:
        ValueError: The model has no Engram attached, or a table is row-sharded across processes
            (use `engram.distributed.export_fp8`).
    """
    return _save(model, directory, fp8=True)


def export_quantised(model: nn.Module, directory: str | os.PathLike[str], fmt: RowFormat | str) -> Path:
    """`export_fp8` in another row format, readable by `MmapQuantTable`, the tiers and the vLLM plugin.

    Args:
        model: A model with Engram attached.
        directory: The folder (as `save_engram`: `directory/engram/` inside an HF model folder).
        fmt: A `engram.rowformat.formats.RowFormat` or its name: "fp8", "int8", "int8-row", "int4"
            (the bytes a row and the rounding rule are in docs/storage.md).

    Returns:
        The part's folder.

    Raises:
        ValueError: An unknown format (the message lists the formats), no Engram attached, or a
            row-sharded table (use `engram.distributed.export_quantised`).
    """
    return _save(model, directory, fp8=True, row_format=as_row_format(fmt))


def save_part(model: nn.Module, directory: str | os.PathLike[str], *, quantised: bool) -> Path:
    """The part of `model` into `directory` (its `engram/` inside an HF model folder): tables in float
    (`save_engram`), or with `quantised` each stored table in its own row format (a trainable one in FP8).
    What `save_pretrained` of an Engram model writes."""
    return _save(model, directory, fp8=quantised)


def read_options(part: str | os.PathLike[str]) -> dict[str, Any]:
    """The attachment options (`boundaries`, `eos_token_id`) an Engram part's folder records; {} for a
    part saved before there were any. Present but unreadable is refused, never skipped."""
    d = Path(part)
    if not os.path.lexists(d / OPTIONS_FILE):
        return {}
    try:  # a folder, a FIFO (never opened: that blocks), a link out of the part: refused
        path = member_file(d, OPTIONS_FILE, f"{d}: the Engram part's attachment options")
    except ValueError as e:
        raise ValueError(
            f"{e}. It records how the part was attached (boundaries, eos_token_id): restore the "
            "JSON file save_engram wrote, or save the part again"
        ) from None
    options = read_json(path)
    if not isinstance(options, dict):
        raise ValueError(
            f"{path}: expected a JSON object ({{'boundaries': ..., 'eos_token_id': ...}}), got "
            f"{type(options).__name__}; restore the file save_engram wrote, or save the part again"
        )
    return options


def part_folder(
    part: str | os.PathLike[str], missing: str, *, inside: str | os.PathLike[str] | None = None
) -> Path:
    """`part` (an Engram part's folder) as a Path; FileNotFoundError(`missing`) when nothing is there,
    ValueError naming what is there instead (a file, a FIFO: nothing is opened). `inside`: the model
    folder that holds it (`engram/`), which it must not leave by a symlink (`member_folder`'s rule)."""
    part = Path(part)
    kind = path_kind(part)
    if kind is None:
        raise FileNotFoundError(missing)
    if kind != "a folder":
        raise ValueError(
            f"{part} is {kind}, not the folder of an Engram part: remove it, then write the part with "
            f"engram.hf.save_engram(model, {str(part.parent)!r})"
        )
    if inside is not None:
        member_folder(inside, part.name, f"the model folder {inside} holds its Engram part")
    return part


@dataclass(frozen=True)
class CheckedPart:
    """An Engram part checked against a backbone (`check_part`): nothing of its tables read yet."""

    part: Path
    config: EngramConfig  # as attached: the attachment's restart rule applied ('eos' boundaries)
    compression: TokenizerCompression
    boundaries: str | None
    eos_token_id: int | None
    tokenizer: str | None  # what the compression map was checked against; None: it could not be


def _compression(part: Path) -> tuple[Path, TokenizerCompression]:
    try:  # a FIFO (never opened: that blocks), a folder, a link out of the part: refused
        path = member_file(part, COMPRESSION_FILE, f"{part}: the Engram part's tokenizer compression map")
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(
            f"{e}. It maps the tokenizer's ids to the ids the tables are hashed on: restore the file "
            "save_engram wrote, or save the part again"
        ) from None
    return path, TokenizerCompression.load(path)


def _check_tokenizer(
    part: Path,
    comp_path: Path,
    compression: TokenizerCompression,
    tokenizer: Any,
    tokenizer_file: Path | None,
) -> str | None:
    """What the map was checked against: `tokenizer`, else `tokenizer_file` when there is one; None
    (with a TokenizerNotCheckedWarning) when there is neither. One link rule for both: a tokenizer.json
    read from a folder (the model folder's, or `tokenizer` naming a folder) must not link out of it."""
    if isinstance(tokenizer, str | Path) and os.path.isdir(tokenizer):
        member_path(tokenizer, TOKENIZER_FILE, f"{tokenizer} holds the tokenizer")  # as the folder's own
    if tokenizer is None and tokenizer_file is not None:
        # a link out of the model folder is refused as every file a folder reader opens
        member_path(
            tokenizer_file.parent, tokenizer_file.name, f"{tokenizer_file.parent} holds the tokenizer"
        )
        kind = path_kind(tokenizer_file)
        if kind is not None and kind != "a file":  # a folder, a FIFO (opening one blocks): never opened
            raise ValueError(
                f"{tokenizer_file} is {kind}, not a tokenizer.json, so {comp_path} cannot be checked against "
                "the tokenizer: put the tokenizer's tokenizer.json there (the one the part was saved with)"
            )
        tokenizer = tokenizer_file if kind is not None else None
    if tokenizer is None:
        where = "no tokenizer given" + (f" and no {tokenizer_file}" if tokenizer_file is not None else "")
        warnings.warn(
            f"{part}: its compression map was not checked against a tokenizer ({where}): a part "
            "saved for another tokenizer of the same size would load and hash every n-gram wrong; pass the "
            "model's tokenizer (tokenizer=...) or put its tokenizer.json in the model folder",
            TokenizerNotCheckedWarning,
            stacklevel=4,  # the caller of load_engram / read_part
        )
        return None
    what = str(tokenizer) if isinstance(tokenizer, str | Path) else f"the given {type(tokenizer).__name__}"
    tok = resolve_tokenizer(tokenizer)  # a path that holds no readable tokenizer: its own clear error
    try:
        compression.check_tokenizer(tok)
    except ValueError as e:
        raise ValueError(
            f"{comp_path} does not fit the tokenizer {what}: {e}; use the part with the tokenizer it was "
            "saved with, or save the part again with this one"
        ) from None
    return what


def check_part(
    part: str | os.PathLike[str],
    *,
    backbone: str,
    hidden_size: int | None,
    num_layers: int,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    tokenizer_file: str | os.PathLike[str] | None = None,
) -> CheckedPart:
    """Check the Engram part in folder `part` against a backbone before anything is loaded: its config
    (one residual stream, `hidden_size` unless None, layer ids below `num_layers`, a vocabulary no
    larger than `vocab_size` unless None), its compression map (against `tokenizer` when given, else
    against `tokenizer_file` when there is one; with neither, a TokenizerNotCheckedWarning), and its
    attachment options. `backbone` names the backbone in the messages ("LlamaForCausalLM", "the
    backbone in <folder>"). Raises ValueError (FileNotFoundError for a missing file) naming the value
    and the fix; the one check `load_engram` and the vLLM plugin's `read_part` share."""
    part = Path(part)
    config = read_checkpoint_config(part)
    if config.hc_mult != 1:
        raise ValueError(
            f"{part} holds Engram with hc_mult={config.hc_mult}, but {backbone} has one residual stream (1): "
            "use a part saved from an HF model (engram.hf.save_engram)"
        )
    if hidden_size is not None and hidden_size != config.hidden_size:
        raise ValueError(
            f"{part} holds Engram for hidden size {config.hidden_size}, but {backbone} has hidden size "
            f"{hidden_size}: use the part with the backbone it was trained with"
        )
    if max(config.layer_ids) >= num_layers:
        raise ValueError(
            f"{part} holds Engram for layers {list(config.layer_ids)}, but {backbone} has {num_layers} "
            f"decoder layers (ids 0..{num_layers - 1}): use the part with the backbone it was trained with"
        )
    if vocab_size is not None and config.vocab_size > vocab_size:
        raise ValueError(
            f"{part} hashes ids of a vocabulary of {config.vocab_size}, but {backbone} has {vocab_size} token "
            "ids: the part was built for another tokenizer; save the part of this model again"
        )
    comp_path, compression = _compression(part)
    tok_file = Path(tokenizer_file) if tokenizer_file is not None else None
    checked = _check_tokenizer(part, comp_path, compression, tokenizer, tok_file)
    options = read_options(part)
    boundaries, eos = options.get("boundaries"), options.get("eos_token_id")
    try:  # as add_engram attaches it: 'eos' becomes the hasher's restart rule
        attached = boundary_config(config, boundaries, eos)
    except ValueError as e:
        raise ValueError(f"{part / OPTIONS_FILE}: {e}; restore the file save_engram wrote") from None
    return CheckedPart(part, attached, compression, boundaries, eos, checked)


def _vocab_size(model: nn.Module) -> int | None:
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else None


@dataclass(frozen=True)
class ReadPart:
    """An Engram part checked against a backbone's sizes and read (`read_engram`): its modules, ready
    to attach (`attach_part`), and the base model it records (None: a part that records none)."""

    checked: CheckedPart
    modules: dict[int, Any]  # layer id -> engram.model.module.Engram
    base: str | None


def read_engram(
    directory: str | os.PathLike[str],
    *,
    backbone: str,
    hidden_size: int | None,
    num_layers: int,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    mmap: bool = True,
    dtype: torch.dtype | None = torch.float32,
    verify: bool = False,
) -> ReadPart:
    """Check and read the Engram part in `directory` (as `load_engram` does, see there) for a backbone
    of these sizes, before the backbone itself is loaded: a refused part costs no model load.
    `backbone` names it in the messages; `attach_part` attaches the result."""
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        raise TypeError(
            f"dtype={dtype!r}: give torch.float32, torch.bfloat16, torch.float64 or torch.float16"
        )
    directory = Path(directory)
    kind = path_kind(directory)
    if kind is None:
        raise FileNotFoundError(f"{directory}: no such directory (write one with engram.hf.save_engram)")
    if kind != "a folder":
        raise ValueError(f"{directory} is {kind}, not a folder: give the folder save_engram wrote")
    part = engram_part(directory)
    d = part_folder(
        part,
        f"{directory} is an HF model folder without an Engram part ({directory / PART_FOLDER} is missing): "
        f"save it with engram.hf.save_engram(model, {str(directory)!r})",
        inside=directory if part != directory else None,
    )
    checked = check_part(
        d,
        backbone=backbone,
        hidden_size=hidden_size,
        num_layers=num_layers,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        tokenizer_file=directory / TOKENIZER_FILE,
    )
    base = recorded_metadata(d, BASE_MODEL_KEY)
    _, modules = load_engram_modules(d, mmap=mmap, dtype=dtype, verify=verify)
    return ReadPart(checked, modules, base)


def config_sizes(config: Any) -> tuple[int, int, int | None]:
    """(decoder layers, hidden size, vocabulary size or None) of an HF config (a multimodal one's text
    config); ValueError when the first two cannot be read."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = next(
        (getattr(text, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(text, k)), None
    )
    hidden = next((getattr(text, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(text, k)), None)
    if not isinstance(depth, int) or not isinstance(hidden, int):
        raise ValueError(
            f"cannot read the depth and width of {type(config).__name__}: not a decoder-only LM?"
        )
    vocab = getattr(text, "vocab_size", None)
    return depth, hidden, vocab if isinstance(vocab, int) else None


def read_folder_engram(
    folder: str | os.PathLike[str],
    config: Any,
    *,
    tokenizer: Any = None,
    verify: bool = False,
    mmap: bool = True,
) -> ReadPart:
    """`read_engram` of an HF model folder's part against the backbone its `config` (the folder's,
    read) describes: checked before the backbone is loaded. `mmap=False`: quantised tables read into
    memory (where rows are written: memory patches)."""
    depth, hidden, vocab = config_sizes(config)
    return read_engram(
        folder,
        backbone=f"the model in {folder}",
        hidden_size=hidden,
        num_layers=depth,
        vocab_size=vocab,
        tokenizer=tokenizer,
        verify=verify,
        mmap=mmap,
    )


def attach_part(model: nn.Module, read: ReadPart, *, decoder_layers: Any = None) -> nn.Module:
    """Attach a part `read_engram` read to `model` (its modules moved to the device of the layers they
    join); a part recorded for another base model than `model` warns (`BaseModelWarning`)."""
    check_model_base(read.base, model, str(read.checked.part))  # another base: a warning
    decoder = find_decoder_layers(model, decoder_layers)
    for lid, m in read.modules.items():
        lp = next(iter(decoder[lid].parameters()), None)
        if lp is not None and lp.device.type != "cpu":
            m.to(lp.device)
    checked = read.checked
    return add_engram(
        model,
        checked.config,
        compression=checked.compression,
        modules=read.modules,
        decoder_layers=decoder_layers,
        boundaries=checked.boundaries,
        eos_token_id=checked.eos_token_id,
    )


def load_engram(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    mmap: bool = True,
    decoder_layers: Any = None,
    dtype: torch.dtype | None = None,
    verify: bool = False,
) -> nn.Module:
    """Attach the Engram part saved in a folder to a backbone without Engram.

    `check_part` runs first: a part saved for another hidden size, for more layers or a larger
    vocabulary than the model has, or with a compression map built for another tokenizer is refused
    with nothing attached. FP8 tables load memory-mapped or into memory; float tables load trainable.

    Every tensor's bytes are checked against the CRC32 the part recorded when it was written (a byte
    damaged since is refused, naming the file and tensor): the projections always, tables up to
    `engram.storage.integrity.SCAN_LIMIT_BYTES` (256 MiB) at load, larger ones with `verify=True`.
    A part recorded for another base model than `model` (its config's sizes, a sample of its weights:
    `engram.hf.base`) loads with a `BaseModelWarning`. The two steps are `read_engram` (before a
    backbone is loaded) and `attach_part`. Through `engram.hf.load_engram`, a model with Engram
    attached already is refused, a transformers model becomes an instance of its Engram family class,
    and a folder written before Engram models had their own model type gives an `OlderFolderWarning`.

    Args:
        model: A backbone without Engram.
        directory: The part's folder, or an HF model folder whose `engram/` holds it (what
            `save_pretrained` then `save_engram` into one folder give).
        tokenizer: What the compression map is checked against; default `directory/tokenizer.json`
            when there is one; with neither a `TokenizerNotCheckedWarning` says the map was not
            checked.
        mmap: FP8 / quantised tables are memory-mapped (True) or read into memory.
        decoder_layers: Where the decoder layers are (see `find_decoder_layers`).
        dtype: The modules' dtype (default: the model's, float32 / bfloat16 / float64; float32 for
            another), so a float64 model computes Engram in float64.
        verify: Also check tables larger than the scan limit (read a block at a time through the
            file's mapping, so a table larger than memory is checked too; else an
            `UnscannedTableWarning` says it was not).

    Returns:
        The same model object, with the part attached.

    Raises:
        FileNotFoundError: `directory`, or a file of the part, does not exist.
        TypeError: `dtype` is not a float dtype a module takes.
        ValueError: The part does not fit the model or its tokenizer, or a file is damaged; the
            message names the value and the fix.
    """
    read = read_engram(
        directory,
        backbone=type(model).__name__,
        hidden_size=model_hidden_size(model),
        num_layers=len(find_decoder_layers(model, decoder_layers)),
        vocab_size=_vocab_size(model),
        tokenizer=tokenizer,
        mmap=mmap,
        dtype=engram_dtype(model) if dtype is None else dtype,
        verify=verify,
    )
    return attach_part(model, read, decoder_layers=decoder_layers)
