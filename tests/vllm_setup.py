"""Folders for the vLLM plugin's tests and benchmark: a small random HF decoder (Llama, Mistral, Qwen2 or
Qwen3) with Engram attached by `engram.hf`, saved as a user saves one (`save_pretrained`, then
`save_engram` or `export_fp8` into the same folder), and the HF reference read back from the folder
(`from_pretrained` + `load_engram`), whose `generate()` the served tokens must equal."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from engram.addressing.compression import TokenizerCompression
from engram.config import EngramConfig

VOCAB = 1000
HIDDEN = 256  # vLLM's CPU attention takes head sizes 32, 64, 80, ...: 4 heads of 64


def engram_config(layer_ids: tuple[int, ...] = (1,)) -> EngramConfig:
    return EngramConfig(
        name="vllm-test",
        layer_ids=layer_ids,
        max_ngram_size=3,
        n_heads=2,
        engram_vocab_size=(257, 263),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=HIDDEN,
        hc_mult=1,
    )


def backbone(family: str, layers: int = 2, hidden: int = HIDDEN) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=64, **common))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(head_dim=64, sliding_window=None, **common))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=64, **common))
    if family == "gpt2":  # an architecture the plugin does not cover
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=hidden // 64, n_positions=1024
        )
        return tf.GPT2LMHeadModel(cfg)
    raise ValueError(f"unknown family {family!r}")


def build_folder(
    folder: str | os.PathLike[str],
    family: str = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    engram_layers: tuple[int, ...] = (1,),
    fp8: bool = False,
    row_files: bool = False,
    boost: float = 20.0,
    engram: bool = True,
) -> Path:
    """Write the folder: HF's files, then the Engram part (float, or FP8 with `fp8`, plus SSD row files
    with `row_files`). `boost` scales Engram's output projection so that it changes greedy tokens (the
    test then shows the served model used it)."""
    from engram.hf import add_engram, export_fp8, save_engram

    torch.manual_seed(seed)
    model = backbone(family, layers).eval()
    if engram:
        add_engram(
            model,
            engram_config(engram_layers),
            compression=TokenizerCompression.identity(VOCAB),
            zero_init=False,
        )
        with torch.no_grad():
            for m in model.engram.layers.values():
                m.wkv.weight.mul_(boost)
    folder = Path(folder)
    model.save_pretrained(folder)
    if engram:
        part = export_fp8(model, folder) if fp8 else save_engram(model, folder)
        if row_files:
            from engram.checkpoint.convert import write_row_files

            write_row_files(part)
    return folder


def reference(folder: str | os.PathLike[str], engram: bool = True) -> Any:
    """The HF model as engram.hf serves the folder: the backbone from its files, the part attached."""
    from transformers import AutoModelForCausalLM

    from engram.hf import load_engram, remove_engram

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if hasattr(model, "engram"):  # an Engram model's folder: from_pretrained attached its part
        if not engram:
            remove_engram(model)  # the backbone alone
        return model
    return load_engram(model, folder) if engram else model  # an older folder: the part attached here


def greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out


def set_config(folder: str | os.PathLike[str], **changes: Any) -> None:
    """Edit the folder's HF config.json (tests of refusals)."""
    path = Path(folder) / "config.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d, indent=2))
