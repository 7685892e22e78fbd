"""Attaching Engram modules to a Hugging Face decoder-only causal LM (`add_engram`).

The Engram modules live in one `EngramAttachment` registered on the model as `model.engram`
(parameter names `engram.layers.<id>.*`); the backbone's modules and weights are not touched. Two
forward pre-hooks do the work: one on the model computes this call's rows (from `input_ids` and
`attention_mask`, from a collator's `engram_rows`, or incrementally from the KV cache: see
`engram.hf.rows`), one on each chosen decoder layer adds Engram's output to the hidden states
entering it. Gradient checkpointing in transformers 5 wraps a layer's `forward`, not its hooks, so
Engram runs once per step, outside the checkpoint.

Decoder layers are found by a documented rule (`DECODER_LAYER_PATHS`, the first path that names an
`nn.ModuleList`), or given explicitly with `decoder_layers=`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engram.addressing.compression import TokenizerCompression
from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout
from engram.config import EngramConfig
from engram.hf.hooks import install_hooks, remove_hooks
from engram.hf.rows import RowSource
from engram.model.module import Engram
from engram.model.optim import takes_sparse_gradient
from engram.model.table import TrainableTable
from engram.model.table_init import table_seed

__all__ = [
    "DECODER_LAYER_PATHS",
    "EngramAttachment",
    "SparseGradientGuard",
    "add_engram",
    "boundary_config",
    "engram_dtype",
    "find_decoder_layers",
    "find_decoder_stack",
    "get_attachment",
    "model_hidden_size",
    "remove_engram",
    "set_engram_trainable",
]

# Where decoder-only models of transformers 5 keep their decoder layers, tried in this order on the
# model given to add_engram: Llama, Qwen2/3, Mistral, Gemma, Phi ("model.layers"); GPT-2, GPT-J,
# Bloom, Falcon ("transformer.h"); GPT-NeoX/Pythia ("gpt_neox.layers"); OPT ("model.decoder.layers");
# and the same on a base model without its LM head ("layers", "h", "decoder.layers").
DECODER_LAYER_PATHS = (
    "model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
    "model.language_model.layers",
    "layers",
    "h",
    "decoder.layers",
)
"""Where decoder-only models keep their decoder layers, tried in this order by `find_decoder_layers`.

Llama, Qwen2/3, Mistral, Gemma, Phi ("model.layers"); GPT-2, GPT-J, Bloom, Falcon ("transformer.h");
GPT-NeoX/Pythia ("gpt_neox.layers"); OPT ("model.decoder.layers"); a multimodal model's language model
("model.language_model.layers"); and the same on a base model without its LM head ("layers", "h",
"decoder.layers"). The first path that names a non-empty `nn.ModuleList` wins.
"""


def _resolve(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_decoder_stack(
    model: nn.Module, decoder_layers: str | Sequence[nn.Module] | None = None
) -> tuple[nn.Module, list[nn.Module]]:
    """(owner, layers): the decoder layers of `model` and the module whose forward runs them (the
    `model.model` of a Llama, the `transformer` of a GPT-2; `model` itself for an explicit list).

    `decoder_layers`: a dotted path or the layer modules themselves; default: the first of
    `DECODER_LAYER_PATHS` that names a non-empty nn.ModuleList."""
    if decoder_layers is not None and not isinstance(decoder_layers, str):
        layers = list(decoder_layers)
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise TypeError("decoder_layers must be a dotted path or a non-empty list of nn.Module layers")
        return model, layers
    paths = DECODER_LAYER_PATHS if decoder_layers is None else (decoder_layers,)
    for path in paths:
        found = _resolve(model, path)
        if isinstance(found, nn.ModuleList | list | tuple) and len(found) > 0:
            parent = path.rpartition(".")[0]
            owner = model if not parent else _resolve(model, parent)
            return owner, list(found)
    if decoder_layers is not None:
        raise ValueError(
            f"decoder_layers={decoder_layers!r} does not name a list of layers on {type(model).__name__} "
            f"(found {type(_resolve(model, decoder_layers)).__name__})"
        )
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: tried "
        f"{', '.join(DECODER_LAYER_PATHS)}; pass decoder_layers='path.to.layers' (a dotted path to its "
        "nn.ModuleList of decoder layers) or the list of layer modules"
    )


def find_decoder_layers(
    model: nn.Module, decoder_layers: str | Sequence[nn.Module] | None = None
) -> list[nn.Module]:
    """The decoder layers of a model: where `add_engram` can attach Engram.

    Args:
        model: A decoder-only model (a transformers model, or any nn.Module).
        decoder_layers: A dotted path to the layers' nn.ModuleList, or the layer modules
            themselves; default: the first of `DECODER_LAYER_PATHS` that names a non-empty
            nn.ModuleList.

    Returns:
        The layers, in order (layer id i is element i).

    Raises:
        TypeError: `decoder_layers` is a list that is empty or holds something else than modules.
        ValueError: No layers are found where asked (or at any of `DECODER_LAYER_PATHS`).

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from engram.hf import find_decoder_layers
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
        ...                                      num_hidden_layers=2, num_attention_heads=4))
        >>> len(find_decoder_layers(model)), type(find_decoder_layers(model)[0]).__name__
        (2, 'LlamaDecoderLayer')
    """
    return find_decoder_stack(model, decoder_layers)[1]


def model_hidden_size(model: nn.Module) -> int | None:
    """The residual width of an HF model (config hidden_size / n_embd / d_model, else its embeddings)."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        for key in ("hidden_size", "n_embd", "d_model"):
            v = getattr(text, key, None)
            if isinstance(v, int):
                return v
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    return getattr(emb, "embedding_dim", None)


