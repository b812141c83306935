"""One exception hierarchy for everything prefixflight rejects.

Any other exception escaping from the core is a bug.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = [
    "CapacityError",
    "ConfigError",
    "PrefixflightError",
    "TraceFormatError",
    "UsageError",
]


class PrefixflightError(Exception):
    """Base class of every error prefixflight raises on purpose."""


class UsageError(PrefixflightError, ValueError):
    """The caller's mistake: an unknown or duplicate id, a bad argument, a bad event.

    A rejected call leaves the component's state exactly as it was.
    """


class ConfigError(UsageError):
    """Invalid configuration; the message names the offending value."""


class CapacityError(PrefixflightError):
    """Nothing can be freed right now (every candidate block is pinned).

    The state is unchanged; retry once something has been unpinned. For a batch call,
    ``applied`` says how many items were applied before the one that failed; what those
    items evicted comes back in ``evicted`` (``(block, page)`` pairs, as the call would have
    returned them) and the caller's pages the cache did not keep in ``unused_pages``, so no
    page is ever lost.
    """

    def __init__(
        self,
        message: str,
        *,
        applied: int = 0,
        evicted: Iterable[tuple[Hashable, int | None]] = (),
        unused_pages: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.applied = applied
        self.evicted: list[tuple[Hashable, int | None]] = list(evicted)
        self.unused_pages: list[int] = list(unused_pages)


class TraceFormatError(UsageError):
    """A trace line that cannot be used, with the file, the line number and the field."""

    def __init__(self, source: str, line: int, field: str | None, message: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.reason = message
        where = f"{source}:{line}"
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{message}")

    def __reduce__(self) -> tuple[type[TraceFormatError], tuple[str, int, str | None, str]]:
        return (type(self), (self.source, self.line, self.field, self.reason))
