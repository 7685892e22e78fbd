"""Engram on HF models under FSDP2: the backbone sharded by `torch.distributed.fsdp.fully_shard`, the
Engram tables kept out of it and synchronised by Engram (`prepare_data_parallel`'s modes).

`fully_shard_backbone(model)` shards a model with Engram (`engram.hf.add_engram`) the way torchtitan
does: `fully_shard` on each decoder layer, then on the model itself (the root unit), with the
Engram tables passed as `ignored_params` on every call. So the decoder layers and the rest of the
backbone become DTensors sharded on dim 0, and Engram's small dense weights (`wkv`, the norms)
belong to the root unit (all-gathered before the root's forward: Engram runs in the decoder layers'
forward pre-hooks, outside any unit of its own). First it calls `prepare_data_parallel` on the mesh's
process group (unless it was called already), so the tables are Engram's to keep one table across
the ranks: row-sharded (`TableSync.SHARDED`, the default on more than one rank: each rank owns 1/N of
the rows, fetched in the forward) or replicated (`TableSync.REPLICATED`: sparse row gradients
averaged before the table step). FSDP never sees them: they stay plain parameters, and their sparse
row gradients pass it by. Build the model's `EngramOptimizer` (`engram.hf.build_optimizer`) after
this call, so that its AdamW holds the DTensor shards.

Without the tables in `ignored_params`, `fully_shard` makes them DTensors and the sparse table step
fails deep inside torch ("got mixed torch.Tensor and DTensor"); without a table mode the
`EngramOptimizer` refuses to step on more than one process. A torch whose FSDP2 has no
`fully_shard(..., ignored_params=)` cannot keep the tables out: there this function refuses and names
DDP (`prepare_data_parallel` + `DistributedDataParallel`, or the HF Trainer) as what works.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engram.distributed.guard import DEFAULT_COLLECTIVE_TIMEOUT
from engram.distributed.hf.data_parallel import TableSync, prepare_data_parallel
from engram.hf.attach import find_decoder_layers, get_attachment

__all__ = ["fully_shard_backbone"]

_USE_DDP = (
    "use data parallelism instead: engram.distributed.prepare_data_parallel(model), then "
    "torch.nn.parallel.DistributedDataParallel(model) (or the HF Trainer / accelerate, which wrap it in DDP)"
)


def _fully_shard() -> Callable[..., Any]:
    """This torch's FSDP2 `fully_shard`, if it can keep parameters out of its units (else refuse)."""
    try:
        from torch.distributed import fsdp
    except ImportError:  # a torch built without distributed
        fsdp = None
    fn = getattr(fsdp, "fully_shard", None)
    if fn is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard), so the backbone "
            f"cannot be sharded with the Engram tables kept out of it: {_USE_DDP}"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "ignored_params" not in params:
        raise RuntimeError(
            f"torch {torch.__version__}'s fully_shard has no ignored_params, so it would shard the Engram "
            f"tables, whose sparse row gradients and row optimizers need whole tables: {_USE_DDP}"
        )
    return fn


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _default_mesh(world: int, device: torch.device) -> Any:
    """Every rank of the default group, on the device type where the model lives: a model on the CPU
    gets a CPU mesh on a GPU machine too (torch's own default, the accelerator, would move the backbone
    to the GPU and leave the tables behind)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def fully_shard_backbone(
    model: nn.Module,
    *,
    mesh: Any = None,
    mode: TableSync | str | None = None,
    table_ranks: int | None = None,
    timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
    decoder_layers: str | Sequence[nn.Module] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Shard an HF model with Engram with FSDP2, the Engram tables kept out and synchronised by Engram.

    Each decoder layer, then the root, becomes a `fully_shard` unit. Call
    `torch.distributed.init_process_group` first, move the model to its device first (fully_shard
    leaves ignored parameters where they are), and build the optimizer after this call.

    Args:
        model: An HF model with Engram attached, not yet wrapped.
        mesh: A 1-D DeviceMesh over the data-parallel ranks (default: every rank of the default group,
            on the device type of the model's parameters, where it was moved).
        mode: As for `prepare_data_parallel`, which this calls on the mesh's group (unless the model
            was prepared already: then its mode and timeout are kept).
        table_ranks: As for `prepare_data_parallel`.
        timeout: As for `prepare_data_parallel`.
        decoder_layers: As for `add_engram` (default: found on the model).
        **fsdp_kwargs: Go to every `fully_shard` call (`reshard_after_forward`, `mp_policy`,
            `offload_policy`; `ignored_params`: ignored as well as the tables).

    Returns:
        `model`, now an FSDPModule.

    Raises:
        ValueError: No process group, a model wrapped in DDP or sharded already, a mesh that is not
            1-D or on another device type than the tables, or a mode other than the one the model
            was prepared with.
        RuntimeError: This torch has no FSDP2 that can keep parameters out, or `fully_shard`
            sharded a table anyway.
    """
    fully_shard = _fully_shard()
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fully_shard_backbone needs torch.distributed: launch with torchrun and call "
            "torch.distributed.init_process_group first"
        )
    if isinstance(model, DistributedDataParallel):
        raise ValueError("the model is wrapped in DistributedDataParallel: pass the bare model to shard it")
    if any(_is_fsdp(m) for m in model.modules()):
        raise ValueError(
            "the model (or one of its modules) is sharded with fully_shard already: fully_shard_backbone "
            "shards the bare model itself, its decoder layers then the root, with the Engram tables kept out"
        )
    att = get_attachment(model)
    layers = find_decoder_layers(model, decoder_layers)
    if mesh is None:
        mesh = _default_mesh(dist.get_world_size(), next(model.parameters()).device)
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh has {mesh.ndim} dimensions: fully_shard_backbone takes a 1-D data-parallel mesh (HSDP and "
            "meshes with tensor parallelism are not supported with Engram tables)"
        )
    misplaced = [p.device for p in att.tables() if p.device.type != mesh.device_type]
    if misplaced:
        raise ValueError(
            f"the Engram tables are on {misplaced[0]} but the mesh is on {mesh.device_type!r}, and fully_shard "
            "does not move the parameters it ignores: move the model to its device before sharding it"
        )
    if att.table_sync is None:
        prepare_data_parallel(model, mode, group=mesh.get_group(), table_ranks=table_ranks, timeout=timeout)
    elif mode is not None and TableSync(mode) is not att.table_sync.mode:
        raise ValueError(
            f"the model was prepared with mode {att.table_sync.mode.value!r} already, not {TableSync(mode).value!r}"
        )
    tables = att.tables()  # after prepare_data_parallel: a sharded mode replaces them with their shards
    ignored = set(fsdp_kwargs.pop("ignored_params", None) or ()) | set(tables)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored, **fsdp_kwargs)

    from torch.distributed.tensor import DTensor

    # fully_shard re-registers what it shards as new DTensor parameters: the tables must be the same
    # plain parameters as before
    after = att.tables()
    if [id(a) for a in after] != [id(t) for t in tables] or any(isinstance(a, DTensor) for a in after):
        raise RuntimeError("fully_shard sharded an Engram table despite ignored_params")
    return model
