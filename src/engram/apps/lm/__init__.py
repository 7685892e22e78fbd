"""The small Engram LM's programs: `engram train`, `eval`, `generate`, `demo`.

`data` / `corpus` (the King James Bible split by book, tokenised, windows), `train_config` (the
run's frozen settings), `train` (the one-process trainer with exact resume), `train_distributed`
(the same loop on row-sharded tables under torchrun: `engram train --distributed`), `evaluation`
(held-out loss per category), `generate` (decoding with `HashStream`), `demo` (baseline vs Engram),
`rows` (the row ids a run looks up), `run_checkpoint` (a run's checkpoint folder). Design:
docs/training.md.
"""
