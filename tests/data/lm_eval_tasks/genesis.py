"""The local data of the engram_genesis_* tasks (tests/test_hf_lm_eval.py): genesis.jsonl beside this file,
read without the datasets hub (the tasks' `custom_dataset`), so a run reaches no network."""

from __future__ import annotations

import json
from pathlib import Path

import datasets


def load(**_metadata: object) -> datasets.DatasetDict:
    """The six records of genesis.jsonl as the `test` split (lm-eval passes the task's metadata; unused)."""
    lines = (Path(__file__).parent / "genesis.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
