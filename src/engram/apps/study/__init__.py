"""`engram study`: the paper's questions as training studies with seed spreads.

`plans` (every study's runs), `studies` (running them, cached and resumable), `report` (tables and
plots), `pretrained` / `pretrained_report` (Engram on a real pretrained model: SmolLM2 from its
GGUF), `probes` (memory vs generalisation probes of the held-out text). Design: docs/training.md.
"""
