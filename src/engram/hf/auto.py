"""Engram models as transformers' Auto classes see them: the `engram` model type, a config class and a
model class per base family, and the folder layout every tool that calls `from_pretrained` reads.

An Engram model is its base model's class with Engram attached: `EngramLlamaForCausalLM` subclasses
`LlamaForCausalLM` (so every weight keeps its name, and PEFT, TRL, lm-eval and vLLM see the layers they
know), its config `EngramLlamaConfig` subclasses `LlamaConfig` with `model_type` "engram", the base's
type in `base_model_type` and the Engram settings in `engram`. The classes of a family are made on first
use (`engram_model_class`) and registered with `AutoModelForCausalLM`; `register` puts the `engram`
model type into `AutoConfig`, and `engram.integrations` calls it as soon as transformers is imported.

A folder (`save_pretrained`) holds the backbone's weights in HF's files (no `engram.*` tensor), the
Engram part in `engram/` (V4.1 format, sealed, read by `load_engram`, hf-eval and the vLLM plugin: each
table once), config.json with `auto_map`, and `modeling_engram.py`: the few lines that
`trust_remote_code=True` runs, which import engram-lm. After `import engram` that file is never run:
the local classes win. `from_pretrained` checks the part before it loads the backbone (a refused part
costs no model load), then attaches it exactly as `load_engram` does.
"""

from __future__ import annotations

import contextvars
import functools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import transformers
from torch import nn
from transformers.configuration_utils import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, AutoConfig

from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.checkpoint.files import member_file
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.tokenizer_fit import COMPRESSION_FILE
from engram.checkpoint.v41.format import config_diffs
from engram.config import EngramConfig
from engram.hf.adapter import load_beside_adapter
from engram.hf.attach import EngramAttachment, add_engram, engram_dtype, get_attachment
from engram.hf.io import (
    PART_FOLDER,
    attach_part,
    read_folder_engram,
    row_sharded_layer,
    save_part,
)

__all__ = [
    "AUTO_MAP",
    "MODEL_TYPE",
    "REMOTE_CODE_FILE",
    "EngramForCausalLM",
    "EngramModelConfig",
    "EngramPreTrainedMixin",
    "base_model_class",
    "engram_config_class",
    "engram_model_class",
    "engram_settings",
    "make_engram_model",
    "make_plain_model",
    "register",
]

MODEL_TYPE = "engram"
REMOTE_CODE_FILE = "modeling_engram.py"
AUTO_MAP = {
    "AutoConfig": "modeling_engram.EngramModelConfig",
    "AutoModelForCausalLM": "modeling_engram.EngramForCausalLM",
}
# What trust_remote_code=True runs without engram-lm imported (transformers strips try blocks when it
# looks for the file's imports, so a missing engram-lm gets our one line, not its generic list).
REMOTE_CODE = '''"""An Engram model (engram-lm): transformers runs this file for trust_remote_code=True; it only imports
engram-lm's classes. With `import engram` first, transformers uses them directly and never runs it."""

try:
    from engram.hf.auto import EngramForCausalLM, EngramModelConfig
except ImportError:
    raise ImportError(
        "this folder holds an Engram model: install engram-lm to load it (pip install engram-lm)"
    ) from None

__all__ = ["EngramForCausalLM", "EngramModelConfig"]
'''
# the folders the HF Trainer saves to (transformers' PREFIX_CHECKPOINT_DIR), whose resume reads model.safetensors
_TRAINER_CHECKPOINT = re.compile(r"checkpoint-\d+")
# set while transformers builds a family's backbone for from_pretrained: Engram is attached from the part
_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("engram_hf_loading", default=False)


# ------------------------------------------------------------------------------------------- configs
class EngramModelConfig(PreTrainedConfig):
    """The `engram` model type. Its instances are of a family class (`engram_config_class`): the base's
    config class with `base_model_type`, `base_architectures` and `engram` (the settings) added;
    `from_dict` picks the family from `base_model_type`."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        if cls is not EngramModelConfig:  # a family class: the base's own reading
            return super().from_dict(config_dict, **kwargs)
        base = config_dict.get("base_model_type")
        if not isinstance(base, str) or base == MODEL_TYPE or base not in CONFIG_MAPPING:
            raise ValueError(
                f"an Engram config.json names base_model_type={base!r}, which is not a model type this "
                "transformers knows: restore the config.json the model was saved with"
            )
        return engram_config_class(CONFIG_MAPPING[base]).from_dict(config_dict, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoConfig") -> None:
        """A no-op: the folder's `auto_map` is ours (`AUTO_MAP`); transformers would copy this module."""


