"""engram-lm in the registries of other libraries, made when `import engram` runs: the `engram` model
type in transformers' Auto classes (`engram.hf.auto.register`), so `AutoModelForCausalLM.from_pretrained`
of an Engram folder returns the model with Engram after `import engram`.

transformers costs seconds to import and most of engram-lm never needs it: when it is not imported yet,
a finder on `sys.meta_path` waits for its Auto configuration module to be imported and registers right
after it ran (then removes itself). A registration that fails says so in a warning; it never breaks the
import of transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["register_with_transformers"]

_AUTO_CONFIG = "transformers.models.auto.configuration_auto"


def _register() -> None:
    try:
        from engram.hf.auto import register

        register()
    except Exception as e:  # a transformers we were not written for: say so, keep it importable
        warnings.warn(
            f"engram-lm could not register its Engram model type with transformers ({type(e).__name__}: {e}); "
            "load Engram folders with engram.hf.load_engram",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisterAfter(importlib.abc.Loader):
    """The Auto configuration module's own loader, then `_register`."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register()


class _WaitForTransformers(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _AUTO_CONFIG:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisterAfter(spec.loader)
        return spec


def register_with_transformers() -> None:
    """Register now when transformers' Auto classes are imported already, else when they are."""
    if _AUTO_CONFIG in sys.modules:
        _register()
    elif not any(isinstance(f, _WaitForTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _WaitForTransformers())
