"""The public `add_engram`, `load_engram` and `remove_engram`: the attachment plus the model's class.

Each wraps its twin in `engram.hf.attach` / `engram.hf.io` (`functools.wraps`: at runtime it shows that
twin's docstring and signature). A transformers model with Engram attached becomes an instance of
its Engram family class (`engram.hf.auto`: `EngramLlamaForCausalLM` for a Llama), so `save_pretrained`
writes a folder every tool that calls `from_pretrained` loads with Engram; `remove_engram` gives the base
classes back. Any other module is attached to as it is. transformers is imported only when the model is
one of its models (it is then imported already).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from engram.hf import attach, io

__all__ = ["add_engram", "load_engram", "remove_engram"]


def _engram_class(model: nn.Module) -> nn.Module:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    from engram.hf.auto import make_engram_model

    return make_engram_model(model)


@functools.wraps(attach.add_engram)
def add_engram(*args: Any, **kwargs: Any) -> nn.Module:
    """Attach Engram to a model (`engram.hf.attach.add_engram`) and make a transformers model one.

    Args:
        *args: The arguments of `engram.hf.attach.add_engram`.
        **kwargs: The keyword arguments of `engram.hf.attach.add_engram`.

    Returns:
        The same model object, with `model.engram`; a transformers model is now an instance of its
            Engram family class.
    """
    return _engram_class(attach.add_engram(*args, **kwargs))


@functools.wraps(io.load_engram)
def load_engram(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """Attach a saved Engram part to a backbone (`engram.hf.io.load_engram`) and make it an Engram model.

    Args:
        model: A backbone without Engram.
        *args: The other arguments of `engram.hf.io.load_engram` (the folder first).
        **kwargs: The keyword arguments of `engram.hf.io.load_engram`.

    Returns:
        The same model object, with the part attached.

    Raises:
        ValueError: The model has Engram attached already (`from_pretrained` of an Engram folder
            loads its part itself), or the part does not fit (see `engram.hf.io.load_engram`).
    """
    if isinstance(getattr(model, "engram", None), attach.EngramAttachment):
        raise ValueError(
            f"{type(model).__name__} has Engram attached already: from_pretrained of a folder engram-lm wrote "
            "loads its Engram part itself; drop the load_engram call (it attaches a part to a plain backbone)"
        )
    model = _engram_class(io.load_engram(model, *args, **kwargs))
    io.warn_if_older_folder(args[0] if args else kwargs["directory"])
    return model


@functools.wraps(attach.remove_engram)
def remove_engram(model: nn.Module) -> attach.EngramAttachment:
    """Detach Engram from a model (`engram.hf.attach.remove_engram`), giving back the base classes.

    Args:
        model: A model with Engram attached.

    Returns:
        The detached attachment.
    """
    att = attach.remove_engram(model)
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from engram.hf.auto import make_plain_model

        make_plain_model(model)
    return att