@functools.cache
def engram_config_class(base: type[PreTrainedConfig]) -> type[PreTrainedConfig]:
    """The Engram config class of base config class `base` (`EngramLlamaConfig` for `LlamaConfig`),
    mapped to `EngramForCausalLM` in AutoModelForCausalLM (which hands over to the family's model class)."""
    if issubclass(base, EngramModelConfig):
        return base
    cls = type(f"Engram{base.__name__}", (EngramModelConfig, base), {"__module__": __name__})
    _causal_lm_mapping().register(cls, EngramForCausalLM, exist_ok=True)
    return cls


def _causal_lm_mapping() -> Any:
    # not imported with this module: `register` runs while transformers' modeling may still be importing
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING


def _plain_config_class(config_cls: type) -> type:
    return next(c for c in config_cls.__mro__[1:] if c is not EngramModelConfig and c is not object)


# -------------------------------------------------------------------------------------------- models
class EngramPreTrainedMixin:
    """What an Engram family model adds to its base class: Engram built from its config when made from
    a config alone, `from_pretrained` attaching the folder's part, `save_pretrained` writing it."""

    config: Any
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [
        r"^engram\."
    ]  # a Trainer checkpoint's copy: the part is read

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if _LOADING.get():  # from_pretrained: the part is attached once the backbone is loaded
            return
        settings = getattr(config, "engram", None)
        if not isinstance(settings, dict) or "config" not in settings:
            raise ValueError(
                f"{type(config).__name__} holds no Engram settings (its 'engram' entry): build Engram models "
                "with engram.hf.add_engram(model, config, tokenizer=...) or load one with from_pretrained"
            )
        cfg = EngramConfig.from_dict(settings["config"])
        add_engram(
            self,  # type: ignore[arg-type]
            cfg,
            compression=_compression_for(config, cfg),
            boundaries=settings.get("boundaries"),
            eos_token_id=settings.get("eos_token_id"),
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        """The backbone from the folder's HF files, Engram from its `engram/` part, checked first."""
        return _from_pretrained(pretrained_model_name_or_path, model_args, kwargs)

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], *args: Any, save_part: bool = True, **kwargs: Any
    ) -> None:
        """HF's files without any `engram.*` tensor, config.json with the Engram settings and `auto_map`,
        `modeling_engram.py`, and (`save_part`) the Engram part in `engram/`: floats for trainable tables,
        a stored row format kept. Row-sharded tables: `save_part=False` here, then
        `engram.distributed.save_engram` on every rank. Into a Trainer checkpoint (`checkpoint-<step>`)
        the tables go into model.safetensors too: `resume_from_checkpoint` loads that file alone
        (`from_pretrained` of the checkpoint reads the part and ignores them)."""
        att = get_attachment(self)  # type: ignore[arg-type]
        _write_settings(self.config, att, type(self))
        checkpoint = _TRAINER_CHECKPOINT.fullmatch(Path(save_directory).name) is not None
        sharded = row_sharded_layer(att) is not None
        if save_part and sharded and not checkpoint:  # (a Trainer checkpoint's shards: EngramShardsCallback)
            raise ValueError(
                f"{type(self).__name__}'s tables are row-sharded across processes: save_pretrained(folder, "
                "save_part=False) on rank 0, then engram.distributed.save_engram(model, folder) on every rank"
            )
        state = kwargs.pop("state_dict", None)
        if state is None:
            state = self.state_dict()  # type: ignore[attr-defined]
        if not checkpoint:  # the tables are the part's alone
            state = {k: v for k, v in state.items() if not k.startswith("engram.")}
        super().save_pretrained(save_directory, *args, state_dict=state, **kwargs)  # type: ignore[misc]
        if not kwargs.get("is_main_process", True):
            return
        (Path(save_directory) / REMOTE_CODE_FILE).write_text(REMOTE_CODE)
        if save_part and not sharded:
            save_part_of(self, save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoModel") -> None:
        """A no-op: the folder's `auto_map` is ours (`AUTO_MAP`); transformers would copy this module."""


class EngramForCausalLM:
    """The model class of the `engram` model type (AutoModelForCausalLM's entry, `auto_map`'s): it hands
    `from_pretrained` / `from_config` to the config's family class (`EngramLlamaForCausalLM`, ...) and
    is never instantiated itself."""

    config_class = EngramModelConfig

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "EngramForCausalLM dispatches to a family class: use from_pretrained(folder) or from_config("
            "config), or engram.hf.add_engram(model, config, tokenizer=...) on a transformers model"
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        return _from_pretrained(pretrained_model_name_or_path, model_args, kwargs)

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        return engram_model_class(base_model_class(config))._from_config(config, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoModel") -> None:
        """A no-op: the folder's `auto_map` is ours (`AUTO_MAP`)."""


@functools.cache
def engram_model_class(base: type[nn.Module]) -> type[nn.Module]:
    """The Engram model class of base model class `base` (`EngramLlamaForCausalLM` for
    `LlamaForCausalLM`)."""
    if issubclass(base, EngramPreTrainedMixin):
        return base
    config_cls = engram_config_class(getattr(base, "config_class", None) or PreTrainedConfig)
    cls = type(f"Engram{base.__name__}", (EngramPreTrainedMixin, base), {"config_class": config_cls})
    cls.__module__ = __name__
    _causal_lm_mapping().register(config_cls, cls, exist_ok=True)  # pipelines check the class by name
    return cls


def base_model_class(config: Any) -> type[nn.Module]:
    """The base model class an Engram config names (`base_architectures`), else the causal LM class
    transformers maps its base config class to."""
    from transformers import PreTrainedModel

    for name in getattr(config, "base_architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    plain = _plain_config_class(type(config))
    mapping = _causal_lm_mapping()
    if plain not in mapping:
        raise ValueError(
            f"config.json names base {getattr(config, 'base_architectures', None)!r} ({plain.__name__}), which "
            "transformers has no causal LM class for: restore the config.json the model was saved with"
        )
    return mapping[plain]


# --------------------------------------------------------------------------------- converting a model
def engram_settings(config: EngramConfig, boundaries: str | None, eos_token_id: int | None) -> dict[str, Any]:
    """The `engram` entry of an Engram model's config: where the part is, its Engram config (as
    attached: an attachment's `config`, or a read part's `CheckedPart.config`), and the attachment
    options."""
    return {
        "part": PART_FOLDER,
        "config": config.to_dict(),
        "boundaries": boundaries,
        "eos_token_id": eos_token_id,
    }


def _write_settings(config: Any, att: EngramAttachment, model_cls: type) -> None:
    config.engram = engram_settings(att.config, att.rows.boundaries, att.rows.eos_token_id)
    config.auto_map = dict(AUTO_MAP)
    plain = _plain_model_class(model_cls)
    config.base_architectures = [plain.__name__]
    config.base_model_type = _plain_config_class(type(config)).model_type


def _plain_model_class(model_cls: type) -> type:
    return next(c for c in model_cls.__mro__[1:] if c is not EngramPreTrainedMixin)


def make_engram_model(model: nn.Module) -> nn.Module:
    """Make a transformers model with Engram attached (`model.engram`) an instance of its Engram family
    class, its config of the Engram config class (`save_pretrained` then writes an Engram folder). Other
    modules are left as they are."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or isinstance(model, EngramPreTrainedMixin):
        return model
    att = get_attachment(model)
    cls = engram_model_class(type(model))
    model.__class__ = cls
    cfg_cls = engram_config_class(type(model.config))
    if type(model.config) is not cfg_cls:
        model.config.__class__ = cfg_cls
    _write_settings(model.config, att, cls)
    return model


def make_plain_model(model: nn.Module) -> nn.Module:
    """Undo `make_engram_model` (after `remove_engram`): the base classes again, no Engram settings."""
    if isinstance(model, EngramPreTrainedMixin):
        model.__class__ = _plain_model_class(type(model))
        config = model.config
        if isinstance(config, EngramModelConfig):
            config.__class__ = _plain_config_class(type(config))
            for key in ("engram", "auto_map", "base_architectures", "base_model_type"):
                config.__dict__.pop(key, None)
            config.architectures = [type(model).__name__]
    return model


# ---------------------------------------------------------------------------------- reading a folder
def _local_folder(path: Any) -> Path:
    d = Path(path)
    kind = path_kind(d)
    if kind != "a folder":
        raise ValueError(
            f"{path} is {kind or 'not a local folder'}: Engram models load from a local folder (its engram/ "
            "part is read with its files); download a Hub repository first (hf download REPO --local-dir DIR)"
        )
    return d


def _compression_for(config: Any, cfg: EngramConfig) -> TokenizerCompression:
    """The compression map for an Engram model made from its config alone: the part's map beside the
    config (`config._name_or_path`), else the tokenizer the Engram config names."""
    where = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    part = Path(where) / PART_FOLDER if where else None
    if part is not None and path_kind(part / COMPRESSION_FILE) == "a file":
        return TokenizerCompression.load(member_file(part, COMPRESSION_FILE, f"{part}: the compression map"))
    if cfg.tokenizer is not None:
        return TokenizerCompression.from_tokenizer(resolve_tokenizer(cfg.tokenizer))
    raise ValueError(
        "an Engram model made from its config alone needs the tokenizer's compression map: load the config "
        "from the model's folder (AutoConfig.from_pretrained(folder)), or attach Engram to a model with "
        "engram.hf.add_engram(model, config, tokenizer=...)"
    )


@contextmanager
def _loading() -> Iterator[None]:
    token = _LOADING.set(True)
    try:
        yield
    finally:
        _LOADING.reset(token)


def _from_pretrained(path: Any, model_args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    folder = _local_folder(path)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, str | os.PathLike):
        config = AutoConfig.from_pretrained(str(config or folder))
    if not isinstance(config, EngramModelConfig):
        raise ValueError(
            f"{folder}/config.json is a {type(config).__name__}, not an Engram model's: load it with "
            "AutoModelForCausalLM, or upgrade a folder written before Engram models had their own type "
            f"(engram hf-upgrade {folder})"
        )
    family = engram_model_class(base_model_class(config))
    read = kwargs.pop("engram_part", None)  # read and checked by the caller (hf-eval)
    verify = bool(kwargs.pop("engram_verify", False))
    if read is None:  # checked (sizes, tokenizer, every CRC) before the backbone is loaded
        read = read_folder_engram(folder, config, verify=verify)
    settings = getattr(config, "engram", None)
    if isinstance(settings, dict) and isinstance(settings.get("config"), dict):
        diffs = config_diffs(EngramConfig.from_dict(settings["config"]), read.checked.config)
        if diffs:
            raise ValueError(
                f"{folder}/config.json's Engram settings disagree with its part {read.checked.part}: "
                f"{'; '.join(diffs)}; restore the folder as save_pretrained wrote it"
            )
    with _loading():
        model = super(EngramPreTrainedMixin, family).from_pretrained(  # type: ignore[misc]
            str(folder), *model_args, config=config, **kwargs
        )
    attach_part(model, read)
    adapter = (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path")
    if adapter is not None:  # transformers loaded a peft adapter folder's adapter into the model
        load_beside_adapter(model, adapter)
    dtype = engram_dtype(model)
    if any(p.is_floating_point() and p.dtype != dtype for p in model.engram.parameters()):
        model.engram.to(dtype)
    model.engram.train(model.training)
    return model


def save_part_of(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """The Engram part of `model` into `directory/engram/`: floats, or (every table stored in a row
    format) each table in its own format."""
    att = get_attachment(model)
    stored = [m.table for m in att.layers.values()]
    quantised = all(not isinstance(getattr(t, "weight", None), nn.Parameter) for t in stored)
    return save_part(model, directory, quantised=quantised)


def register() -> None:
    """Put the `engram` model type into AutoConfig (idempotent; `engram.integrations` calls it when
    transformers' Auto configuration module is imported). Each family's config class is mapped to
    `EngramForCausalLM` in AutoModelForCausalLM when it is made (`engram_config_class`)."""
    AutoConfig.register(MODEL_TYPE, EngramModelConfig, exist_ok=True)


def __getattr__(name: str) -> Any:
    """`EngramLlamaForCausalLM`, `EngramLlamaConfig`, ...: the family classes by name (made on first use),
    so that pickle and peft's auto mapping (module + class name) find them."""
    if name.startswith("Engram") and name not in ("EngramModelConfig", "EngramForCausalLM"):
        base = getattr(transformers, name.removeprefix("Engram"), None)
        from transformers import PreTrainedModel

        if isinstance(base, type) and issubclass(base, PreTrainedModel):
            return engram_model_class(base)
        if isinstance(base, type) and issubclass(base, PreTrainedConfig):
            return engram_config_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
