"""Loading an Engram model's folder with from_pretrained, against from_pretrained + load_engram.

`AutoModelForCausalLM.from_pretrained(folder)` (the part checked and attached by `engram.hf.auto`)
against what it replaces, the backbone's class `from_pretrained` then `engram.hf.load_engram` of the
same folder, measured in the same run.

    python benchmarks/bench_hf_load.py [--hidden 512] [--layers 8] [--rows 500000] [--repeats 5]

The folder is a random Llama (vocabulary 8192) with Engram at layers 1 and 3 (rows of 64 wide, about
`rows` a layer: 2 x 128 MB of float32 tables at the default), written by `save_pretrained`. Both ways
read the same files (in the page cache after the warm-up: the work compared is checking, building and
attaching, not the disk), check every tensor's CRC32 and give bit-equal logits (checked). The two
loads alternate round by round and each keeps its best time, so a load spike hits one load, not one
way. Ratio: from_pretrained's time over the two-step load's (target <= 1.1x, issue 45).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch

from engram.addressing.compression import TokenizerCompression
from engram.config import EngramConfig

VOCAB = 8192


def _write(folder: Path, hidden: int, layers: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers

    from engram.hf import add_engram

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    econfig = EngramConfig(
        name="bench-hf-load",
        layer_ids=(1, 3),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(rows // 8, rows // 8),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=64,
        hidden_size=hidden,
        hc_mult=1,
    )
    add_engram(model, econfig, compression=TokenizerCompression.identity(VOCAB), zero_init=False, seed=0)
    model.save_pretrained(folder)
    ids = torch.randint(2, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits, ids


def run(hidden: int = 512, layers: int = 8, rows: int = 500_000, repeats: int = 5) -> list[dict]:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("needs transformers (pip install engram-lm[hf])") from e
    import engram.hf
    from engram.hf.io import TokenizerNotCheckedWarning

    with tempfile.TemporaryDirectory(prefix="bench-hf-load-") as tmp:
        folder = Path(tmp) / "model"
        ref, ids = _write(folder, hidden, layers, rows)
        table_mb = sum(p.stat().st_size for p in (folder / "engram").glob("*.safetensors")) / 2**20

        def auto() -> torch.nn.Module:
            return transformers.AutoModelForCausalLM.from_pretrained(folder)

        def two_step() -> torch.nn.Module:
            return engram.hf.load_engram(transformers.LlamaForCausalLM.from_pretrained(folder), folder)

        best = {"auto": float("inf"), "two-step": float("inf")}
        ways = {"auto": auto, "two-step": two_step}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TokenizerNotCheckedWarning)  # no tokenizer.json: an identity map
            for name, fn in ways.items():  # warm-up: the page cache, numba, transformers' imports
                with torch.no_grad():
                    if not torch.equal(fn()(ids).logits, ref):
                        raise RuntimeError(f"{name}: the loaded model's logits differ from the saved model's")
            for _ in range(repeats):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t0)
    return [
        {
            "variant": f"from_pretrained / from_pretrained + load_engram, Llama {hidden}x{layers}, "
            f"{table_mb:.0f} MB of tables",
            "seconds": best["auto"],
            "baseline_seconds": best["two-step"],
            "baseline": "the backbone's from_pretrained, then load_engram",
            "ratio": best["auto"] / best["two-step"],
            "target": 1.1,
        }
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"engram.hf.auto, torch {torch.__version__} with {torch.get_num_threads()} threads")
    for r in run(a.hidden, a.layers, a.rows, a.repeats):
        print(
            f"{r['variant']:<80} {r['seconds'] * 1e3:8.1f} ms vs {r['baseline_seconds'] * 1e3:8.1f} ms   "
            f"ratio {r['ratio']:.3f}x (target <= {r['target']}x)"
        )


if __name__ == "__main__":
    main()
