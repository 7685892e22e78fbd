"""`engram hf-upgrade`: a folder written before Engram models had their own model type (a plain HF
config.json beside the `engram/` part, which `from_pretrained` loads as the bare backbone) becomes an
Engram model's folder, as `save_pretrained` writes one today (`engram.hf.auto`).

Only what names the model changes: config.json gains the `engram` model type, the base's type and
architecture, the part's settings and `auto_map` (written to a temporary file, then renamed), and
`modeling_engram.py` is added. The part itself is not rewritten (its seal and CRCs stay as they are);
it is checked first, as `from_pretrained` will check it. Weight files that hold a second copy of the
tables (`engram.*` tensors, from `save_pretrained` of a model with Engram before the upgrade) are
rewritten without them, each through a temporary file and a rename, the index updated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engram.apps.hf.folder import check_folder, load_tokenizer
from engram.checkpoint.files import member_file, open_tensors
from engram.checkpoint.folder_lock import write_lock
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.json_file import read_json
from engram.checkpoint.temporaries import clear_dead_temporaries, removed_on_failure, temporary_path
from engram.hf.base import INDEX_FILE, weight_files

__all__ = ["upgrade_folder"]


def _write(path: Path, text: str) -> None:
    tmp = temporary_path(path)
    with removed_on_failure(tmp):
        tmp.write_text(text)
        os.replace(tmp, path)


def _drop_table_copies(folder: Path) -> list[str]:
    """Rewrite the weight files that hold `engram.*` tensors without them; the names of those files."""
    from safetensors.torch import save_file

    changed = []
    for path in weight_files(folder):
        f = open_tensors(path)
        names = list(f)
        if not any(n.startswith("engram.") for n in names):
            continue
        keep = {n: f.tensor(n).contiguous() for n in names if not n.startswith("engram.")}
        tmp = temporary_path(path)
        with removed_on_failure(tmp):
            save_file(keep, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, path)
        changed.append(path.name)
    if changed and os.path.lexists(folder / INDEX_FILE):
        index_path = member_file(folder, INDEX_FILE, "the model folder's")
        index = read_json(index_path)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("engram.")}
        _write(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return changed


def upgrade_folder(folder: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """Make `folder` an Engram model's folder (see the module docstring). Returns what was done:
    {"folder", "upgraded": False when it was one already, "architecture", "weight_files_rewritten"}.
    Raises ValueError naming the file and the fix for a folder without a part, or whose part does not
    fit its backbone or tokenizer (nothing is changed then)."""
    d = Path(folder)
    config = check_folder(d)  # first: a missing folder is refused before its lock file is made
    with write_lock(d, f"engram hf-upgrade {d}"):  # one writer a folder
        return _upgrade(d, config, verify)


def _upgrade(d: Path, config: Any, verify: bool) -> dict[str, Any]:
    """upgrade_folder's work, the folder's write lock held."""
    from engram.hf.auto import AUTO_MAP, MODEL_TYPE, REMOTE_CODE, REMOTE_CODE_FILE, engram_settings
    from engram.hf.io import PART_FOLDER, read_folder_engram

    clear_dead_temporaries(d)  # what an upgrade killed mid-write left
    if getattr(config, "model_type", None) == MODEL_TYPE:
        return {"folder": str(d), "upgraded": False, "architecture": config.architectures[0]}
    if path_kind(d / PART_FOLDER) != "a folder":
        raise ValueError(
            f"{d} has no Engram part ({d / PART_FOLDER}): there is nothing to upgrade; attach and save one with "
            "engram.hf.add_engram, then model.save_pretrained"
        )
    raw = read_json(member_file(d, "config.json", "the model folder's"))
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(
            f"{d / 'config.json'} names no architecture ('architectures'): restore the config.json the model "
            "was saved with"
        )
    # the part against the backbone and tokenizer, every CRC: nothing changed on refusal
    read = read_folder_engram(d, config, tokenizer=load_tokenizer(str(d)), verify=verify)
    rewritten = _drop_table_copies(d)
    raw.update(
        {
            "model_type": MODEL_TYPE,
            "architectures": [f"Engram{archs[0]}"],
            "base_model_type": raw["model_type"],
            "base_architectures": [archs[0]],
            "engram": engram_settings(
                read.checked.config, read.checked.boundaries, read.checked.eos_token_id
            ),
            "auto_map": dict(AUTO_MAP),
        }
    )
    (d / REMOTE_CODE_FILE).write_text(REMOTE_CODE)
    _write(d / "config.json", json.dumps(raw, indent=2, sort_keys=True) + "\n")  # last: the switch
    return {
        "folder": str(d),
        "upgraded": True,
        "architecture": raw["architectures"][0],
        "weight_files_rewritten": rewritten,
    }
