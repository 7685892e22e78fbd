"""The HF Trainer's callbacks of an `engram hf-train` run (`engram.apps.hf.train`) and the checkpoints
they leave: the progress bar (rank 0's), the Engram part beside peft's adapters in a LoRA run's
checkpoints (peft saves the adapters only), each rank's rows of row-sharded tables
(`engram.distributed.EngramShardsCallback`), and a mark written last, once every part of a checkpoint
is on disk, which `latest_checkpoint` looks for on resume. Knows the Trainer's callbacks, nothing of
the run's settings.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COMPLETE", "ENGRAM_STATE", "TrainLog", "latest_checkpoint", "trainer_callbacks"]

ENGRAM_STATE = "engram_state.safetensors"  # in a LoRA run's checkpoints: peft saves the adapters only
COMPLETE = "hf-train-complete"  # in a checkpoint: every rank's part of it is written


@dataclass
class TrainLog:
    """What the callbacks keep of a run for its summary: the logged training losses (step, loss)."""

    losses: list[tuple[int, float]] = field(default_factory=list)


def trainer_callbacks(progress: bool, log: TrainLog, save_engram_state: bool, sharded: bool) -> list[Any]:
    """The Trainer's callbacks, in the order their on_save runs: the bar, the Engram part beside peft's
    adapters, each rank's rows of row-sharded tables, then the checkpoint's completion mark."""
    import transformers
    from tqdm.auto import tqdm

    class Progress(transformers.TrainerCallback):
        """A tqdm bar on stderr (the training loss beside it); the losses kept for the card."""

        bar: Any = None

        def on_train_begin(self, args, state, control, **kw):
            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                desc="hf-train",
                unit="step",
                disable=not progress,
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10,
            )

        def on_step_end(self, args, state, control, **kw):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:  # the mean over the ranks
                log.losses.append((state.global_step, float(logs["loss"])))
                self.bar.set_postfix(loss=f"{logs['loss']:.3f}")

        def on_train_end(self, args, state, control, **kw):
            self.bar.close()

    class EngramState(transformers.TrainerCallback):
        """peft's checkpoints hold the adapters only: the Engram part goes beside them (rank 0's: the
        same on every rank; without row-sharded tables, whose rows are in the shard files)."""

        def on_save(self, args, state, control, model=None, **kw):
            from safetensors.torch import save_file

            from engram.hf.attach import get_attachment

            if not state.is_world_process_zero:
                return
            att = get_attachment(model)
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            tmp = ckpt / (ENGRAM_STATE + ".tmp")
            save_file({k: v.detach().contiguous() for k, v in att.state_dict().items()}, str(tmp))
            os.replace(tmp, ckpt / ENGRAM_STATE)

    class Complete(transformers.TrainerCallback):
        """The mark a resume looks for, written last (after the shard files' barrier)."""

        def on_save(self, args, state, control, **kw):
            if state.is_world_process_zero:
                (Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE).write_text("")

    out: list[Any] = [Progress()]
    if save_engram_state:
        out.append(EngramState())
    if sharded:
        from engram.distributed import EngramShardsCallback

        out.append(EngramShardsCallback())
    return [*out, Complete()]


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint-N in `folder` (its `COMPLETE` mark written last, by rank 0 once
    every rank's part of it is written)."""
    found = []
    for p in folder.glob("checkpoint-*") if folder.is_dir() else []:
        step = p.name.partition("-")[2]
        if step.isdigit() and (p / COMPLETE).is_file():
            found.append((int(step), p))
    return max(found)[1] if found else None
