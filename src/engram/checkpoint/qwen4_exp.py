"""Qwen4-Exp's Per-Layer Embedding weights (transformers' `Qwen4ExpTextPLELayer`) into our `Engram`
modules of variant `qwen4-exp-ple`: the state-dict key mapping, with every shape checked and the
hash buffers transformers stores (multipliers, head primes, head offsets) checked against our layout.

Takes an in-memory state dict (of a PLE layer, or of a whole Qwen4-Exp model, whose PLE keys are
`...layers.{i}.ple.*` with i the 0-based decoder layer); knows nothing of files or shards.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engram.addressing.layout import Layout
from engram.config import Variant
from engram.model.module import Engram
from engram.model.table import TrainableTable

__all__ = ["PLE_KEYS", "load_ple_layer", "load_ple_model", "ple_prefix"]

# transformers' Qwen4ExpTextPLELayer key -> our Engram key (parameters)
PLE_KEYS = {
    "ple_embedding.ngram_embedding.weight": "table.weight",
    "key_proj.weight": "key_proj.weight",
    "value_proj.weight": "value_proj.weight",
    "norm_key.weight": "norm_key.weight",
    "norm_query.weight": "norm_query.weight",
    "norm_conv.weight": "norm_conv.weight",
    "conv1d.weight": "conv1d.weight",
}
# transformers' hash buffers, checked against our layout rather than loaded
_BUFFERS = (
    "ple_embedding.layer_multipliers",
    "ple_embedding.ngram_heads_vocab_sizes",
    "ple_embedding.ngram_heads_offsets",
)


def _check_module(module: Engram) -> None:
    if not isinstance(module, Engram) or module.config.variant is not Variant.QWEN4_EXP_PLE:
        found = module.config.variant.value if isinstance(module, Engram) else type(module).__name__
        raise TypeError(
            f"Qwen4-Exp PLE weights load into an Engram module of variant 'qwen4-exp-ple', got {found}"
        )
    if not isinstance(module.table, TrainableTable):
        raise TypeError(
            f"the PLE table loads into a TrainableTable, this module has a {type(module.table).__name__}"
        )


def load_ple_layer(module: Engram, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Copy one PLE layer's weights (keys `prefix + PLE_KEYS`) into `module`, in place.

    Refuses (ValueError, naming the key) a missing or unexpected key under `prefix`, a shape that
    differs, or hash buffers that differ from the module's layout (another seed, base, vocabulary
    or layer index would address other rows). Nothing is copied unless everything checks.
    """
    _copy(module, _checked(module, state_dict, prefix))


def _copy(module: Engram, tensors: dict[str, torch.Tensor]) -> None:
    ours = dict(module.named_parameters())
    with torch.no_grad():
        for our_key, t in tensors.items():
            ours[our_key].copy_(t)


def _checked(module: Engram, state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """{our parameter name: tensor} of one PLE layer after every check of `load_ple_layer`."""
    _check_module(module)
    ours = dict(module.named_parameters())
    mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    missing = [k for k in PLE_KEYS if k not in mine]
    if missing:
        raise ValueError(
            f"the state dict lacks {', '.join(prefix + k for k in missing)} (a Qwen4-Exp PLE layer's)"
        )
    unexpected = sorted(set(mine) - set(PLE_KEYS) - set(_BUFFERS))
    if unexpected:
        raise ValueError(
            f"unexpected keys {[prefix + k for k in unexpected]} under {prefix!r}: not a Qwen4-Exp PLE layer "
            f"(expected {sorted(PLE_KEYS)})"
        )
    for theirs, our_key in PLE_KEYS.items():
        want = tuple(ours[our_key].shape)
        if tuple(mine[theirs].shape) != want:
            raise ValueError(
                f"{prefix + theirs} has shape {tuple(mine[theirs].shape)} but layer {module.layer_id}'s "
                f"{our_key} is {want}: the checkpoint is for another config (ple_embed_dim, hidden_size, "
                "hc_count, ngram sizes or table size)"
            )
    layer = Layout(module.config).layer(module.layer_id)
    expect = {
        "ple_embedding.layer_multipliers": list(layer.multipliers),
        "ple_embedding.ngram_heads_vocab_sizes": layer.flat_primes.tolist(),
        "ple_embedding.ngram_heads_offsets": layer.offsets.tolist(),
    }
    for key, want_list in expect.items():
        if key in mine and mine[key].tolist() != want_list:
            raise ValueError(
                f"{prefix + key} = {mine[key].tolist()} but config {module.config.name!r} gives {want_list} "
                f"for layer {module.layer_id}: the hash layouts differ (seed, ngram_vocab_size_base, vocab_size "
                "or PLE layer index)"
            )
    return {our_key: mine[theirs] for theirs, our_key in PLE_KEYS.items()}


def ple_prefix(state_dict: Mapping[str, torch.Tensor], layer_id: int) -> str:
    """The key prefix of decoder layer `layer_id`'s PLE in a Qwen4-Exp model's state dict."""
    tail = f"layers.{layer_id}.ple.ple_embedding.ngram_embedding.weight"
    found = [k for k in state_dict if k == tail or k.endswith("." + tail)]
    if len(found) != 1:
        raise ValueError(
            f"{'no' if not found else 'several'} keys ending in {tail!r} in the state dict"
            + (f": {found}" if found else "; is decoder layer " + str(layer_id) + " a PLE layer?")
        )
    return found[0][: -len("ple_embedding.ngram_embedding.weight")]


def load_ple_model(modules: Mapping[int, Engram], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load every module of `modules` ({0-based layer id: Engram}) from a whole Qwen4-Exp model's
    state dict (`model.state_dict()`); all layers are checked before any is copied."""
    prefixes = {lid: ple_prefix(state_dict, lid) for lid in modules}
    for lid, m in modules.items():
        _check_module(m)
        if m.layer_id != lid:
            raise ValueError(f"modules[{lid}] is the module of layer {m.layer_id}")
    # check everything first: a load that fails half-way would leave a mixed model
    checked = {lid: _checked(m, state_dict, prefixes[lid]) for lid, m in modules.items()}
    for lid, m in modules.items():
        _copy(m, checked[lid])
