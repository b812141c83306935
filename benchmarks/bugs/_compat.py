"""Imported at start-up in every release venv that ``benchmarks/bugs/run.py`` builds (through a
``.pth`` file): lets an old engine release import against the peers venv's newer libraries.

Older SGLang releases register model configs (``AutoConfig.register("qwen3_asr", ...)``)
that the peers venv's transformers now ships, and transformers refuses a second registration
unless ``exist_ok=True``. After transformers' ``configuration_auto`` module loads, its
``AutoConfig.register`` defaults to ``exist_ok=True``. Nothing a cache calls is changed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "transformers.models.auto.configuration_auto"


def _patch(module: Any) -> None:
    auto = getattr(module, "AutoConfig", None)
    if auto is None or getattr(auto.register, "_prefixflight_bugs", False):
        return
    original = auto.register

    @functools.wraps(original)
    def register(*args: Any, exist_ok: bool = True, **kwargs: Any) -> Any:
        return original(*args, exist_ok=exist_ok, **kwargs)

    register._prefixflight_bugs = True  # type: ignore[attr-defined]
    auto.register = register


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _ConfigRegisterFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _TARGET in sys.modules:
    _patch(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _ConfigRegisterFinder())