def _model_param(model: nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def engram_dtype(model: nn.Module) -> torch.dtype:
    """The dtype Engram modules take on `model`: its parameters' when a trainable table can have it
    (float32, bfloat16, float64), else float32 (a float16 model's table would lose small updates)."""
    p = _model_param(model)
    return (
        p.dtype
        if p is not None and p.dtype in (torch.float32, torch.bfloat16, torch.float64)
        else torch.float32
    )


class EngramAttachment(nn.Module):
    """The Engram part of an HF model: {layer_id: Engram} plus the hasher and the hooks' state.

    Registered on the model as `model.engram` by `add_engram` (parameter names
    `engram.layers.<id>.*`); hooks on the model drive it, so it is not called itself.

    Args:
        config: The Engram config, as attached.
        hasher: The hasher of the config and the tokenizer's compression map.
        layers: The Engram module of each layer id.
        boundaries: None (V4.1: windows run across the whole sequence), "eos" (a window restarts
            after each `eos_token_id`) or "position_ids" (restarts where position_ids == 0); both
            are for packed sequences.
        eos_token_id: The restart id of "eos" boundaries.
    """

    def __init__(
        self,
        config: EngramConfig,
        hasher: NgramHasher,
        layers: dict[int, Engram],
        *,
        boundaries: str | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        super().__init__()

        self.config, self.hasher = config, hasher
        self.layers = nn.ModuleDict({str(k): v for k, v in layers.items()})
        self.rows = RowSource(hasher, boundaries=boundaries, eos_token_id=eos_token_id)
        # How the tables' gradients are shared across data-parallel ranks (None: one process);
        # set by engram.distributed.prepare_data_parallel, called by EngramOptimizer before its step.
        self.table_sync: Any = None
        self.handles: list[Any] = []
        # True: the tables' sparse gradients stay on .grad for code of the user's own (an optimizer that takes
        # them, torch.optim.SparseAdam; reading them), not refused when no sparse row optimizer holds them
        # (`SparseGradientGuard`)
        self.allow_sparse_gradients = False
        # set_engram_trainable's word: None (not said), True (trained, beside an adapter too), False (frozen)
        self.trainable: bool | None = None
        self.guards = [SparseGradientGuard.install(self, k, m.table) for k, m in layers.items()]

    @property
    def compression(self) -> TokenizerCompression:
        """The hasher's tokenizer compression map."""
        return self.hasher.compression

    def __deepcopy__(self, memo: dict[int, Any]) -> EngramAttachment:
        """A copy with its own modules and hook state; the hasher (read-only tables) is shared and a
        built optimizer is not carried over."""
        memo[id(self.hasher)] = self.hasher
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in ("optimizer_hooks", "guards"):
                new.__dict__[k] = copy.deepcopy(v, memo)
        new.optimizer_hooks = None
        new.guards = [SparseGradientGuard.install(new, int(k), m.table) for k, m in new.layers.items()]
        return new

    def module(self, layer_id: int) -> Engram:
        """The Engram module at a decoder layer.

        Args:
            layer_id: One of the attached layer ids.

        Returns:
            Its module.

        Raises:
            KeyError: No Engram module is attached at that layer.
        """
        return self.layers[str(layer_id)]  # type: ignore[return-value]

    def tables(self) -> list[nn.Parameter]:
        """The trainable table weights (what the sparse row optimizers update).

        Reading a lazy table's weight draws it (see `TrainableTable`).

        Returns:
            One parameter per layer whose table is trainable (none for stored FP8 / quantised tables).
        """
        out = []
        for m in self.layers.values():
            w = getattr(m.table, "weight", None)
            if isinstance(w, nn.Parameter):
                out.append(w)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the model's hooks drive the attachment.

        Args:
            *args: Ignored.
            **kwargs: Ignored.

        Raises:
            RuntimeError: Always: call the model, not `model.engram`.
        """
        raise RuntimeError("model.engram is driven by hooks on the model: call the model, not model.engram")

    def check_adapter_training(self, stack: nn.Module) -> None:
        """Refuse an adapter training alone beside an Engram that was frozen without anyone saying so.

        Run before a forward that records gradients: peft freezes every parameter it does not add,
        Engram's too, and the model would train without them, silently. Saying so with
        `set_engram_trainable` (either way) lets the forward run.

        Args:
            stack: The module whose parameters are searched for a training adapter (`lora_` names).

        Raises:
            ValueError: Every Engram parameter is frozen, `set_engram_trainable` was not called, and
                an adapter (peft's LoRA) trains.
        """
        if self.trainable is not None or any(p.requires_grad for p in self.parameters()):
            return
        if not any(p.requires_grad and "lora_" in n for n, p in stack.named_parameters()):
            return
        raise ValueError(
            "peft froze Engram's table and wkv, and an adapter trains alone: to train them beside it, make the "
            "PeftModel yourself (peft.get_peft_model) and pass optimizers=(engram.hf.build_optimizer("
            "peft_model), None) to the trainer (it trains Engram beside the adapter); to keep them frozen, "
            "call engram.hf.set_engram_trainable(model, False) first"
        )


class SparseGradientGuard:
    """A trainable table's post-accumulate-grad hook: a sparse row gradient that no sparse row optimizer
    takes (`engram.model.optim.takes_sparse_gradient`; `build_optimizer` builds one) is refused where
    backward accumulates it, in one line naming `build_optimizer`. The HF Trainer's default AdamW would
    otherwise meet it in its gradient clipping and fail inside torch; the refusal comes before the first
    optimizer step, from the first backward."""

    def __init__(self, att: EngramAttachment, layer_id: int) -> None:
        self.att, self.layer_id = weakref.ref(att), layer_id

    @classmethod
    def install(cls, att: EngramAttachment, layer_id: int, table: Any) -> Any:
        """Hook the weight of `table` (a drawn TrainableTable; a lazy one is drawn under a process group,
        where `engram.distributed` builds the optimizer); the handle, or None."""
        w = table._parameters.get("weight") if isinstance(table, TrainableTable) else None
        return None if w is None else w.register_post_accumulate_grad_hook(cls(att, layer_id))

    def __call__(self, p: torch.Tensor) -> None:
        att = self.att()
        if att is None or p.grad is None or not p.grad.is_sparse or att.allow_sparse_gradients:
            return
        if takes_sparse_gradient(p):
            return
        raise ValueError(
            f"Engram's table at layer {self.layer_id} got a sparse row gradient that no optimizer takes: the "
            "HF Trainer's default optimizer (AdamW) and its gradient clipping cannot use one. Build the "
            "optimizer with engram.hf.build_optimizer(model) and pass it: Trainer(..., optimizers=("
            "build_optimizer(model), None)), TRL's trainers the same; or freeze the tables "
            "(engram.hf.set_engram_trainable(model, False)); for code of your own that takes sparse gradients "
            "(torch.optim.SparseAdam, reading .grad), set model.engram.allow_sparse_gradients = True"
        )


def set_engram_trainable(model: nn.Module, trainable: bool) -> None:
    """Train Engram's parameters (table, wkv, gate: `requires_grad`) or freeze them, and record it.

    A frozen Engram under a training adapter is then taken as meant
    (`EngramAttachment.check_adapter_training`).

    Args:
        model: A model with Engram, or a peft model around one.
        trainable: True to train, False to freeze.

    Raises:
        TypeError: `trainable` is not a bool.
        ValueError: The model has no Engram attached.
    """
    if not isinstance(trainable, bool):
        raise TypeError(f"trainable must be True or False, got {trainable!r}")
    att = get_attachment(model)
    att.requires_grad_(trainable)
    att.trainable = trainable


def get_attachment(model: nn.Module) -> EngramAttachment:
    """The EngramAttachment of a model `add_engram` returned.

    Args:
        model: The model, or a wrapper around it (e.g. a peft model): its modules are searched.

    Returns:
        `model.engram`.

    Raises:
        ValueError: The model has no Engram attached.
    """
    att = getattr(model, "engram", None)
    if not isinstance(att, EngramAttachment):  # a wrapper (e.g. a peft model): search its modules
        att = next((m for m in model.modules() if isinstance(m, EngramAttachment)), None)
    if att is None:
        raise ValueError(
            f"{type(model).__name__} has no Engram attached: call engram.hf.add_engram(model, ...)"
        )
    return att


def _compression_for(
    config: EngramConfig, tokenizer: Any, compression: TokenizerCompression | None
) -> TokenizerCompression:
    if compression is not None:
        if tokenizer is not None:
            compression.check_tokenizer(tokenizer)
        return compression
    if tokenizer is None:
        if config.tokenizer is None:
            raise ValueError(
                "pass tokenizer= (the model's tokenizer) or compression= (a TokenizerCompression): "
                f"config {config.name!r} names no tokenizer"
            )
        tokenizer = config.tokenizer
    return TokenizerCompression.from_tokenizer(tokenizer)


def build_hasher(
    config: EngramConfig, tokenizer: Any = None, compression: TokenizerCompression | None = None
) -> NgramHasher:
    """The NgramHasher of `config` for `tokenizer` (or a ready `compression`), with errors that name
    the mismatch between the tokenizer's vocabulary and the config."""
    comp = _compression_for(config, tokenizer, compression)
    try:
        return NgramHasher(config, comp)
    except ValueError as e:
        raise ValueError(f"the tokenizer does not match the Engram config: {e}") from None


def add_engram(
    model: nn.Module,
    config: EngramConfig,
    layers: Sequence[int] | None = None,
    tokenizer: Any = None,
    *,
    compression: TokenizerCompression | None = None,
    decoder_layers: str | Sequence[nn.Module] | None = None,
    zero_init: bool = True,
    boundaries: str | None = None,
    eos_token_id: int | None = None,
    modules: dict[int, Engram] | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
    lazy_tables: bool | None = None,
) -> nn.Module:
    """Attach Engram at decoder layers of a decoder-only HF model.

    The Engram output enters the residual stream at the entrance of each named layer. Everything is
    checked before the model is changed. Through `engram.hf.add_engram`, a transformers model also
    becomes an instance of its Engram family class (`engram.hf.auto`: `EngramLlamaForCausalLM` for a
    Llama), so `save_pretrained` writes a folder that every tool calling `from_pretrained` loads with
    Engram; any other module is attached to as it is.

    The tables' rows are row-addressed (`engram.model.table_init`): row r of layer l's table depends
    on (seed, l, r) only, so N processes each drawing their own rows hold the table one process
    draws.

    Args:
        model: A decoder-only model (one residual stream).
        config: The Engram config; `hc_mult` must be 1 and `hidden_size` the model's.
        layers: The decoder layer ids (default `config.layer_ids`).
        tokenizer: An HF tokenizer, a `tokenizers.Tokenizer`, a tokenizer.json path or
            'deepseek-v4': builds the compression map (default: `config.tokenizer`).
        compression: A ready compression map, instead of `tokenizer`.
        decoder_layers: Where the decoder layers are (see `find_decoder_layers`).
        zero_init: The value half of `wkv` starts at zero, so the attached model's logits equal the
            original's exactly until it is trained.
        boundaries: None (V4.1), "eos" or "position_ids": where windows restart in packed
            sequences (see `EngramAttachment`).
        eos_token_id: The restart id of "eos" boundaries (default: the model config's).
        modules: Ready Engram modules, one per layer id (used by `load_engram`).
        dtype: The modules' dtype (default: the model's when a trainable table can have it,
            float32 / bfloat16 / float64, else float32).
        seed: An int in [0, 2**31), or None to draw one from torch's generator (torch.manual_seed
            before add_engram then decides the tables, as it decides the other weights).
        lazy_tables: The tables take no memory until first used (a forward,
            `model.engram.tables()`, a state_dict: then the whole table is drawn), and
            `engram.distributed.prepare_data_parallel` draws only this rank's rows. None: lazy when
            this process is one of several of a torch.distributed process group, else drawn here
            (a lazy table is not among `model.parameters()` until it is drawn).

    Returns:
        The same model object, with `model.engram` (an `EngramAttachment`) and its hooks.

    Raises:
        TypeError: `model` is not an nn.Module, `config` not an EngramConfig, or `lazy_tables`
            not a bool or None.
        ValueError: Engram is attached already, or the config does not fit the model (streams,
            hidden size, layer ids, tokenizer), or `seed`, `boundaries` or `modules` is invalid.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from engram import EngramConfig, TokenizerCompression
        >>> from engram.hf import add_engram
        >>> backbone = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
        ...                                         num_hidden_layers=2, num_attention_heads=4))
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> before = backbone(ids).logits
        >>> config = EngramConfig.preset("tiny").replace(
        ...     hc_mult=1, vocab_size=1000, compressed_vocab_size=1000
        ... )
        >>> model = add_engram(backbone, config, compression=TokenizerCompression.identity(1000))
        >>> type(model).__name__, model is backbone
        ('EngramLlamaForCausalLM', True)
        >>> torch.equal(model(ids).logits, before)  # zero_init: nothing changes until trained
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (a transformers model), got {type(model).__name__}")
    if not isinstance(config, EngramConfig):
        raise TypeError(f"config must be an engram.EngramConfig, got {type(config).__name__}")
    if isinstance(getattr(model, "engram", None), nn.Module):
        raise ValueError(
            f"{type(model).__name__} already has an attribute 'engram' (Engram attached already?); "
            "attach once per model"
        )
    if layers is not None:
        ids = tuple(int(i) for i in layers)
        if ids != config.layer_ids:
            config = config.replace(layer_ids=ids)
    if config.hc_mult != 1:
        raise ValueError(
            f"config {config.name!r} has hc_mult={config.hc_mult}, but a Hugging Face model has one residual "
            "stream: use config.replace(hc_mult=1)"
        )
    hidden = model_hidden_size(model)
    if hidden is not None and hidden != config.hidden_size:
        raise ValueError(
            f"the model's hidden size is {hidden} but config {config.name!r} has hidden_size="
            f"{config.hidden_size}: use config.replace(hidden_size={hidden})"
        )
    owner, decoder = find_decoder_stack(model, decoder_layers)
    bad = [i for i in config.layer_ids if i >= len(decoder)]
    if bad:
        raise ValueError(
            f"layer ids {bad} are out of range: {type(model).__name__} has {len(decoder)} decoder layers "
            f"(ids 0..{len(decoder) - 1})"
        )
    if boundaries == "eos" and eos_token_id is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
        eos_token_id = eos[0] if isinstance(eos, list | tuple) and eos else eos
    config = boundary_config(config, boundaries, eos_token_id)
    hasher = build_hasher(config, tokenizer, compression)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 31):
        raise ValueError(
            f"seed={seed!r}: give an int in [0, 2**31), or None to draw one from torch's generator"
        )
    if lazy_tables not in (None, True, False):
        raise TypeError(f"lazy_tables={lazy_tables!r}: give True, False or None (lazy under a process group)")
    p = _model_param(model)
    if dtype is None:
        dtype = engram_dtype(model)
    if modules is None:
        if seed is None:
            seed = int(torch.randint(0, 1 << 31, ()))  # torch's generator decides, as for the other weights
        lazy = _in_process_group() if lazy_tables is None else lazy_tables
        layout = Layout(config)
        modules = {}
        for lid in config.layer_ids:
            lp = _model_param(decoder[lid])
            device = lp.device if lp is not None else (p.device if p is not None else None)
            rows = layout.layer(lid).table_rows
            table = TrainableTable(
                rows, config.head_dim, dtype=dtype, device=device, seed=table_seed(seed, lid), lazy=lazy
            )
            m = Engram(config, lid, table=table, dtype=dtype, device=device)
            if zero_init:
                _zero_value(m, config)
            modules[lid] = m
    elif set(modules) != set(config.layer_ids):
        raise ValueError(f"modules cover layers {sorted(modules)}, config has {list(config.layer_ids)}")
    else:
        for m in modules.values():
            m.config = config  # the same addressing; records the restart rule with the modules

    # ---- nothing above changed the model; attach now
    att = EngramAttachment(config, hasher, modules, boundaries=boundaries, eos_token_id=eos_token_id)
    model.engram = att
    install_hooks(model, owner, att, decoder)
    return model


def _in_process_group() -> bool:
    """Whether this process is one of several of a torch.distributed job (its tables are then lazy:
    prepare_data_parallel draws only this rank's rows)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def boundary_config(config: EngramConfig, boundaries: str | None, eos_token_id: int | None) -> EngramConfig:
    """`config` with an attachment's window boundaries applied: `boundaries` None (V4.1), 'eos' (windows
    restart after `eos_token_id`: the hasher and its streams do that themselves, through
    `restart_after_id`) or 'position_ids' (the rows source restarts them; the config is unchanged).
    Raises for another value, or for 'eos' without an id of the vocabulary."""
    if boundaries not in (None, "eos", "position_ids"):
        raise ValueError(f"boundaries={boundaries!r}: use None (V4.1), 'eos' or 'position_ids'")
    if boundaries != "eos":
        return config
    if (
        isinstance(eos_token_id, bool)
        or not isinstance(eos_token_id, int)
        or not 0 <= eos_token_id < config.vocab_size
    ):
        raise ValueError(
            f"boundaries='eos' needs an eos_token_id in [0, {config.vocab_size}), got {eos_token_id!r}"
        )
    return config.replace(restart_after_id=eos_token_id)


@torch.no_grad()
def _zero_value(m: Engram, config: EngramConfig) -> None:
    """Zero the projection that makes Engram's value (V4.1: the value half of the fused `wkv`; the
    other variants: `value_proj`), so that Engram adds exactly nothing until it is trained."""
    wkv = getattr(m, "wkv", None)
    if wkv is not None:
        wkv.weight[config.hc_mult * config.hidden_size :].zero_()
        return
    m.value_proj.weight.zero_()
    if m.value_proj.bias is not None:
        m.value_proj.bias.zero_()


def remove_engram(model: nn.Module) -> EngramAttachment:
    """Detach Engram from a model: its hooks and `model.engram`.

    The backbone is as it was before `add_engram`; through `engram.hf.remove_engram`, a
    transformers model also gets its base classes back.

    Args:
        model: A model with Engram attached.

    Returns:
        The detached attachment.

    Raises:
        ValueError: The model has no Engram attached.
    """
    att = getattr(model, "engram", None)
    if not isinstance(att, EngramAttachment):
        raise ValueError(f"{type(model).__name__} has no Engram attached (model.engram)")
    remove_hooks(model, att)
    for handle in att.guards:
        if handle is not None:
            handle.remove()
    att.guards = []
    del model.engram
    return att
