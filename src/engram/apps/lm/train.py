"""Training: data preparation, the training loop, periodic evaluation, checkpoints and resume.
`Trainer` is split into overridable pieces so `engram.apps.lm.train_distributed` reuses the loop; it writes
checkpoints, and reads them back through `engram.apps.lm.run_checkpoint` (the checks eval and generate
share) and `engram.checkpoint.shards` (either format). Knows nothing of torch.distributed.
Design: docs/training.md.

One concept past 500 lines: the trainer's loop and the pieces `train_distributed` overrides
(batch, backward, evaluation, checkpoint) must read side by side; the settings and the checkpoint
folder's checks are already their own files (`train_config`, `run_checkpoint`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from engram.addressing.compression import TokenizerCompression, resolve_tokenizer
from engram.addressing.layout import Layout
from engram.apps.lm.data import EOS, TokenStream, load_corpus, split_documents, train_bpe
from engram.apps.lm.evaluation import MAX_LOSS, evaluate, window_rows
from engram.apps.lm.rows import identity_compression, stream_rows
from engram.apps.lm.run_checkpoint import (
    DAMAGE,
    check_run_tokenizer,
    checkpoint_dirs,
    checkpoint_tokenizer,
    config_diffs,
    latest_checkpoint,
    layout_metadata,
    load_trained_model,
    optimizer_state_of,
    read_state,
    remove_stale_tmp,
    weights_of,
)
from engram.apps.lm.train_config import (
    DEFAULT_ENGRAM,
    TRAIN_PRESETS,
    EmbeddingOptimizer,
    TableOptimizer,
    TrainConfig,
)
from engram.checkpoint.files import save_tensors
from engram.checkpoint.optim_state import optimizers_from_tensors, optimizers_to_tensors
from engram.checkpoint.shards import read_checkpoint
from engram.checkpoint.temporaries import removed_on_failure
from engram.config import EngramConfig
from engram.device import Precision, autocast, check_precision, resolve_device, to_device
from engram.model.lm import EngramLM, LMConfig
from engram.model.optim import DenseTableAdam, SparseRowAdagrad, SparseRowAdam, split_param_groups
from engram.model.sinkhorn import SparseSinkhorn
from engram.model.table import TrainableTable
from engram.model.table_init import table_seed

__all__ = [
    "DEFAULT_ENGRAM",
    "TRAIN_PRESETS",
    "DataBundle",
    "TableOptimizer",
    "TrainConfig",
    "Trainer",
    "build_model",
    "checkpoint_tokenizer",
    "evaluate",
    "latest_checkpoint",
    "layout_metadata",
    "load_trained_model",
    "prepare_data",
    "remove_stale_tmp",
]


# ---------------------------------------------------------------------------- data
@dataclass
class DataBundle:
    tokenizer: Tokenizer
    compression: TokenizerCompression
    train: TokenStream
    held_out: TokenStream
    engram_config: EngramConfig | None
    train_rows: torch.Tensor | None  # (N_train, n_engram_layers, heads) int64
    held_rows: torch.Tensor | None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _engram_config(engram: EngramConfig, tok: Tokenizer, comp: TokenizerCompression) -> EngramConfig:
    """`engram` with the tokenizer's fields set from the run's tokenizer and compression map."""
    pad = tok.token_to_id(EOS)
    return engram.replace(
        tokenizer=None,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        compressed_vocab_size=comp.size,
        pad_token_id=0 if pad is None else pad,
    )


def prepare_data(cfg: TrainConfig, *, with_engram: bool | None = None) -> DataBundle:
    """Load and split the corpus, get the tokenizer and its compression map, encode both splits,
    and hash every token's Engram rows once (when Engram is on: `with_engram`, default
    `cfg.engram is not None`)."""
    docs = load_corpus(cfg.corpus)
    train_docs, held_docs = split_documents(docs)
    if cfg.tokenizer == "bpe":
        tok = train_bpe([d.text for d in train_docs], cfg.bpe_vocab_size)
    else:
        tok = resolve_tokenizer(cfg.tokenizer)
        if tok.token_to_id(EOS) is None:
            tok.add_special_tokens([EOS])
    comp = TokenizerCompression.from_tokenizer(tok) if cfg.compression else identity_compression(tok)
    train, held = TokenStream(train_docs, tok), TokenStream(held_docs, tok)
    use_engram = cfg.engram is not None if with_engram is None else with_engram
    if use_engram and cfg.engram is None:
        raise ValueError("with_engram=True but cfg.engram is None: give the run an EngramConfig")
    ecfg = train_rows = held_rows = None
    if use_engram:
        assert cfg.engram is not None
        ecfg = _engram_config(cfg.engram, tok, comp)
        train_rows = stream_rows(ecfg, comp, train, cfg.row_hash, "train")
        held_rows = stream_rows(ecfg, comp, held, cfg.row_hash, "held_out")
    return DataBundle(tok, comp, train, held, ecfg, train_rows, held_rows)


def build_model(cfg: TrainConfig, data: DataBundle, *, with_engram: bool | None = None) -> EngramLM:
    """The LM of `cfg` (seeded by cfg.seed); `with_engram=False` gives the identical backbone without
    Engram (default: `cfg.engram is not None`)."""
    use_engram = cfg.engram is not None if with_engram is None else with_engram
    if use_engram and data.engram_config is None:
        raise ValueError(
            "this DataBundle was prepared without Engram rows; call prepare_data(cfg, with_engram=True)"
        )
    lm_cfg = LMConfig(
        vocab_size=data.vocab_size,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        mlp_hidden=cfg.mlp_hidden,
        max_seq_len=cfg.seq_len,
        hc=cfg.hc,
        tie_embeddings=cfg.tie_embeddings,
        engram=data.engram_config if use_engram else None,
        engram_mode=cfg.engram_mode if use_engram else "gated",
        moe_experts=cfg.moe_experts,
        moe_top_k=cfg.moe_top_k,
        moe_hidden=cfg.moe_hidden,
    )
    torch.manual_seed(cfg.seed)  # the backbone draws first, so both models share its initial weights

    def table(e: EngramConfig, layer_id: int) -> TrainableTable:
        # row r of layer l's table from (seed, l, r) only: what N ranks born sharded hold between them
        rows = Layout(e).layer(layer_id).table_rows
        return TrainableTable(rows, e.head_dim, seed=table_seed(cfg.seed, layer_id))

    return EngramLM(lm_cfg, table_factory=table)


# ---------------------------------------------------------------------------- training
class Trainer:
    """Trains one model of `cfg` on `data`; `out_dir` (optional) receives checkpoints.

    `device` (a torch.device or 'auto', 'cpu', 'cuda', 'cuda:N'; default: where the model is): the
    model is moved there before its optimizers are built, and every batch goes there. `precision`
    bf16: forwards under autocast, weights and optimizer state float32. Neither is part of the run:
    checkpoints are written from host copies, and a run resumes on any device in either precision.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        data: DataBundle,
        model: EngramLM,
        out_dir: str | Path | None = None,
        *,
        device: torch.device | str | None = None,
        precision: Precision | str = Precision.FLOAT32,
    ) -> None:
        self.device = resolve_device(next(model.parameters()).device if device is None else device, "device")
        self.precision = check_precision(precision, self.device, "precision")
        if any(t.device != self.device for t in (*model.parameters(), *model.buffers())):
            model.to(self.device)  # before the optimizers: their state is made where the parameters are
        self.cfg, self.data, self.model = cfg, data, model
        self.out_dir = Path(out_dir) if out_dir is not None else None
        dense, tables = self._param_groups()
        no_decay = {
            id(p)
            for n, p in model.named_parameters()
            if p.dim() < 2 or n.endswith(("q_weight", "k_weight", "mix_logits"))
        }
        # V4.1's recipe: the token embedding and the LM head (one parameter when tied) take the
        # Sinkhorn-balanced update too; they stay among the dense parameters for clipping and the
        # data-parallel gradient sync.
        self.embed_opt: torch.optim.Optimizer | None = None
        embed_ids: set[int] = set()
        if cfg.embedding_optimizer is EmbeddingOptimizer.SINKHORN:
            embed = [model.embed.weight] + ([model.head.weight] if model.head is not None else [])
            embed_ids = {id(p) for p in embed}
            self.embed_opt = SparseSinkhorn(embed, lr=self._embedding_lr)
        decay = [p for p in dense if id(p) not in no_decay and id(p) not in embed_ids]
        rest = [p for p in dense if id(p) in no_decay and id(p) not in embed_ids]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        self.table_opt: torch.optim.Optimizer | None = None
        if tables:
            self.table_opt = self._table_optimizer(tables)
        self.dense_params = dense
        self.step = 0
        self._saved_step = -1
        self.history: list[dict[str, Any]] = []
        self.train_seconds = 0.0

    @property
    def rows(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.data.train_rows, self.data.held_rows) if self.model.needs_rows else (None, None)

    def lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine from 1 to min_lr_ratio over the run."""
        c = self.cfg
        if step < c.warmup:
            return (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def train_step(self) -> float:
        c = self.cfg
        f = self.lr_factor(self.step)
        for g in self.opt.param_groups:
            g["lr"] = c.lr * f
        if self.table_opt is not None:
            for g in self.table_opt.param_groups:
                g["lr"] = c.table_lr * f
        if self.embed_opt is not None:
            for g in self.embed_opt.param_groups:
                g["lr"] = self._embedding_lr * f
        x, y, rows = self._batch(self.step)
        with autocast(self.device, self.precision):  # the forward and the loss; the backward outside
            logits = self.model(x, rows)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        for opt in (self.table_opt, self.embed_opt):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        aux = self.model.aux_loss()  # MoE load balancing (None: dense)
        if aux is None:
            loss_value = self._backward(loss)
        else:  # trained on loss + coef * aux; the history records the next-token loss
            self._backward(loss + c.moe_aux_coef * aux)
            loss_value = float(loss.detach())
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.dense_params, c.grad_clip)
        self.opt.step()
        for opt in (self.table_opt, self.embed_opt):
            if opt is not None:
                opt.step()
        self.step += 1
        return loss_value

    # Pieces of train_step that a data-parallel trainer (engram.distributed) overrides.
    def _param_groups(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """(dense params for AdamW, table params for the sparse row optimizer)."""
        return split_param_groups(self.model)

    @property
    def _embedding_lr(self) -> float:
        """The Sinkhorn embedding's base learning rate: `embedding_lr`, or the dense `lr`."""
        return self.cfg.lr if self.cfg.embedding_lr is None else self.cfg.embedding_lr

    def _table_optimizer(self, tables: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The tables' optimizer of `cfg.table_optimizer` at `cfg.table_lr`."""
        cls = {
            TableOptimizer.ADAM: SparseRowAdam,
            TableOptimizer.ADAGRAD: SparseRowAdagrad,
            TableOptimizer.SINKHORN: SparseSinkhorn,
            TableOptimizer.DENSE_ADAM: DenseTableAdam,
        }
        return cls[self.cfg.table_optimizer](tables, lr=self.cfg.table_lr)

    def _optimizers(self) -> dict[str, torch.optim.Optimizer | None]:
        """The run's optimizers by their name in checkpoints (None: not in this run)."""
        return {"dense": self.opt, "table": self.table_opt, "embedding": self.embed_opt}

    def _batch_starts(self, step: int) -> np.ndarray:
        """Window starts of this process's share of step `step`'s batch (here: all of it)."""
        c = self.cfg
        return self.data.train.batch_starts(step, c.batch_size, c.seq_len, c.seed)

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs (B, T), targets (B, T), Engram rows (B, T, layers, heads) or None) of step `step`, on
        the trainer's device (copied without blocking: no sync point)."""
        starts = self._batch_starts(step)
        x, y = self.data.train.windows(starts, self.cfg.seq_len)
        rows = window_rows(self.rows[0], starts, self.cfg.seq_len)
        x_t, y_t, d = torch.from_numpy(x), torch.from_numpy(y), self.device
        return to_device(x_t, d), to_device(y_t, d), None if rows is None else to_device(rows, d)

    def _backward(self, loss: torch.Tensor) -> float:
        """Backward pass of the step's loss (gradient sync, when there is one); returns the loss."""
        loss.backward()
        return float(loss.detach())

    def evaluate(self, max_tokens: int | None = None, engram_scale: float = 1.0) -> dict[str, Any]:
        return evaluate(
            self.model,
            self.data.held_out,
            self.rows[1],
            self.cfg.seq_len,
            max_tokens=max_tokens,
            engram_scale=engram_scale,
            precision=self.precision,
        )

    def run(self, on_step: Callable[[Trainer, float], None] | None = None, until: int | None = None) -> None:
        """Train up to step `until` (default cfg.steps), evaluating and checkpointing as configured."""
        c = self.cfg
        end = c.steps if until is None else min(until, c.steps)
        if c.threads:
            torch.set_num_threads(c.threads)
        while self.step < end:
            t0 = time.perf_counter()
            loss = self.train_step()
            self.train_seconds += time.perf_counter() - t0
            self._check_loss(loss)  # before the step is recorded or checkpointed
            record: dict[str, Any] = {"step": self.step, "train_loss": loss}
            if c.eval_every and (self.step % c.eval_every == 0 or self.step == c.steps):
                record["held_out_loss"] = self.evaluate(c.eval_tokens)["loss"]
            self.history.append(record)
            if on_step is not None:
                on_step(self, loss)
            if self.out_dir is not None and (
                (c.checkpoint_every and self.step % c.checkpoint_every == 0) or self.step == c.steps
            ):
                self.save_checkpoint()
        if self.out_dir is not None and until is not None and self._saved_step != self.step:
            self.save_checkpoint()  # a run stopped early (--until) can be resumed from here

    def _check_loss(self, loss: float) -> None:
        """Stop a run whose training loss diverged (NaN, inf, or past MAX_LOSS: no finite perplexity)
        with a ValueError naming the step and the learning rates; the loss is the same on every rank."""
        if not loss > MAX_LOSS and math.isfinite(loss):
            return
        c = self.cfg
        rates = [f"lr={c.lr:g}", f"table_lr={c.table_lr:g} ({c.table_optimizer.value})"]
        if self.embed_opt is not None:
            rates.append(f"embedding_lr={self._embedding_lr:g} (sinkhorn)")
        raise ValueError(
            f"the training loss diverged at step {self.step} of {c.steps} (loss {loss:g} nats/token: "
            f"{'not a number' if math.isnan(loss) else 'no finite perplexity'}); an update is too large "
            f"for this model: lower the learning rates ({', '.join(rates)}; --embedding-lr, or the "
            "config's lr / table_lr). No checkpoint of this step was written"
        )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        if self.out_dir is None:
            raise ValueError("this Trainer has no out_dir to write checkpoints into")
        model_tensors, opt_tensors, groups = self._checkpoint_tensors()
        return self._write_checkpoint(model_tensors, opt_tensors, groups)

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        """(model state, optimizer state tensors, optimizer groups) as a checkpoint stores them (on the
        trainer's device; the files hold host copies)."""
        model_tensors = {k: v.contiguous() for k, v in self.model.state_dict().items()}
        opt_tensors, groups = optimizers_to_tensors(self._optimizers())
        return model_tensors, opt_tensors, groups

    def _checkpoint_tmp(self, tag: str) -> Path:
        """A fresh temporary folder `.tmp-step-NNNNNNN-<tag>` for this step's checkpoint."""
        assert self.out_dir is not None
        root = self.out_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-step-{self.step:07d}-{tag}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def _write_checkpoint(
        self,
        model_tensors: dict[str, torch.Tensor],
        opt_tensors: dict[str, torch.Tensor],
        groups: dict,
        *,
        tmp: Path | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint into `tmp` (default: a fresh one; a distributed run passes the folder
        its ranks already wrote their table shards into) and rename it into place; `extra_state`:
        more state.json entries."""
        assert self.out_dir is not None
        root = self.out_dir / "checkpoints"
        final = root / f"step-{self.step:07d}"
        own: list[Path] = []  # the temporary folder made here, removed if the write fails (a full disk,
        # Ctrl-C); a distributed run's, which every rank wrote into, is cleared by the next run
        if tmp is None:
            tmp = self._checkpoint_tmp(str(os.getpid()))
            own.append(tmp)
        with removed_on_failure(*own):
            # a checkpoint names no device (save_tensors copies device tensors to the host), so it loads on
            # any: read_checkpoint reads to the host, the loads copy into the model and the optimizers
            save_tensors(tmp / "model.safetensors", model_tensors, layout_metadata(self.model.config))
            save_tensors(tmp / "optimizer.safetensors", opt_tensors)
            state = {
                "step": self.step,
                "train_config": self.cfg.to_dict(),
                "lm_config": self.model.config.to_dict(),
                "optimizer_groups": groups,
                "history": self.history,
                "train_seconds": self.train_seconds,
                "device": str(self.device),  # where it was trained, and how: a record, never a requirement
                "precision": self.precision.value,
                **(extra_state or {}),
            }
            (tmp / "state.json").write_text(json.dumps(state))
            self.data.tokenizer.save(str(tmp / "tokenizer.json"))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: readers see the old set or the new one, never half
        for old in sorted(root.glob("step-*"))[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        self._saved_step = self.step
        return final

    def resume_from(self, path: str | Path) -> None:
        """Continue the run of checkpoint folder `path`: restore model, optimizers, step and history.
        The checkpoint's training config must be this trainer's (the total steps aside); a damaged
        checkpoint is refused (ValueError naming the file and what is wrong with it)."""
        path = Path(path)
        state, cfg, lm_cfg = read_state(path)
        self._check_config(path, cfg, state["step"])
        self._restore(path, state, lm_cfg)

    def resume_latest(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """Continue from the newest intact checkpoint in `out_dir`: (its path or None when there is
        none, [(skipped checkpoint, why)] newest first). A damaged checkpoint (unreadable state.json,
        a missing, truncated or foreign file, a wrong dtype, NaN / Inf) is skipped for the next older
        one; one of another training config is an error, not skipped (resume with that config).
        ValueError when every checkpoint is damaged, naming each and why."""
        if self.out_dir is None:
            raise ValueError("this Trainer has no out_dir to resume from")
        found = checkpoint_dirs(self.out_dir)
        skipped: list[tuple[Path, str]] = []
        for path in reversed(found):
            error: BaseException | None = None
            try:
                state, cfg, lm_cfg = read_state(path)
            except DAMAGE as e:
                error = e
            if error is None:
                self._check_config(path, cfg, state["step"])  # another run's: an error, never skipped
                try:
                    self._restore(path, state, lm_cfg)
                except DAMAGE as e:
                    error = e
            error = self._agree_intact(error)
            if error is None:
                return path, skipped
            skipped.append((path, " ".join(str(error).split())))
        if skipped:
            why = "; ".join(f"{p.name}: {reason}" for p, reason in skipped)
            raise ValueError(
                f"no intact checkpoint in {self.out_dir / 'checkpoints'} to resume from ({why}); repair one, "
                "or start afresh in another --out"
            )
        return None, skipped

    def _check_config(self, path: Path, cfg: TrainConfig, step: int) -> None:
        """Refuse a checkpoint of another run: another training config (the total steps aside), or a
        step beyond this run's total steps."""
        if cfg.replace(steps=self.cfg.steps) != self.cfg:
            raise ValueError(
                f"{path} was written by a run with another training config; resume with that config"
            )
        if step > self.cfg.steps:
            raise ValueError(
                f"{path} is at step {step}, beyond this run's {self.cfg.steps} total steps; resume with "
                f"--steps {step} or more"
            )

    def _restore(self, path: Path, state: dict[str, Any], lm_cfg: LMConfig) -> None:
        """Restore model, optimizers, step and history from checkpoint `path` (state.json `state`, its
        checked `lm_config` `lm_cfg`), which must describe this trainer's model and tokenizer."""
        try:
            groups = state["optimizer_groups"]
            history = list(state["history"])
            seconds = float(state.get("train_seconds", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path / 'state.json'}: damaged ({type(e).__name__}: {e})") from None
        self._check_model(path, lm_cfg)
        with weights_of(path), optimizer_state_of(path, state):
            self._restore_tensors(*self._read_checkpoint(path, state), groups)
        self.step, self.history, self.train_seconds = state["step"], history, seconds

    def _check_model(self, path: Path, lm_cfg: LMConfig) -> None:
        """Refuse a checkpoint whose lm_config or tokenizer.json is not this trainer's model's (the
        training config agreed, so the checkpoint was edited or damaged)."""
        if lm_cfg != self.model.config:
            diffs = config_diffs(lm_cfg.to_dict(), self.model.config.to_dict())
            raise ValueError(
                f"{path / 'state.json'}: its lm_config does not describe the model its training config "
                f"builds ({'; '.join(diffs)}); the checkpoint is damaged: resume from another checkpoint"
            )
        saved = checkpoint_tokenizer(path, lm_cfg.vocab_size)
        check_run_tokenizer(path, saved, self.data.tokenizer, self.cfg.tokenizer)

    def _agree_intact(self, error: BaseException | None) -> BaseException | None:
        """The outcome of reading one checkpoint, agreed by every process (here: just this one's)."""
        return error

    def _model_dtypes(self) -> dict[str, torch.dtype]:
        """{state_dict key: dtype} the model expects of a checkpoint's tensors."""
        return {k: v.dtype for k, v in self.model.state_dict().items()}

    def _read_checkpoint(
        self, path: Path, state: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(model tensors, optimizer tensors) of checkpoint `path`, whole tables (also from shard files),
        checked (dtypes, NaN / Inf; see `read_checkpoint`)."""
        return read_checkpoint(path, state, dtypes=self._model_dtypes())

    def _restore_tensors(
        self, model_tensors: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor], groups: dict
    ) -> None:
        """Load a checkpoint's model and optimizer tensors (host tensors) into this trainer's model and
        optimizers, on the trainer's device: the optimizers' loads move their state to its parameters."""
        self.model.load_state_dict(model_tensors)
        optimizers_from_tensors(self._optimizers(), opt_tensors, groups)
