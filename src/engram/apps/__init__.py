"""The programs: what the `engram` commands run (the commands themselves are `engram.cli`'s).

A room per thing you run, each with its own header:
- `lm/`: the small Engram LM on the King James Bible: data, `engram train` (one process and
  `--distributed` under torchrun), `eval`, `generate`, `engram demo`, checkpoint runs.
- `hf/`: `engram hf-train` / `hf-eval` on Hugging Face models (settings, corpus, output folder,
  callbacks, ranks).
- `study/`: `engram study` (memory, ablations, baselines, allocation, optimizers, pretrained): plans,
  runs, reports, probes.
- `memory/`: `engram memorize` and `engram patch` (info, check), and the patch files `hf-eval` and
  `generate` take with `--patch` (memory patches: `engram.memory`).
- `tools/`: `engram bench` (every benchmark, one table) and `engram run-layer`.
The library below (`engram.model`, `engram.hf`, `engram.distributed`, ...) never imports a program.
"""
