"""Engram models in lm-evaluation-harness: `EngramLM`, the model lm-eval runs for `--model engram`.

`EngramLM` is lm-eval's `HFLM` loading through transformers' Auto classes with the `engram` model type
registered (`engram.hf.auto`), so a folder written by `save_pretrained` evaluates with Engram without
`trust_remote_code`; a folder or model with no Engram is refused (it is `--model hf`'s). lm-eval finds
it by the `lm_eval.models` entry point in pyproject.toml, which lm-eval releases after 0.4.13 read
(upstream commit 4afe98dbc); 0.4.13 reads none, so `register()` puts the same name into its registry
(`engram-lm-eval`, engram.cli.harness, calls it before lm-eval's command line).
Nothing else in engram imports this module: lm-eval (the `eval` extra) is needed only here.
"""

from __future__ import annotations

from typing import Any

from lm_eval.models.huggingface import HFLM
from torch import nn

from engram.hf import auto
from engram.hf.attach import get_attachment

__all__ = ["MODEL_NAME", "TARGET", "EngramLM", "register"]

MODEL_NAME = "engram"  # lm-eval's --model name
TARGET = "engram.hf.harness:EngramLM"  # the entry point's value (pyproject.toml), "module:attribute"


class EngramLM(HFLM):
    """lm-eval's HF model for Engram models: `pretrained` is a folder (or Hub id) holding an Engram
    model, or an Engram model object (`engram.hf.add_engram`'s); every other argument is `HFLM`'s."""

    def __init__(self, pretrained: str | nn.Module, **kwargs: Any) -> None:
        auto.register()  # `import engram` did it when transformers came in; idempotent, and this class needs it
        if not isinstance(pretrained, str):
            _require_attached(pretrained)
        super().__init__(pretrained, **kwargs)

    def _get_config(self, pretrained: str, **kwargs: Any) -> None:
        # Checked on the config, before HFLM loads the weights: a plain model is refused at once.
        super()._get_config(pretrained, **kwargs)
        kind = getattr(self._config, "model_type", None)
        if kind != auto.MODEL_TYPE:
            raise ValueError(
                f"{pretrained} holds a {kind!r} model with no Engram (its config's model_type is not "
                f"{auto.MODEL_TYPE!r}): evaluate it with `--model hf`, or attach Engram "
                "(engram.hf.add_engram) and save the model there with save_pretrained"
            )


def _require_attached(model: nn.Module) -> None:
    try:
        get_attachment(model)
    except ValueError:
        raise ValueError(
            f"{type(model).__name__} has no Engram attached: evaluate a plain model with lm-eval's "
            "`hf` model (HFLM), or attach Engram first (engram.hf.add_engram)"
        ) from None


def register() -> None:
    """Register `engram` (lazily: this module's EngramLM) in lm-eval's model registry, unless a name
    `engram` is there already (an lm-eval that read our entry point). lm-eval 0.4.13 reads no entry
    points, so `simple_evaluate(model="engram", ...)` and its command line (engram-lm-eval) call this first."""
    from lm_eval.api.registry import model_registry  # holds the built-in names: HFLM's import filled it

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)
