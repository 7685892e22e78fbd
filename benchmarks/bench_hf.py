"""Engram on a Hugging Face Llama (`engram.hf`): a training step and `generate()` per new token, with
Engram at one layer against the plain model, measured in the same run.

    python benchmarks/bench_hf.py [--hidden 256] [--layers 4] [--batch 8] [--seq 256] [--steps 8]
                                  [--new-tokens 48] [--repeats 5]

Both models are the same random `LlamaForCausalLM` (vocabulary 8192, from a config); the Engram one
has `engram.hf.add_engram` at layer 1 (3-grams, 4 heads per order, rows of 32, about 0.3M rows,
rows hashed inside forward from input_ids). Training step: forward, backward and optimizer step
(AdamW for the plain model; `engram.hf.build_optimizer` for the Engram one: AdamW plus the sparse
row optimizer on the table), the best of `repeats * steps` steps, the two models stepping in turn.
Generation: greedy `generate()` at batch `batch` from a 32-token prompt with the KV cache; the time
per new token is (best time for `new_tokens` tokens - best time for 1 token) / (new_tokens - 1), so
the prefill cancels out; the models alternate in each of `repeats` rounds. Best-of timings, taken
in turn, keep a busy machine's load spikes out of the ratio. The ratio is Engram's time over the
plain model's (a slowdown: lower is better). Targets (issue 13): training step <= 1.15x,
generate per token <= 1.10x.
"""

from __future__ import annotations

import argparse
import time

import torch

from engram.addressing.compression import TokenizerCompression
from engram.config import EngramConfig

VOCAB = 8192


def _models(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    from engram.hf import add_engram

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    with_engram = transformers.LlamaForCausalLM(cfg)
    with_engram.load_state_dict(plain.state_dict())
    econfig = EngramConfig(
        name="bench-hf",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(40_000, 40_000),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=hidden,
        hc_mult=1,
    )
    identity = TokenizerCompression.identity(VOCAB, fingerprint="bench-identity")
    add_engram(with_engram, econfig, compression=identity)
    with torch.no_grad():  # a trained-looking Engram (its value projection is not zero)
        with_engram.engram.module(1).wkv.weight.normal_(std=0.02)
    return plain, with_engram


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(
    hidden: int = 256,
    layers: int = 4,
    batch: int = 8,
    seq: int = 256,
    steps: int = 8,
    new_tokens: int = 48,
    repeats: int = 5,
) -> list[dict]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("needs transformers (pip install engram-lm[hf])") from e
    from engram.hf import build_optimizer

    plain, eng = _models(hidden, layers)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(2, VOCAB, (batch, seq), generator=g)
    prompt = torch.randint(2, VOCAB, (batch, 32), generator=g)
    mask = torch.ones_like(prompt)

    # ---- training step
    plain.train()
    eng.train()
    opts = {
        "plain": torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0),
        "engram": build_optimizer(eng, lr=1e-4, table_lr=1e-3),
    }
    models = {"plain": plain, "engram": eng}
    train = {k: float("inf") for k in models}
    for k in models:  # warm-up (numba, allocator, optimizer state)
        _train_step(models[k], opts[k], data)
    for _ in range(repeats * steps):  # one step of each in turn: a load spike hits one step, not a model
        for k in models:
            t0 = time.perf_counter()
            _train_step(models[k], opts[k], data)
            train[k] = min(train[k], time.perf_counter() - t0)

    # ---- generate() per new token
    plain.eval()
    eng.eval()

    def gen(model: torch.nn.Module, n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == prompt.shape[1] + n
        return time.perf_counter() - t0

    full = {k: float("inf") for k in models}
    one = {k: float("inf") for k in models}
    for k in models:
        gen(models[k], 2)
    for _ in range(repeats):
        for k in models:
            full[k] = min(full[k], gen(models[k], new_tokens))
            one[k] = min(one[k], gen(models[k], 1))
    per_token = {k: (full[k] - one[k]) / (new_tokens - 1) for k in models}

    shape = f"Llama {hidden}x{layers}"
    return [
        {
            "variant": f"train step / plain's, {shape}, {batch}x{seq} tok",
            "seconds": train["engram"],
            "baseline_seconds": train["plain"],
            "baseline": "the plain model's step",
            "ratio": train["engram"] / train["plain"],
            "target": 1.15,
        },
        {
            "variant": f"generate() per token / plain's, {shape}",
            "seconds": per_token["engram"],
            "baseline_seconds": per_token["plain"],
            "baseline": "the plain model's generate()",
            "ratio": per_token["engram"] / per_token["plain"],
            "target": 1.10,
            "batch": batch,
        },
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"engram.hf, torch {torch.__version__} with {torch.get_num_threads()} threads")
    for r in run(a.hidden, a.layers, a.batch, a.seq, a.steps, a.new_tokens, a.repeats):
        print(
            f"{r['variant']:<78} {r['seconds'] * 1e3:8.2f} ms vs {r['baseline_seconds'] * 1e3:8.2f} ms   "
            f"ratio {r['ratio']:.3f}x (target <= {r['target']}x)"
        )


if __name__ == "__main__":
    main()
