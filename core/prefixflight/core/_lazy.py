"""Lazy package attributes: a package names the names each of its modules defines, and the
module is imported on the first use of one of them (PEP 562); the package's ``__all__`` is
computed from the same map."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    namespace: dict[str, Any], lazy: Mapping[str, tuple[str, ...]], eager: tuple[str, ...] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of the package whose globals are
    ``namespace``. ``lazy`` maps each of its modules (relative to the package) to the names
    that module defines; a module whose name has no leading underscore (a subpackage) is an
    attribute of the package too. ``eager`` are the public names the package imports itself.
    ``__all__`` is the eager and the lazy names, sorted with the upper-case ones first. A
    value, once loaded, is stored in ``namespace``, so later lookups are plain attribute reads.

    mypy cannot read a computed ``__all__``, and a module with an ``__all__`` it cannot read
    exports nothing; so the package assigns the three under ``if not typing.TYPE_CHECKING:``
    and re-exports each name as itself (``from .cache import LRU as LRU``): type checkers see
    exactly those names."""
    package = namespace["__name__"]
    where = {name: module for module, names in lazy.items() for name in names}
    exported = sorted({*eager, *where}, key=lambda name: (not name.isupper(), name))
    if len(exported) != len(eager) + sum(len(names) for names in lazy.values()):
        raise ValueError(f"{package}: a name is listed twice in its lazy or eager names")

    def __getattr__(name: str) -> object:
        try:
            module = where[name]
        except KeyError:
            if name in lazy and not name.startswith("_"):
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exported})

    return __getattr__, __dir__, exported
