"""Lazy package attributes: a package names where each of its public names is defined, and
the defining module is imported on the first use of one of them (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    namespace: dict[str, Any], where: Mapping[str, str], subpackages: tuple[str, ...] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``:
    ``where`` maps each lazy name to its module, relative to the package; ``subpackages``
    are imported by their own names. A value, once loaded, is stored in ``namespace``, so
    later lookups are plain attribute reads."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> object:
        try:
            module = where[name]
        except KeyError:
            if name in subpackages:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace["__all__"]})

    return __getattr__, __dir__
