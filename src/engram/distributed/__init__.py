"""Distributed training for Engram (torch.distributed; gloo on CPU, NCCL on GPU): the library a user's
own training script imports. It knows no program of ours (the small LM's multi-process trainer is
`engram.apps.lm.train_distributed`).

The only package that imports torch.distributed: the model code (`engram.model.module`,
`engram.model.lm`) stays single-device, and this layer wraps it (torchtitan style). One concept
per file: `sharded_table` (the row-sharded table and the step's row exchange), `parallelize`
(sharding a model, the dense all-reduce), `guard` (ranks agree before they act; collectives time out
into an error naming the rank and the step), `wrappers` (whether DDP / FSDP holds a model already,
or took a parameter over), `memory_budget` (whether a rank's shard of the tables fits its memory
limits, said on every rank before any row is allocated), `launch` (one rank from torchrun's
environment), `sinkhorn` (the Sinkhorn-balanced table update on shards), `shard_checkpoint` (the
ranks' agreement on shard files), `exchange_stats` (the exchange's counters), and the room `hf/`
(Engram on HF models under DDP, accelerate, FSDP2 and the Trainer: `engram.distributed.hf`).
Launch: `torchrun --nproc_per_node 2 -m engram train --preset tiny --distributed --out DIR`.
Design: docs/distributed.md.
"""

from engram.distributed.guard import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    RankError,
    all_values,
    bounded_group,
    chunks_digest,
    describe,
    differing,
    disagreements,
    named_failures,
    tensor_digest,
)
from engram.distributed.hf.checkpoint import (
    SHARDS_FOLDER,
    export_fp8,
    export_quantised,
    load_table_shards,
    save_engram,
    save_table_shards,
)
from engram.distributed.hf.data_parallel import (
    SHARDED_STATE_KEY,
    ReplicatedTableSync,
    ShardedTableSync,
    TableSync,
    prepare_data_parallel,
)
from engram.distributed.hf.fsdp import fully_shard_backbone
from engram.distributed.launch import TORCHRUN_VARS, Backend, DistEnv, init_distributed, rank_backend
from engram.distributed.memory_budget import ShardMemoryError
from engram.distributed.parallelize import (
    TableInit,
    all_reduce_grads,
    build_sharded_model,
    global_num_params,
    prefetch_model_rows,
    shard_engram_tables,
    sharded_tables,
    split_sharded_params,
    table_owners,
)
from engram.distributed.sharded_table import (
    INIT_CHUNK_ROWS,
    ShardedTable,
    check_owners,
    chunked_normal,
    gather_shards,
    prefetch_tables,
    release_tables,
    shard_bounds,
    sync_table_grads,
)
from engram.distributed.sinkhorn import ShardedSinkhorn

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "INIT_CHUNK_ROWS",
    "SHARDED_STATE_KEY",
    "SHARDS_FOLDER",
    "TORCHRUN_VARS",
    "Backend",
    "DistEnv",
    "EngramShardsCallback",
    "RankError",
    "ReplicatedTableSync",
    "ShardMemoryError",
    "ShardedSinkhorn",
    "ShardedTable",
    "ShardedTableSync",
    "TableInit",
    "TableSync",
    "all_reduce_grads",
    "all_values",
    "bounded_group",
    "build_sharded_model",
    "check_owners",
    "chunked_normal",
    "chunks_digest",
    "describe",
    "differing",
    "disagreements",
    "export_fp8",
    "export_quantised",
    "fully_shard_backbone",
    "gather_shards",
    "global_num_params",
    "init_distributed",
    "load_table_shards",
    "named_failures",
    "prefetch_model_rows",
    "prefetch_tables",
    "prepare_data_parallel",
    "rank_backend",
    "release_tables",
    "save_engram",
    "save_table_shards",
    "shard_bounds",
    "shard_engram_tables",
    "sharded_tables",
    "split_sharded_params",
    "sync_table_grads",
    "table_owners",
    "tensor_digest",
]


MOVED_TO_APPS = ("DistributedTrainer", "build_distributed_model")


def __getattr__(name: str):  # EngramShardsCallback imports transformers: loaded on first use
    if name == "EngramShardsCallback":
        from engram.distributed.hf.trainer import EngramShardsCallback

        return EngramShardsCallback
    if name in MOVED_TO_APPS:  # the small LM's trainer is a program: it moved up with the others
        raise AttributeError(
            f"engram.distributed.{name} moved to engram.apps.lm.train_distributed (the small LM's "
            f"multi-process trainer is a program, not part of the library): "
            f"from engram.apps.lm.train_distributed import {name}"
        )
    raise AttributeError(f"module 'engram.distributed' has no attribute {name!r}")
