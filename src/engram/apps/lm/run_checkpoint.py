"""A training run's checkpoint folders (`<out>/checkpoints/step-NNNNNNN/`): finding them
(`latest_checkpoint`, `checkpoint_dirs`, `remove_stale_tmp`), reading and checking what they hold
(`read_state`: state.json, its training and model configs and step; `checkpoint_tokenizer`;
`check_layout` against `layout_metadata`, the Engram layout fingerprint the table files record), and
loading a trained model (`load_trained_model`). `engram eval`, `generate` and `train --resume` all go
through here; writing checkpoints is the Trainer's (engram.apps.lm.train). Design: docs/training.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from engram.addressing.compression import resolve_tokenizer
from engram.addressing.layout import Layout, layout_fingerprint
from engram.apps.lm.train_config import TrainConfig
from engram.checkpoint.files import member_file
from engram.checkpoint.json_file import read_json
from engram.checkpoint.optim_state import OptimizerStateError
from engram.checkpoint.shard_format import SHARDS_FOLDER
from engram.checkpoint.shards import OPTIMIZER_FILE, is_table_key, read_checkpoint, shards_of_state
from engram.checkpoint.temporaries import pid_alive
from engram.checkpoint.v41 import LAYOUT_FINGERPRINT_KEY
from engram.model.lm import EngramLM, LMConfig

__all__ = [
    "DAMAGE",
    "check_layout",
    "check_run_tokenizer",
    "checkpoint_dirs",
    "checkpoint_tokenizer",
    "config_diffs",
    "latest_checkpoint",
    "layout_metadata",
    "load_trained_model",
    "optimizer_state_of",
    "read_state",
    "remove_stale_tmp",
    "weights_of",
]

# What reading a damaged checkpoint raises (RuntimeError: load_state_dict's missing or misshaped tensors).
DAMAGE = (ValueError, TypeError, KeyError, OSError, RuntimeError)


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """The checkpoint folders of `out_dir`, oldest first (`out_dir` itself if it is one)."""
    if os.path.lexists(out_dir / "state.json"):
        return [out_dir]
    return sorted(p for p in (out_dir / "checkpoints").glob("step-*") if p.is_dir())


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `out_dir` (or `out_dir` itself if it is one)."""
    found = checkpoint_dirs(Path(out_dir))
    return found[-1] if found else None


_TMP_RE = re.compile(r"^\.tmp-step-\d+-(\d+|sharded)$")


