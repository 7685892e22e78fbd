"""The folder `engram hf-train` writes (the command is `engram.apps.hf.train`'s `train_folder`): once
the staged folder holds HF's files, the tokenizer and the Engram part, `write_out` adds the run's
summary (`engram_train.json`) and its model card (`README.md`, `model_card`), renames it to OUT in
one step and removes the partial folder. Knows the summary's fields, nothing of models or processes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from engram.apps.hf.folder import RUN_FILE

__all__ = ["CARD_FILE", "card_metadata", "model_card", "write_out"]

CARD_FILE = "README.md"  # in OUT: the model card


def write_out(stage: Path, out: str | os.PathLike[str], summary: dict[str, Any], work: Path) -> None:
    """Add the summary and the card to `stage`, rename it to `out` (absent or empty: checked before the
    run) and remove `work`, the partial folder that held it."""
    (stage / RUN_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    (stage / CARD_FILE).write_text(model_card(summary))
    o = Path(out)
    if o.is_dir():
        o.rmdir()  # empty (checked): the rename below replaces it
    os.replace(stage, o)
    shutil.rmtree(work)


def card_metadata(r: dict[str, Any]) -> str:
    """The card's YAML block, which the Hugging Face Hub indexes: the library that loads the folder, the
    base model (as hf-train was given it), tags, the corpus and the measured held-out loss (`model-index`).
    Each value is written as a JSON string or number, which YAML reads as it is."""
    s, held = r["settings"], r["held_out"]
    name = Path(r["out"]).name
    corpus = Path(str(s["corpus"])).name
    split = f"{corpus} (held-out {s['held_out']:.0%})"
    tags = ["engram", "engram-lm", "text-generation"] + (["custom_code"] if r["engram"] is not None else [])
    lines = [
        "---",
        "library_name: transformers",
        f"base_model: {json.dumps(str(r['backbone']['folder']))}",
        "pipeline_tag: text-generation",
        "tags:",
        *(f"- {t}" for t in tags),
        "datasets:",
        f"- {json.dumps(corpus)}",
    ]
    if held:
        lines += [
            "model-index:",
            f"- name: {json.dumps(name)}",
            "  results:",
            "  - task:",
            "      type: text-generation",
            "      name: Causal language modeling",
            "    dataset:",
            f"      name: {json.dumps(split)}",
            "      type: text",
            "    metrics:",
            "    - type: loss",
            f"      value: {held['loss']:.6f}",
            "      name: Held-out loss (nats/token)",
            "    - type: perplexity",
            f"      value: {held['perplexity']:.4f}",
            "      name: Held-out perplexity",
        ]
    return "\n".join([*lines, "---", ""])


def model_card(r: dict[str, Any]) -> str:
    """The card (OUT/README.md) of a run's summary: the Hub's metadata block, what was attached and
    trained, the losses, how to load it."""
    s, b, e = r["settings"], r["backbone"], r["engram"]
    mode = {
        "frozen": "backbone frozen (Engram alone trained)",
        "lora": f"LoRA rank {r['lora_rank']} on the decoder layers' linear layers, merged into the weights",
        "full": "every parameter trained",
    }[r["mode"]]
    lines = [
        card_metadata(r),
        f"# {Path(r['out']).name}",
        "",
        f"`{b['class']}` from `{b['folder']}` ({b['layers']} layers, hidden {b['hidden_size']}, "
        f"{b['parameters']:,} parameters), continued by `engram hf-train` on `{s['corpus']}`.",
        "",
    ]
    if e is None:
        lines.append("- Engram: none (`--no-engram`: the baseline)")
    else:
        lines.append(
            f"- Engram attached at decoder layer(s) {e['layers']}: {e['rows_per_layer']:,} table rows "
            "a layer "
            f"(n-gram orders {e['orders']}, {e['heads']} hash heads, rows {e['head_dim']} wide), "
            f"{e['table_parameters']:,} table parameters, {e['parameters']:,} in all; the value projection "
            "started at zero (the model unchanged at step 0)"
            + (
                "; n-gram windows restart after EOS (documents are packed)"
                if e["boundaries"] == "eos"
                else ""
            )
            + ". The part is in `engram/`."
        )
    held = r["held_out"]
    lines += [
        f"- Training: {mode}; {r['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens = "
        f"{r['tokens']:,} "
        f"tokens ({r['tokens'] / max(r['train_seconds'], 1e-9):.0f} tokens/s); lr {s['lr']:g}"
        + (f", table lr {s['table_lr']:g}" if e else "")
        + f", seed {s['seed']}"
        + (
            f"; on {r['processes']} processes (the batch split over them, the tables {r['table_sync']})."
            if r.get("processes", 1) > 1 and e
            else f"; on {r['processes']} processes (the batch split over them)."
            if r.get("processes", 1) > 1
            else "."
        ),
        f"- Final training loss: {r['final_train_loss']:.4f}." if r["final_train_loss"] is not None else "",
        (
            f"- Held-out loss (last {s['held_out']:.0%} of the corpus): {held['loss']:.4f} nats/token "
            f"(perplexity {held['perplexity']:.2f}) over {held['tokens']:,} tokens; before training "
            f"{r['held_out_before']['loss']:.4f}."
        )
        if held
        else "",
        "",
        "Load it (with engram-lm installed: `import engram` registers the Engram model type; or pass "
        "`trust_remote_code=True`, whose `modeling_engram.py` imports engram-lm):"
        if e is not None
        else "Load it:",
        "",
        "```python",
        "import transformers",
        *(["import engram  # the Engram model type"] if e is not None else []),
        f'model = transformers.AutoModelForCausalLM.from_pretrained("{Path(r["out"]).name}")',
        "```",
        "",
        f"`engram hf-eval {Path(r['out']).name} --corpus {s['corpus']}` measures it again.",
        "",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"
