"""`engram memorize` and `engram patch` (info, check), and the `--patch` of `hf-eval` and `generate`:
memory patches (`engram.memory`) written from a facts file for an HF model folder, and patch files read,
described and applied in order with refusals that name the file.

`files` (patch files: read, describe, apply), `memorize` (a folder's model taught a facts file, the
patch written; the patches a folder's model takes). Design: docs/memory.md.
"""
