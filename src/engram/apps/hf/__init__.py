"""`engram hf-train` / `hf-eval`: Engram on a Hugging Face causal LM, trained and scored.

`train` (the program: attach, train with the HF Trainer, save the folder), `settings` (the run's
checked settings), `corpus` (text to token windows), `folder` (the output folder: base model +
Engram part, written atomically), `out` (what is written where), `callbacks` (the Trainer's hooks),
`ranks` (one run on several processes: the ranks agree before they write). The library it drives is
`engram.hf` (one process) and `engram.distributed` (several). Design: docs/training.md.
"""
