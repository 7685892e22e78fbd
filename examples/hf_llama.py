"""Engram on a Hugging Face Llama, trained with the HF Trainer on the King James Bible.

    python examples/hf_llama.py            # a few minutes on 2 CPU cores
    python examples/hf_llama.py --quick    # seconds: a smoke run

Builds a small `LlamaForCausalLM` from a `LlamaConfig` (random weights) twice with the same
initial weights: once plain, once with `engram.hf.add_engram` at layer 1. Both train with the HF
`Trainer` for the same steps on the same batches (the Engram one with `engram.hf.build_optimizer`:
AdamW for the backbone and Engram's projections, a sparse row optimizer for the table), then the
held-out loss of both is printed, and the Engram model continues a prompt with `generate()`.
The tokenizer is a byte-level BPE trained on the corpus (`engram.apps.lm.data.train_bpe`, cached).
Needs transformers and accelerate (`pip install engram-lm[hf] accelerate`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch

from engram import EngramConfig
from engram.apps.lm.corpus import kjv_verses
from engram.apps.lm.data import EOS, train_bpe
from engram.hf import EngramCollator, add_engram, build_optimizer


def token_blocks(tokenizer, texts: list[str], seq: int) -> list[list[int]]:
    """The texts joined by EOS as one id stream, cut into blocks of `seq` tokens."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return [ids[i : i + seq] for i in range(0, len(ids) - seq + 1, seq)]


def plain_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids.clone()}


@torch.no_grad()
def held_out_loss(model, blocks: list[list[int]], batch: int = 16) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(blocks), batch):
        ids = torch.tensor(blocks[i : i + batch])
        total += model(input_ids=ids, labels=ids).loss.item() * ids.shape[0]
        n += ids.shape[0]
    model.train()
    return total / n


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300, --quick 4)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import transformers

    torch.set_num_threads(args.threads)
    quick = args.quick
    steps = args.steps or (4 if quick else 300)
    verses = [v["text"] for v in kjv_verses()]
    if quick:
        verses = verses[:3000]
    vocab, hidden, layers, seq, batch = (1024, 64, 2, 64, 8) if quick else (4096, 128, 4, 128, 16)

    t0 = time.perf_counter()
    tok = train_bpe(verses, vocab_size=vocab)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    blocks = token_blocks(tok, verses, seq)
    n_held = max(8, len(blocks) // 50)
    train_blocks, held = blocks[:-n_held], blocks[-n_held:]
    held = held[: 32 if quick else 256]
    print(
        f"corpus: {len(verses)} verses, {len(blocks)} blocks of {seq} tokens, vocabulary {vocab} "
        f"({time.perf_counter() - t0:.1f}s)"
    )

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=seq * 4,
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(EOS),
        bos_token_id=tok.token_to_id(EOS),
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(plain.state_dict())  # the same initial backbone

    from engram.addressing.compression import TokenizerCompression

    compression = TokenizerCompression.from_tokenizer(tok)
    engram_config = EngramConfig(
        name="hf-llama-example",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(20_000, 20_000) if not quick else (2_000, 2_000),
        vocab_size=vocab,
        compressed_vocab_size=compression.size,
        pad_token_id=tok.token_to_id(EOS),
        tokenizer=None,
        head_dim=32,
        hidden_size=hidden,
        hc_mult=1,
    )
    add_engram(model, engram_config, compression=compression)
    n_table = sum(p.numel() for p in model.engram.tables())
    print(
        f"Llama: hidden {hidden}, {layers} layers, {sum(p.numel() for p in plain.parameters()) / 1e6:.2f}M "
        f"parameters; Engram at layer 1 adds a table of {n_table / 1e6:.2f}M"
    )

    lr = 2e-3
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as out:
        for name, m in (("plain", plain), ("engram", model)):
            targs = transformers.TrainingArguments(
                output_dir=f"{out}/{name}",
                max_steps=steps,
                per_device_train_batch_size=batch,
                learning_rate=lr,
                warmup_steps=max(1, steps // 20),
                lr_scheduler_type="cosine",
                logging_steps=max(1, steps // 10),
                report_to="none",
                save_strategy="no",
                use_cpu=True,
                seed=0,
                disable_tqdm=True,
            )
            kw: dict = {"data_collator": plain_collate}
            if name == "engram":
                kw = {
                    "data_collator": EngramCollator(m, pad_token_id=cfg.pad_token_id),
                    "optimizers": (build_optimizer(m, lr=lr, table_lr=1e-2), None),
                }
            feats = [{"input_ids": b} for b in train_blocks]
            trainer = transformers.Trainer(model=m, args=targs, train_dataset=feats, **kw)
            t0 = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - t0
            loss = held_out_loss(m, held)
            results[name] = loss
            results[f"{name}_seconds"] = seconds
            print(
                f"{name:>7}: {steps} steps in {seconds:.0f}s, held-out loss {loss:.3f} "
                f"(perplexity {math.exp(loss):.1f})"
            )

    prompt = torch.tensor([tok.encode("And God said").ids])
    out_ids = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24 if not quick else 8,
        do_sample=False,
        pad_token_id=cfg.pad_token_id,
    )
    text = tok.decode(out_ids[0].tolist())
    results["generated_tokens"] = out_ids.shape[1] - prompt.shape[1]
    print(f"generate(): {text!r}")
    return results


if __name__ == "__main__":
    main()
