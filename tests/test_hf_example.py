"""examples/hf_llama.py runs end to end in its --quick mode (Trainer, held-out losses, generate())."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the HF Trainer needs it

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"


@pytest.mark.slow
def test_hf_llama_example_quick():
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--quick"])
    assert math.isfinite(out["plain"]) and math.isfinite(out["engram"])
    assert out["generated_tokens"] == 8
