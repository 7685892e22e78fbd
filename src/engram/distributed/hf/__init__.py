"""Engram on Hugging Face models across processes: one concept, one room.

`data_parallel` (`prepare_data_parallel`: the tables kept out of DDP / accelerate / the Trainer and
synchronised by Engram, sharded or replicated), `checkpoint` (their sharded tables' checkpoints and
the Engram part, `save_engram` / `export_fp8` / `export_quantised` / `load_table_shards`), `part`
(that part written by every rank, its own rows, without a gather, in float or any row format),
`fsdp` (the HF backbone under FSDP2, the tables kept out), `trainer` (`EngramShardsCallback` for the
Trainer's checkpoints; imports transformers). The public names are re-exported by
`engram.distributed`. Design: docs/distributed.md.
"""