def remove_stale_tmp(out_dir: str | Path) -> list[tuple[Path, str]]:
    """Remove the temporary folders interrupted checkpoint writes left in `out_dir`/checkpoints:
    `.tmp-step-NNNNNNN-<pid>` whose process is gone, and a distributed run's `.tmp-step-NNNNNNN-sharded`
    (call it at the start of a run, before any checkpoint is written). Returns [(folder, why)]."""
    root = Path(out_dir) / "checkpoints"
    removed: list[tuple[Path, str]] = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        m = _TMP_RE.match(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        tag = m.group(1)
        if tag == "sharded":
            why = "left by an interrupted write of a distributed run"
        elif pid_alive(int(tag)):
            continue  # that process may still be writing it
        else:
            why = f"left by process {tag}, which is gone (a checkpoint write interrupted)"
        shutil.rmtree(p, ignore_errors=True)
        removed.append((p, why))
    return removed


_STATE_KEYS = ("step", "train_config", "lm_config", "optimizer_groups", "history")


@contextlib.contextmanager
def weights_of(ckpt: Path) -> Iterator[None]:
    """torch's refusal of a checkpoint's tensors (wrong shapes, missing or extra names) as one ValueError
    naming the checkpoint."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith("Error(s) in loading state_dict"):
            raise
        first = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()), str(e))
        raise ValueError(
            f"{ckpt / 'model.safetensors'} does not fit the model its state.json describes ({first}); "
            "the checkpoint is damaged: use another one or retrain"
        ) from None


def config_diffs(theirs: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
    """`key=value (this run: value)` for each entry of two config dicts that differs (nested dicts by
    their entries, as `engram.layer_ids=...`)."""
    out = []
    for k in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(k), ours.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diffs(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}={a!r} (this run: {b!r})")
    return out


@contextlib.contextmanager
def optimizer_state_of(ckpt: Path, state: dict[str, Any]) -> Iterator[None]:
    """A stored optimizer tensor that does not fit its parameter, as one ValueError naming its file."""
    try:
        yield
    except OptimizerStateError as e:
        if e.tensor is None:
            file = ckpt / "state.json"  # the param groups
        elif shards_of_state(state) is not None and is_table_key(e.tensor):
            file = ckpt / SHARDS_FOLDER / "rank-*.safetensors"
        else:
            file = ckpt / OPTIMIZER_FILE
        raise ValueError(f"{file}: {e}") from None


def checkpoint_tokenizer(ckpt: str | os.PathLike[str], vocab_size: int) -> Tokenizer | None:
    """The tokenizer a checkpoint folder saved (None: it holds no tokenizer.json), checked: a regular
    file inside the folder (never a FIFO or a link out) that tokenizers reads, with the `vocab_size`
    ids of the model; ValueError naming the file otherwise."""
    file = Path(ckpt) / "tokenizer.json"
    if not os.path.lexists(file):
        return None
    path = member_file(ckpt, file.name, f"the checkpoint {ckpt} holds")  # a regular file, inside
    tok = resolve_tokenizer(path)  # a damaged file: ValueError naming it
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != vocab_size:
        raise ValueError(
            f"{file}: the tokenizer has {vocab} ids but the model {vocab_size}; the checkpoint's "
            "tokenizer.json is not the run's: restore it from the run, or delete it to rebuild the run's"
        )
    return tok


def read_state(ckpt: Path) -> tuple[dict[str, Any], TrainConfig, LMConfig]:
    """(state.json, its training config, its model config) of checkpoint folder `ckpt`, checked: the
    entries a training state has, a training config of this version, a step that is an int from 0 to
    that config's total steps, and an lm_config that makes a model. `engram eval`, `generate` and
    `train --resume` all read checkpoints through it; a damaged state.json is refused (ValueError),
    naming the file."""
    file = member_file(ckpt, "state.json", "the checkpoint's")  # a regular file inside the folder
    state = read_json(file)
    bad = _first_non_finite(state)  # JSON has no NaN or Infinity, and engram writes none
    if bad is not None:
        where, value = bad
        raise ValueError(
            f"{file}: {where} is {value} (not a finite number; engram never writes one): the checkpoint is "
            "damaged: use another one or retrain"
        )
    missing = [k for k in _STATE_KEYS if k not in state] if isinstance(state, dict) else list(_STATE_KEYS)
    if missing:
        raise ValueError(
            f"{file}: no {', '.join(map(repr, missing))} entry: not a complete training state (damaged?); "
            "resume from another checkpoint or retrain"
        )
    try:
        cfg = TrainConfig.from_dict(state["train_config"])
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{file}: {e}. This checkpoint was written by another version of engram and is not read: "
            "retrain the model"
        ) from None
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= cfg.steps:
        raise ValueError(
            f"{file}: step {step!r} is not a whole number from 0 to the run's total steps "
            f"(train_config.steps={cfg.steps}); the checkpoint is damaged: use another one or retrain"
        )
    try:
        lm_cfg = LMConfig.from_dict(state["lm_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{file}: its lm_config does not make a model ({type(e).__name__}: {e}); the checkpoint "
            "is damaged: use another one or retrain"
        ) from None
    check_layout(ckpt, lm_cfg)
    return state, cfg, lm_cfg


def _first_non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """(where, value) of the first NaN or infinite number in a JSON value (`history[2].train_loss`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "the value", value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _first_non_finite(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}".lstrip("."))
        if found is not None:
            return found
    return None


def check_run_tokenizer(ckpt: Path, saved: Tokenizer | None, tokenizer: Tokenizer, source: str) -> None:
    """Refuse a checkpoint whose tokenizer.json (`saved`: `checkpoint_tokenizer`'s, which refuses a
    damaged one) is not `tokenizer`, the one the run's training config rebuilds (`source`: that config's
    tokenizer); ValueError naming the file. `train --resume` and `engram eval` score with the rebuilt one."""
    if saved is not None and saved.to_str() != tokenizer.to_str():
        raise ValueError(
            f"{ckpt / 'tokenizer.json'}: not the tokenizer of this run (its training config's {source!r} "
            "rebuilds another); the checkpoint is damaged: use another checkpoint"
        )


def layout_metadata(lm_cfg: LMConfig) -> dict[str, str]:
    """The safetensors metadata of a training checkpoint's file of tables: the Engram layout's
    fingerprint (none for the baseline), so tables are never read under another layout."""
    if lm_cfg.engram is None:
        return {}
    return {LAYOUT_FINGERPRINT_KEY: layout_fingerprint(Layout(lm_cfg.engram))}


def check_layout(ckpt: Path, lm_cfg: LMConfig) -> None:
    """Refuse a checkpoint whose table files record another layout fingerprint than its lm_config's
    Engram (an edited seed or table size in state.json would look every row up elsewhere). Files of
    checkpoints written before fingerprints were recorded carry none: nothing to compare."""
    want = layout_metadata(lm_cfg).get(LAYOUT_FINGERPRINT_KEY)
    if want is None:
        return
    for path in [ckpt / "model.safetensors", *sorted((ckpt / SHARDS_FOLDER).glob("rank-*.safetensors"))]:
        if not path.is_file():
            continue  # a missing or odd file is reported where the tensors are read
        try:
            with safe_open(str(path), "pt") as f:
                got = (f.metadata() or {}).get(LAYOUT_FINGERPRINT_KEY)
        except Exception:  # safetensors' own errors: reported where the tensors are read
            continue
        if got is not None and got != want:
            raise ValueError(
                f"{path}: its tables were saved for the Engram layout with fingerprint {got}, but the "
                f"checkpoint's lm_config (state.json) has layout fingerprint {want}: its primes, multipliers "
                "(seed), compressed vocabulary or pad id were edited, so every row would be read for other "
                "n-grams; the checkpoint is damaged: use another one or retrain"
            )


def load_trained_model(
    path: str | Path, *, verify: bool = False, device: torch.device | None = None
) -> tuple[TrainConfig, EngramLM, dict[str, Any]]:
    """(train config, model with its weights, state.json) of a checkpoint folder or a run folder (its
    newest checkpoint), on `device` (default the CPU), wherever it was trained: the files hold host
    tensors. The checkpoint is checked (`read_checkpoint`: dtypes, NaN / Inf; `verify` scans tables of
    any size)."""
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {path} (expected state.json or checkpoints/step-*)")
    state, cfg, lm_cfg = read_state(ckpt)
    model = EngramLM(lm_cfg)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    tensors = read_checkpoint(ckpt, state, optimizer=False, dtypes=dtypes, verify=verify)[0]  # tables whole
    with weights_of(ckpt):  # missing, unexpected or misshaped tensors: one ValueError naming the file
        model.load_state_dict(tensors)
    if device is not None:
        model.to(device)
    state["path"] = str(ckpt)
    return cfg, model, state
