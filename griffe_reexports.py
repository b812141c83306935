"""The griffe extension of the API reference (mkdocs.yml): the exports of a package whose
``__all__`` is computed are the names it re-exports as themselves.

A lazy package (`prefixflight.core`, `prefixflight.core.cache`, `prefixflight.specs`) computes
its ``__all__`` with ``prefixflight.core._lazy.lazy_attributes`` and re-exports each of its
names explicitly (``from .cache import LRU as LRU``, the form mypy --strict reads). Griffe
reads only a literal ``__all__``: for a module that assigns one griffe cannot read, this
extension takes the exports from those re-exports (at the top level or in an ``if`` block,
``if typing.TYPE_CHECKING:`` included), so the reference documents the names ``__all__``
holds at run time (tests/test_exports.py checks that the two agree).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

import griffe


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module's top level, with those of its ``if`` blocks."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _statements(statement.body + statement.orelse)
        else:
            yield statement


def _assigns_all(statement: ast.stmt) -> bool:
    """Whether ``statement`` assigns ``__all__`` (alone or unpacked with other names)."""
    return isinstance(statement, ast.Assign) and any(
        isinstance(name, ast.Name) and name.id == "__all__"
        for target in statement.targets
        for name in ast.walk(target)
    )


class ReexportsAreExports(griffe.Extension):
    """Sets the exports of a module that assigns an ``__all__`` griffe cannot read."""

    def on_module_members(self, *, node: object, mod: griffe.Module, **kwargs: Any) -> None:
        if mod.exports or not isinstance(node, ast.Module):
            return
        statements = list(_statements(node.body))
        if any(_assigns_all(statement) for statement in statements):
            mod.exports = [
                alias.name
                for statement in statements
                if isinstance(statement, ast.ImportFrom)
                for alias in statement.names
                if alias.asname == alias.name
            ]
