"""Progress bars on stderr, only when stderr is a terminal (tqdm)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(
    items: Iterable[T], *, desc: str, unit: str, total: int | None = None, quiet: bool = False
) -> Iterator[T]:
    """Wrap ``items`` in a tqdm bar on stderr unless quiet or stderr is not a terminal."""
    if quiet or sys.stderr is None or not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is not installed: no bar
        yield from items
        return
    yield from tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False)
