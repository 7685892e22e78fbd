"""`engram convert` of a whole Engram model's folder (`save_pretrained`'s, `hf-train`'s): HF's files copied
as they are, the part in `engram/` rewritten in another row format by `engram.checkpoint.convert`, so
the result is again a folder `from_pretrained`, hf-eval and the vLLM plugin load (an FP8 copy of a
trained model, say). Knows the folder's layout, nothing of models.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from engram.checkpoint.convert import convert_table
from engram.checkpoint.files import member_file
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.v41.format import INDEX_FILE, foreign_config, is_row_file_name, is_shard_name

__all__ = ["PART", "convert_model_folder", "is_model_folder"]

PART = "engram"  # engram.hf.io.PART_FOLDER: where a model folder keeps its part


def _table_file(name: str) -> bool:
    """A file of the tables that the conversion writes anew (shards, their index, row files)."""
    return is_shard_name(name) or name == INDEX_FILE or is_row_file_name(name)


def is_model_folder(src: str | os.PathLike[str]) -> bool:
    """Whether `src` is an HF model's folder with its Engram part in `engram/` (not a part itself)."""
    d = Path(src)
    # the part first: a checkpoint's own config.json is read (and refused, when damaged) by its reader
    return (
        path_kind(d / PART) == "a folder" and path_kind(d / "config.json") == "a file" and foreign_config(d)
    )


def convert_model_folder(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], **convert: Any
) -> list[Path]:
    """Copy the top-level files of model folder `src` into `dst` (created: absent or empty), then convert
    `src/engram` into `dst/engram` (`convert_table`'s keyword arguments). Returns the part's files written.
    A folder of HF's other than `engram/` is refused, as is a file linked from outside `src`; on a failure
    `dst` is removed again."""
    s, d = Path(src), Path(dst)
    others = [p.name for p in s.iterdir() if p.name != PART and p.is_dir()]
    if others:
        raise ValueError(
            f"{s} holds folders besides its Engram part ({', '.join(sorted(others))}): convert the part alone "
            f"(engram convert {s / PART} DST) and copy the rest yourself"
        )
    files = [
        member_file(s, p.name, f"the model folder {s} holds") for p in sorted(s.iterdir()) if p.name != PART
    ]
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    try:
        written = convert_table(s / PART, d / PART, **convert)
        for p in sorted((s / PART).iterdir()):  # the part's own files: the compression map, the options
            if not (d / PART / p.name).exists() and not _table_file(p.name):
                shutil.copy2(
                    member_file(s / PART, p.name, f"the Engram part {s / PART} holds"), d / PART / p.name
                )
        for f in files:
            shutil.copy2(f, d / f.name)
    except BaseException:
        if created:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return written
