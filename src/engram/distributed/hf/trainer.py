"""`EngramShardsCallback`: the HF Trainer's checkpoints of a model whose Engram tables are row-sharded
(`prepare_data_parallel`, `TableSync.SHARDED`), and their resume at any world size.

The Trainer writes the model and the optimizer state on rank 0 only; with sharded tables rank 0 holds
1/N of each table, so the model's state dict carries no table and the optimizer's state only the
tables' hyperparameters and which run and step they are of (see `ShardedTableSync`). This callback
adds the rest: on every save each owner rank writes its rows and their optimizer state to
`<checkpoint>/engram-shards/`, and a run resumed with `trainer.train(resume_from_checkpoint=...)` reads
back the rows it holds now before its first step: at the same world size bit-exact, at another one
with the rows redistributed, in one process (no process group) or with replicated tables every row.
Every rank checks the files it reads and the ranks agree before any step, so a bad file is one error
on every rank. A resume without the callback is refused at the first step. Imports transformers (the
`hf` extra).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from engram.distributed.hf.checkpoint import load_table_shards, pending_restore, save_table_shards
from engram.distributed.hf.data_parallel import ShardedTableSync
from engram.hf.attach import get_attachment

__all__ = ["EngramShardsCallback"]


class EngramShardsCallback(TrainerCallback):
    """The HF Trainer's checkpoints of row-sharded Engram tables, and their resume at any world size.

    Pass it to the Trainer (`callbacks=[EngramShardsCallback()]`) when the model's tables are
    row-sharded, and when a run resumes from such a checkpoint (whatever its world size or mode).
    Saves nothing for whole tables (the Trainer's own files hold them). Imports transformers.

    Args:
        resume_from: The checkpoint folder a run resumes from when it is not the Trainer's own
            `<output_dir>/checkpoint-<step>`.
    """

    def __init__(self, resume_from: str | os.PathLike[str] | None = None) -> None:
        self.resume_from = resume_from

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Write this rank's rows to the new checkpoint (`save_table_shards`), then wait for every rank.

        Args:
            args: The Trainer's TrainingArguments (its `output_dir`).
            state: The Trainer's state (its `global_step` names the checkpoint).
            control: The Trainer's control flags (unused).
            model: The model being trained.
            **kwargs: The Trainer's other callback arguments (unused).
        """
        sync = get_attachment(model).table_sync
        if not isinstance(sync, ShardedTableSync):
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        save_table_shards(model, folder)
        dist.barrier(group=sync.group)  # the checkpoint is whole before any rank goes on

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """On a resume, read back the rows from the checkpoint's shard files (`load_table_shards`).

        Args:
            args: The Trainer's TrainingArguments (its `output_dir`).
            state: The Trainer's state (its `global_step` names the checkpoint).
            control: The Trainer's control flags (unused).
            model: The model being trained.
            **kwargs: The Trainer's other callback arguments (unused).

        Raises:
            ValueError: The checkpoint folder does not exist (pass `resume_from`), or a shard file
                is refused.
        """
        if pending_restore(model)[0] is None:
            return
        folder = self.resume_from or os.path.join(
            args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        if not os.path.isdir(folder):
            raise ValueError(
                f"the run resumed at step {state.global_step} but {folder} does not exist: pass "
                "EngramShardsCallback(resume_from=<the checkpoint folder>)"
            )
        load_table_shards(model, folder)
