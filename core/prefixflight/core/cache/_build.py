"""Which build of the core is loaded: pure Python (the default, the reference) or the optional
mypyc-compiled modules (``PREFIXFLIGHT_COMPILE=1 pip install .``; docs/performance.md)."""

from __future__ import annotations

import sys
from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Final

__all__ = ["COMPILED_MODULES", "compiled", "compiled_modules"]

COMPILED_MODULES: Final = (
    "prefixflight.core.cache._chain",
    "prefixflight.core.cache._policies",
    "prefixflight.core.cache._cache",
    "prefixflight.core.cache._trace",
    "prefixflight.core.cache._curves",
)
"""The modules the compiled build compiles (the same list as pyproject.toml's hook)."""


def compiled_modules() -> dict[str, bool]:
    """Each of `COMPILED_MODULES` -> whether its extension was loaded."""
    out: dict[str, bool] = {}
    for name in COMPILED_MODULES:
        module = sys.modules.get(name) or import_module(name)
        path = getattr(module, "__file__", None) or ""
        out[name] = path.endswith(tuple(EXTENSION_SUFFIXES))
    return out


compiled: Final[bool] = all(compiled_modules().values())
"""True when every one of `COMPILED_MODULES` was loaded from a compiled extension."""
