"""Optimizers for an HF model with Engram: tables with our sparse row optimizers, everything else
AdamW, in one `torch.optim.Optimizer` the HF `Trainer` (and its LR schedulers) can drive.

The Trainer of transformers 5.24 takes the norm of every parameter's gradient each step (to clip
or log it), and torch cannot take the norm of a sparse gradient. So the tables' sparse gradients
are taken off `.grad` as soon as backward has accumulated them (a post-accumulate-grad hook) and
kept by the optimizer until its `step`: the Trainer only ever sees dense gradients, the tables'
updates stay sparse (only looked-up rows are read and written), and gradient accumulation over
micro-batches sums the sparse gradients. Clipping therefore covers the dense parameters only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engram.checkpoint.shard_format import SHARDED_STATE_KEY
from engram.hf.attach import get_attachment
from engram.model.optim import SparseRowAdagrad, SparseRowAdam
from engram.model.saved_state import check_number
from engram.model.sinkhorn import SparseSinkhorn

__all__ = ["EngramOptimizer", "build_optimizer"]

_TABLE_OPTIMIZERS = {"adam": SparseRowAdam, "adagrad": SparseRowAdagrad, "sinkhorn": SparseSinkhorn}


def _take(method: weakref.WeakMethod, p: torch.Tensor) -> None:
    """A table's post-accumulate-grad hook: the optimizer's `_take_grad`, while it lives."""
    take = method()
    if take is not None:
        take(p)


class EngramOptimizer(torch.optim.Optimizer):
    """A dense optimizer and a sparse row optimizer for the tables, stepped together.

    `param_groups` are the two optimizers' own group dicts, so an LR scheduler built on this
    optimizer sets both learning rates. The tables' sparse gradients are taken off `.grad` as soon as
    backward has accumulated them and held in `pending` until `step` (the HF Trainer takes the norm
    of every `.grad`, which torch cannot do for a sparse one); gradient clipping therefore covers the
    dense parameters only. `build_optimizer` makes one.

    Args:
        dense: Any torch optimizer for the dense parameters, or None.
        tables: A sparse row optimizer over the tables, or None.
        attachment: The model's EngramAttachment (its `table_sync` across processes).

    Raises:
        ValueError: Both optimizers are None or hold no parameter.
    """

    def __init__(
        self,
        dense: torch.optim.Optimizer | None,
        tables: torch.optim.Optimizer | None,
        attachment: Any = None,
    ) -> None:
        self.dense, self.tables = dense, tables
        self.attachment = attachment  # the model's EngramAttachment: its table_sync across processes
        groups = [g for opt in (dense, tables) if opt is not None for g in opt.param_groups]
        if not groups:
            raise ValueError("nothing to optimize: no parameter requires a gradient")
        super().__init__(groups, {})
        self.pending: dict[torch.Tensor, torch.Tensor] = {}
        # A loaded table part whose rows are in a sharded checkpoint's shard files while this model's
        # tables are whole (one process, or replicated): engram.distributed.load_table_shards reads them.
        self.table_restore: dict[str, Any] | None = None
        self._handles: list[Any] = []
        if tables is not None:
            # The hook holds the optimizer weakly: a table's hooks keep it alive from C++, where the
            # garbage collector cannot see the cycle, so a bound method kept the optimizer, its
            # tables and their state alive after the model and the optimizer were dropped.
            take = weakref.WeakMethod(self._take_grad)
            for group in tables.param_groups:
                for p in group["params"]:
                    self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_take, take)))

    def _take_grad(self, p: torch.Tensor) -> None:
        g, p.grad = p.grad, None
        if g is not None:
            old = self.pending.get(p)
            self.pending[p] = g if old is None else old + g

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the tables, then the dense part.

        Every refusal of ours (tables not synchronised across processes, a resume whose rows were not
        read back, a bad table gradient) comes before any parameter moves, the table optimizers
        checking every gradient before they change a row.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: The run resumed from row-sharded tables whose rows were not read back, or
                this process is one of several and the tables are not synchronised across them
                (`engram.distributed.prepare_data_parallel`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.tables is not None:
            self._step_tables()
        if self.dense is not None:
            self.dense.step()
        return loss

    def _step_tables(self) -> None:
        assert self.tables is not None
        if self.table_restore is not None:
            raise RuntimeError(
                "this run resumed from a checkpoint of row-sharded Engram tables, but their rows and optimizer "
                "state were not read back: pass callbacks=[engram.distributed.EngramShardsCallback()] to the "
                "Trainer (or call engram.distributed.load_table_shards(model, checkpoint folder))"
            )
        params = [p for g in self.tables.param_groups for p in g["params"]]
        sync = getattr(self.attachment, "table_sync", None)
        if sync is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.pending.clear()
            raise RuntimeError(
                f"this process is one of {dist.get_world_size()}, but the Engram tables are not "
                "synchronised across them: each rank would train its own table. Call "
                "engram.distributed.prepare_data_parallel(model) before DDP, accelerate or the Trainer "
                "wraps the model"
            )
        if sync is not None:
            self.pending = sync(params, self.pending)  # one table across the ranks
        for p, g in self.pending.items():
            p.grad = g
        try:
            self.tables.step()
        finally:
            for p in self.pending:
                p.grad = None
            self.pending.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the dense gradients and the tables' pending sparse gradients.

        Args:
            set_to_none: Passed to the dense optimizer's `zero_grad`.
        """
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)
        self.pending.clear()
        clear = getattr(getattr(self.attachment, "table_sync", None), "zero_grad", None)
        if clear is not None:
            clear()

    def state_dict(self) -> dict[str, Any]:
        """Both optimizers' state.

        Returns:
            {"dense": ..., "tables": ...}, each the optimizer's `state_dict()` or None; row-sharded
                tables give each rank's own rows (the table sync's `table_state_dict`).
        """
        sync = getattr(self.attachment, "table_sync", None)
        save_tables = getattr(sync, "table_state_dict", None)  # row-sharded: each rank saves its own rows
        tables = None if self.tables is None else (save_tables or self.tables.state_dict)()
        return {"dense": None if self.dense is None else self.dense.state_dict(), "tables": tables}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()`: every part checked before any is replaced.

        The table part is checked by its optimizer's `check_state_dict`, or by the table sync's check
        across processes; torch checks the dense part's groups before it replaces anything; so a
        refused load leaves both as they were. A table part saved from row-sharded tables while this
        model's are whole loads its groups now and its rows later (`table_restore`, read by
        `engram.distributed.load_table_shards`).

        Args:
            state_dict: A `state_dict()` of an EngramOptimizer.

        Raises:
            ValueError: Not an EngramOptimizer state dict, one that has or lacks a part this
                optimizer lacks or has, or a part its check refuses.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"dense", "tables"}:
            raise ValueError("not an EngramOptimizer state dict (expected the keys 'dense' and 'tables')")
        for name, opt in (("dense", self.dense), ("tables", self.tables)):
            if (opt is None) != (state_dict[name] is None):
                raise ValueError(f"the saved state {'has' if opt is None else 'lacks'} a {name!r} optimizer")
        sync = getattr(self.attachment, "table_sync", None)
        load_tables = getattr(sync, "load_table_state_dict", None)  # row-sharded: the rows are in shard files
        if load_tables is not None:  # across processes: the sync's check (it holds the optimizer's)
            check = getattr(sync, "check_table_state_dict", None)
        else:
            check = getattr(self.tables, "check_state_dict", None)  # ours have it; any other, unchecked
        # rows in shard files, this model's tables whole (one process, or replicated): only the groups load
        # now; load_table_shards reads the rows and their state (engram.distributed.EngramShardsCallback)
        deferred = (
            load_tables is None
            and isinstance(state_dict["tables"], dict)
            and SHARDED_STATE_KEY in state_dict["tables"]
        )
        if deferred:
            check = getattr(self.tables, "check_state_dict", None)
            if check is not None:
                check({"state": {}, "param_groups": state_dict["tables"].get("param_groups")})
        elif self.tables is not None and check is not None:
            check(state_dict["tables"])
        if self.dense is not None:
            self.dense.load_state_dict(state_dict["dense"])
        if deferred:
            self.table_restore = state_dict["tables"]
        elif self.tables is not None:
            (load_tables or self.tables.load_state_dict)(state_dict["tables"])
        # the loads replaced the optimizers' group dicts: ours must be theirs, or an LR scheduler stepping
        # this optimizer would set learning rates nobody reads
        self.param_groups[:] = [
            g for opt in (self.dense, self.tables) if opt is not None for g in opt.param_groups
        ]

    def remove_hooks(self) -> None:
        """Stop taking the tables' gradients (before building another optimizer for the same model)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def build_optimizer(
    model: nn.Module,
    *,
    lr: float = 3e-4,
    table_lr: float = 1e-2,
    weight_decay: float = 0.0,
    table_weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    table_optimizer: str = "adam",
    freeze_backbone: bool = False,
) -> EngramOptimizer:
    """An `EngramOptimizer` for a model with Engram: sparse row updates for the tables, AdamW for the rest.

    Engram's own parameters are made trainable. Pass it to the HF Trainer as
    `optimizers=(optimizer, None)` (the Trainer adds its LR schedule). Building another optimizer for
    the same model stops the earlier one taking the tables' gradients.

    Args:
        model: A model with Engram attached (or a peft model around one).
        lr: AdamW's learning rate, for every other parameter that requires a gradient.
        table_lr: The tables' learning rate.
        weight_decay: AdamW's weight decay.
        table_weight_decay: The tables' weight decay ('adam' only).
        betas: AdamW's betas (the tables' optimizer keeps its own defaults).
        table_optimizer: 'adam' (`SparseRowAdam`), 'adagrad' (`SparseRowAdagrad`) or 'sinkhorn'
            (V4.1's Sinkhorn-balanced update `SparseSinkhorn`, no weight decay).
        freeze_backbone: Set requires_grad=False on every parameter outside Engram (LoRA parameters
            of a peft model stay trainable), so only Engram (and adapters) train.

    Returns:
        The optimizer.

    Raises:
        ValueError: No Engram attached, an unknown `table_optimizer`, a rate or beta out of range,
            weight decay for a table optimizer without it, or tables sharded by FSDP2's
            `fully_shard` (use `engram.distributed.fully_shard_backbone`).

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from engram import EngramConfig, TokenizerCompression
        >>> from engram.hf import add_engram, build_optimizer
        >>> backbone = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
        ...                                         num_hidden_layers=2, num_attention_heads=4))
        >>> config = EngramConfig.preset("tiny").replace(
        ...     hc_mult=1, vocab_size=1000, compressed_vocab_size=1000
        ... )
        >>> model = add_engram(backbone, config, compression=TokenizerCompression.identity(1000))
        >>> optimizer = build_optimizer(model, lr=1e-4, table_lr=1e-2)
        >>> type(optimizer.dense).__name__, type(optimizer.tables).__name__
        ('AdamW', 'SparseRowAdam')
        >>> model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
        >>> optimizer.step()
        >>> optimizer.zero_grad()
    """
    att = get_attachment(model)
    if table_optimizer not in _TABLE_OPTIMIZERS:
        raise ValueError(f"table_optimizer={table_optimizer!r}: use one of {sorted(_TABLE_OPTIMIZERS)}")
    # finite everywhere: lr=inf passed a plain `> 0` and left 276 parameters NaN after one step
    for name, v in (("lr", lr), ("table_lr", table_lr)):
        check_number(name, v, 0.0, lo_open=True, where="build_optimizer")
    for name, v in (("weight_decay", weight_decay), ("table_weight_decay", table_weight_decay)):
        check_number(name, v, 0.0, where="build_optimizer")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"build_optimizer: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        check_number(f"betas[{i}]", b, 0.0, 1.0, hi_open=True, where="build_optimizer")
    old = getattr(att, "optimizer_hooks", None)
    if old is not None:
        old.remove_hooks()
    engram_ids = {id(p) for p in att.parameters()}
    table_params = att.tables()
    if any(isinstance(p, DTensor) for p in table_params):
        raise ValueError(
            "the Engram tables were sharded by fully_shard (FSDP2), whose DTensors the sparse row optimizers "
            "cannot step: use engram.distributed.fully_shard_backbone(model), which keeps them out, before "
            "build_optimizer"
        )
    table_ids = {id(p) for p in table_params}
    for p in att.parameters():
        p.requires_grad_(True)
    if freeze_backbone:
        for n, p in model.named_parameters():
            if id(p) not in engram_ids and "lora_" not in n:
                p.requires_grad_(False)
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in table_ids]
    dense_opt = torch.optim.AdamW(dense, lr=lr, betas=betas, weight_decay=weight_decay) if dense else None
    table_opt = None
    if table_params:
        cls = _TABLE_OPTIMIZERS[table_optimizer]
        if table_weight_decay and table_optimizer != "adam":
            raise ValueError(
                f"{cls.__name__} has no weight decay: use table_weight_decay=0.0 or table_optimizer='adam'"
            )
        kwargs = {"weight_decay": table_weight_decay} if table_optimizer == "adam" else {}
        # Row-sharded tables across processes (engram.distributed): their sync builds the optimizer
        # (the Sinkhorn update's row and column sums then run over every rank's rows).
        make = getattr(att.table_sync, "table_optimizer", None)
        table_opt = (
            cls(table_params, lr=table_lr, **kwargs) if make is None else make(cls, lr=table_lr, **kwargs)
        )
    opt = EngramOptimizer(dense_opt, table_opt, att)
    att.optimizer_hooks = opt
    return opt
