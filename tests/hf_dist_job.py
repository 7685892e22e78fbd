"""Training jobs for tests/test_distributed_hf_trainer.py: a float64 tiny Llama with Engram trained by
the HF `Trainer` or by a manual `accelerate` loop, on every rank of a torchrun launch (gloo, CPU:
tests/dist_launch.py, which calls `job` with a `Run`'s fields), or in one process (no process group)
for the reference.

The runs of a world size run one after the other in the suite's launch of that size (one launch pays
the start-up once), and every rank saves `<name>-rank-<r>.pt` there: its final `state_dict`
(row-sharded tables gathered whole on rank 0, left out elsewhere), the micro-batches it trained on,
what DDP ignored, and how accelerate saw the launch. A run that raises records the traceback instead
(the same on every rank: the runs are deterministic).

Every run has the same data: STEPS optimizer steps of `batch * accum` sequences of T tokens, in file
order. A rank takes micro-batches of batch/W: the Trainer's and accelerate's sharded dataloader give
rank r the r-th of every W consecutive micro-batches, so the W ranks' micro-batches of a step are
together the one-process step's batch. The loss is our float64 next-token mean (HF's own casts the
logits to float32) and Llama's RMSNorm is kept in float64 (`rms_norm_in_its_dtype`), so that the
rank count only moves the last bits.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_setup as S
from engram.hf import EngramCollator, add_engram, build_optimizer, get_attachment

STEPS, T = 3, 10
LR, TABLE_LR = 1e-2, 5e-2


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    kind: str = "trainer"  # "trainer" (transformers.Trainer), "accelerate" (a manual Accelerator loop)
    # or "loop" (a plain loop, no wrapper: one process's reference)
    batch: int = 4  # sequences per micro-batch over all ranks (each rank: batch / W)
    accum: int = 1  # gradient accumulation steps
    table_optimizer: str = "adam"
    mode: str | None = None  # prepare_data_parallel's mode (None: its default)
    freeze_backbone: bool = False
    lora: bool = False  # peft LoRA on q_proj and v_proj (then the backbone is frozen)
    save_steps: int = 0  # the Trainer checkpoints every save_steps steps (with EngramShardsCallback)
    resume: str | None = None  # the Trainer resumes from checkpoint-1 of this run (its output folder)
    callback: bool = True  # EngramShardsCallback in the Trainer's callbacks
    # Resume from a copy of `resume`'s checkpoint-1 (in this run's folder) whose rank-00001 shard file
    # rank 0 damaged first: "flip" (a data byte), "missing", "foreign:<run>" (that run's checkpoint-1 file),
    # "later" (the same run's checkpoint-2 file, its header's step edited to 1)
    damage: str | None = None


def rms_norm_in_its_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm without its cast to float32, so that a float64 model computes in float64."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def build_model(lora: bool = False) -> torch.nn.Module:
    """The same model on every rank and in every run (seeded)."""
    model = add_engram(S.llama(seed=3), S.engram_config(), compression=S.compression()).double()
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.3)  # zero-init would leave the table no gradient
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model


def features(n: int) -> list[dict[str, list[int]]]:
    """n sequences of T tokens (no padding: every micro-batch mean weighs each token alike)."""
    return [{"input_ids": row.tolist()} for row in S.batch(n, T, seed=50)]


def next_token_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next-token cross-entropy of the micro-batch, in float64, labels from input_ids."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, engram_rows=batch["engram_rows"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _trainer_cls():
    import transformers

    class FloatTrainer(transformers.Trainer):
        """compute_loss: our float64 mean of the micro-batch (the Trainer divides it by the accumulation
        steps: `loss_is_scaled_for_ga = False`); records every micro-batch it trains on."""

        loss_is_scaled_for_ga = False

        def __init__(self, *a, seen: list, **kw) -> None:
            super().__init__(*a, **kw)
            self.seen = seen

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.seen.append((self.state.global_step, inputs["input_ids"].tolist()))
            loss = next_token_loss(model, inputs)
            return (loss, None) if return_outputs else loss

    return FloatTrainer


def _train_trainer(run: Run, model, opt, collate, data, world: int, out: Path, res: dict) -> Any:
    import transformers

    from engram.distributed import EngramShardsCallback

    folder = out / f"{run.name if run.damage else run.resume or run.name}-trainer"
    if run.damage:
        _damaged_copy(run, out, folder / "checkpoint-1")
    args = transformers.TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=run.batch // world,
        gradient_accumulation_steps=run.accum,
        max_steps=STEPS,
        learning_rate=LR,  # unused: the optimizer is ours; the constant schedule keeps its groups' lr
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,  # no clipping
        average_tokens_across_devices=False,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        seed=0,
        report_to=[],
        save_strategy="steps" if run.save_steps else "no",
        save_steps=run.save_steps or 500,
        save_only_model=False,
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = _trainer_cls()(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=collate,
        optimizers=(opt, None),
        seen=res["seen"],
        callbacks=[EngramShardsCallback()] if run.callback else [],
    )
    trainer.train(resume_from_checkpoint=str(folder / "checkpoint-1") if run.resume else None)
    res["world_size"] = trainer.args.world_size
    res["distributed_type"] = trainer.accelerator.distributed_type.value
    res["num_processes"] = trainer.accelerator.num_processes
    return trainer.model_wrapped


def _damaged_copy(run: Run, out: Path, dest: Path) -> None:
    """Rank 0 copies `run.resume`'s checkpoint-1 to `dest` and damages its rank-00001 shard file as
    `run.damage` says; every rank waits for it."""
    import shutil

    if not dist.is_initialized() or dist.get_rank() == 0:
        src = out / f"{run.resume}-trainer"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src / "checkpoint-1", dest)
        shard = dest / "engram-shards" / "rank-00001.safetensors"
        kind, _, other = run.damage.partition(":")
        if kind == "flip":
            raw = bytearray(shard.read_bytes())
            raw[-3] ^= 0x20  # a byte of the last tensor's data
            shard.write_bytes(bytes(raw))
        elif kind == "missing":
            shard.unlink()
        elif kind == "foreign":
            shutil.copy(out / f"{other}-trainer" / "checkpoint-1" / shard.relative_to(dest), shard)
        elif kind == "later":
            raw = (src / "checkpoint-2" / shard.relative_to(dest)).read_bytes()
            edited = raw.replace(b'\\"step\\": 2', b'\\"step\\": 1')
            assert len(edited) == len(raw) and edited != raw
            shard.write_bytes(edited)
        else:
            raise ValueError(f"damage={run.damage!r}")
    if dist.is_initialized():
        dist.barrier()


def _train_accelerate(run: Run, model, opt, collate, data, world: int, res: dict) -> Any:
    import accelerate

    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=run.accum)
    res["world_size"] = world
    res["distributed_type"] = acc.distributed_type.value
    res["num_processes"] = acc.num_processes
    dl = torch.utils.data.DataLoader(data, batch_size=run.batch // world, shuffle=False, collate_fn=collate)
    wrapped, opt, dl = acc.prepare(model, opt, dl)
    step = 0
    for batch in dl:
        with acc.accumulate(wrapped):
            res["seen"].append((step, batch["input_ids"].tolist()))
            acc.backward(next_token_loss(wrapped, batch))
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if step == STEPS:
                break
    return wrapped


def _train_loop(run: Run, model, opt, collate, data, res: dict) -> Any:
    for step in range(STEPS):
        for micro in range(run.accum):
            first = (step * run.accum + micro) * run.batch
            batch = collate(data[first : first + run.batch])
            res["seen"].append((step, batch["input_ids"].tolist()))
            (next_token_loss(model, batch) / run.accum).backward()
        opt.step()
        opt.zero_grad()
    return model


def train(run: Run, out: Path) -> dict[str, Any]:
    """One run on this process (every rank of the group, or alone): its result dict (see the module
    docstring). `out`: where the Trainer may write (it writes nothing here: save_strategy='no')."""
    from engram.distributed import prepare_data_parallel

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    res: dict[str, Any] = {"error": None, "seen": [], "ignored": None, "mode": None}
    model = build_model(run.lora)
    if distributed:
        res["mode"] = str(prepare_data_parallel(model, run.mode))
    opt = build_optimizer(
        model,
        lr=LR,
        table_lr=TABLE_LR,
        table_optimizer=run.table_optimizer,
        freeze_backbone=run.freeze_backbone or run.lora,
    )
    collate = EngramCollator(model, pad_token_id=0)
    data = features(STEPS * run.batch * run.accum)
    if run.kind == "trainer":
        wrapped = _train_trainer(run, model, opt, collate, data, world, out, res)
    elif run.kind == "accelerate":
        wrapped = _train_accelerate(run, model, opt, collate, data, world, res)
    elif run.kind == "loop":
        wrapped = _train_loop(run, model, opt, collate, data, res)
    else:
        raise ValueError(f"kind={run.kind!r}")
    if wrapped is not model:
        res["ignored"] = sorted(getattr(wrapped, "parameters_to_ignore", ()))
        res["wrapper"] = type(wrapped).__name__
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sync = get_attachment(model).table_sync
    if getattr(sync, "mode", None) == "sharded":  # the whole table on rank 0 (a collective)
        (table,) = sync.tables
        key = next(n for n, p in model.named_parameters() if p is table.weight)
        full = table.full_weight(0)
        state.pop(key, None)  # a rank's state_dict holds no row-sharded table (or only its own rows)
        if full is not None:
            state[key] = full
    res["state"] = state
    return res


def job(ctx: Any, **run: Any) -> dict[str, Any]:
    """One `Run` (its fields as keyword arguments) on every rank of a tests/dist_launch.py launch, in
    `ctx.root`: its result, or the traceback as "error" (the same on every rank)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    LlamaRMSNorm.forward = rms_norm_in_its_dtype  # this process only
    try:
        return train(Run(**run), ctx.root)
    except Exception:
        return {"error": traceback.format_exc()}
