"""Which data-parallel wrapper holds a model already, and whether one has taken a parameter over.

`wrapper_of(model)` names the wrapper that holds `model`: 'DistributedDataParallel' or
'FullyShardedDataParallel' (FSDP1) when one keeps it as its module (found among what refers to the
model, one scan of the garbage collector's objects: torch leaves no mark on the wrapped module), or
wraps some of its modules; 'fully_shard' when FSDP2 sharded it or one of its modules; None for a bare
model. `taken_over(module, name, param)` says what replaced or reshaped the parameter `param`
registered as `module.<name>`: FSDP1 flattening it into its own parameter (it replaces it by a plain
tensor, or marks it), FSDP2 making it a DTensor. Knows torch's wrappers, nothing of Engram.
"""

from __future__ import annotations

import gc

from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["taken_over", "wrapper_of"]

_MODULE_KEYS = ("module", "_fsdp_wrapped_module")  # how DDP and FSDP1 register the wrapped module
_FSDP1_FLATTENED = "_fsdp_flattened"  # FSDP1's mark on a parameter it flattened (use_orig_params=True)


def _wrappers() -> tuple[type, ...]:
    from torch.distributed.fsdp import FullyShardedDataParallel  # (a 0.2 s import: when asked)

    return DistributedDataParallel, FullyShardedDataParallel


def _holders(model: nn.Module) -> list[nn.Module]:
    """The DDP / FSDP1 modules whose submodule dict holds `model`: what refers to the model, then to
    that dict, then to the module's own __dict__ (a scan of the collector's objects each; the later
    ones only when a dict with a wrapper's key for `model` exists)."""
    subs = [
        d for d in gc.get_referrers(model) if type(d) is dict and any(d.get(k) is model for k in _MODULE_KEYS)
    ]
    if not subs:
        return []
    wrappers = _wrappers()
    found, attrs = [], []
    for o in gc.get_referrers(*subs):
        if isinstance(o, wrappers):  # (where an object itself refers to its dict's contents)
            found.append(o)
        elif type(o) is dict and any(o.get("_modules") is d for d in subs):
            attrs.append(o)  # a module's __dict__
    if attrs:
        found += [
            o
            for o in gc.get_referrers(*attrs)
            if isinstance(o, wrappers) and any(o.__dict__ is a for a in attrs)
        ]
    return [o for o in found if any(o.__dict__.get("_modules") is d for d in subs)]


def wrapper_of(model: nn.Module) -> str | None:
    """The name of the data-parallel wrapper that holds `model` or some of its modules, or None."""
    from torch.distributed.fsdp import FSDPModule

    wrappers = _wrappers()
    if isinstance(model, wrappers):
        return type(model).__name__
    for m in model.modules():
        if isinstance(m, FSDPModule):
            return "fully_shard"
        if isinstance(m, wrappers):  # units wrapped inside (an FSDP1 auto_wrap_policy)
            return type(m).__name__
    found = _holders(model)
    if found:
        gc.collect()  # a wrapper already dropped, but not yet freed, holds nothing
        found = _holders(model)
    return type(found[0]).__name__ if found else None


def taken_over(module: nn.Module, name: str, param: nn.Parameter) -> str | None:
    """What took `param` (registered as `module.<name>`) over: 'FullyShardedDataParallel' (FSDP1
    flattened it: `module.<name>` is no longer that parameter, or it carries FSDP1's mark),
    'fully_shard' (a DTensor), or None (still the plain parameter it was)."""
    if isinstance(param, DTensor):
        return "fully_shard"
    if module._parameters.get(name) is not param or getattr(param, _FSDP1_FLATTENED, False):
        return "FullyShardedDataParallel"
    return None
