"""Progress bars on stderr, only when stderr is a terminal (tqdm)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(
    items: Iterable[T], *, desc: str, unit: str, total: int | None = None, quiet: bool = False
) -> Iterable[T]:
    """Wrap ``items`` in a tqdm bar on stderr unless quiet or stderr is not a terminal;
    otherwise ``items`` itself (so a `TraceReader` reaches `replay` as one, and `replay`
    reads its fields without building a `TraceRecord` per line)."""
    if quiet or sys.stderr is None or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is not installed: no bar
        return items
    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False)
