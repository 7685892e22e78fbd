"""Small Hugging Face models and a tiny tokenizer shared by the tests/test_hf_*.py files: random
weights from configs (hidden 32, 2-4 layers), a byte-level BPE of ~300 ids trained in memory."""

from __future__ import annotations

import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engram.config import EngramConfig

transformers = pytest.importorskip("transformers")

TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
] * 4
HIDDEN = 32


@functools.cache
def tokenizer() -> Tokenizer:
    """A byte-level BPE (256 bytes + <eos> + a few merges), trained on TEXT: about 300 ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer=trainer)
    return tok


@functools.cache
def compression():
    from engram.addressing.compression import TokenizerCompression

    return TokenizerCompression.from_tokenizer(tokenizer())


def vocab() -> int:
    return tokenizer().get_vocab_size(with_added_tokens=True)


def engram_config(layer_ids=(1,), hidden: int = HIDDEN, **kw) -> EngramConfig:
    comp = compression()
    return EngramConfig(
        name="hf-test",
        layer_ids=tuple(layer_ids),
        max_ngram_size=3,
        n_heads=2,
        engram_vocab_size=(257, 263),
        vocab_size=comp.vocab_size,
        compressed_vocab_size=comp.size,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=hidden,
        hc_mult=1,
        **kw,
    )


def llama(layers: int = 3, hidden: int = HIDDEN, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=1,
        **kw,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def save_folder(d, layers: int = 3, seed: int = 1):
    """A tiny random Llama (`llama`) saved as an HF folder `d` with its tokenizer (`tokenizer`, eos and
    pad `<eos>`): what the folder commands (hf-train, hf-eval, study pretrained) take; returns `d`."""
    llama(layers=layers, seed=seed).save_pretrained(d)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )
    tok.save_pretrained(d)
    return d


def encode(*texts: str) -> list[list[int]]:
    return [e.ids for e in tokenizer().encode_batch(list(texts))]


def batch(n: int = 2, t: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab(), (n, t), generator=g)
