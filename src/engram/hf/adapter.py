"""Engram beside a peft adapter: Engram trained with a LoRA (`build_optimizer(peft_model)`) is saved into
the adapter's own weight file, under the names a PeftModel gives it (as peft stores `modules_to_save`),
so the tools that load an adapter load it too: `PeftModel.from_pretrained` / `AutoPeftModelForCausalLM`
through peft's state dict, transformers' own adapter loading through `engram.hf.auto`
(`load_beside_adapter`). Knows peft's file and key names, not peft itself (nothing is imported).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from engram.checkpoint.input_files import path_kind
from engram.checkpoint.temporaries import removed_on_failure, temporary_path
from engram.hf.attach import get_attachment

__all__ = ["ADAPTER_FILE", "ADAPTER_PREFIX", "is_peft_model", "load_beside_adapter", "save_beside_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"  # peft's adapter weights (PeftModel.save_pretrained)
ADAPTER_PREFIX = "base_model.model."  # where a PeftModel keeps the model it wraps, in its state dict


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a peft model (a PeftModel's attributes: no import of peft)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def save_beside_adapter(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Add the Engram tensors of peft model `model` to the adapter's weight file in `directory` (saved
    first by `model.save_pretrained(directory)`), replacing those a previous save put there; the file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(directory) / ADAPTER_FILE
    if path_kind(path) != "a file":
        raise FileNotFoundError(
            f"{path} is missing: save the adapter first (peft_model.save_pretrained({str(directory)!r})), "
            "then save_engram(peft_model, the same folder) adds Engram's tensors to it"
        )
    att = get_attachment(model)
    prefix = next(n for n, m in model.named_modules() if m is att) + "."
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(prefix)}  # noqa: SIM118
    tensors.update({prefix + k: v.detach().contiguous() for k, v in att.state_dict().items()})
    tmp = temporary_path(path)
    with removed_on_failure(tmp):
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    return path


def load_beside_adapter(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Load into `model`'s Engram (a model transformers loaded an adapter into, not wrapped by peft) the
    tensors `save_beside_adapter` put into the adapter folder's weight file, when it holds them (else the
    part the model was loaded with stays)."""
    from safetensors import safe_open

    path = Path(folder) / ADAPTER_FILE
    if path_kind(path) != "a file":
        return
    prefix = ADAPTER_PREFIX + "engram."
    with safe_open(str(path), "pt") as f:
        state = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    if state:
        get_attachment(model).load_state_dict(state, strict=True)
