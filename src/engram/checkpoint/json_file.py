"""Reading the JSON files beside the tensors (config.json, state.json, an index, a training config).

`read_json(path)` parses one file and refuses what `json.loads` would turn into a traceback: a folder,
bytes that are not UTF-8, invalid JSON, or nesting too deep for Python's parser (a damaged or hostile
file). Every refusal is a ValueError or FileNotFoundError naming the file. It knows no schema.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_json"]


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in file `path`; ValueError (FileNotFoundError when missing) naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a JSON file")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {e.start}): not a JSON file; give the right file"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged or not JSON") from None
    except RecursionError:
        raise ValueError(
            f"{path}: JSON nested too deeply to read; the file is damaged or not the one expected"
        ) from None
