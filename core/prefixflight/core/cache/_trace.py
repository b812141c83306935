"""Mooncake FAST'25 trace records: parsing is a pure function of text.

One JSON object per line: ``{"timestamp", "input_length", "output_length", "hash_ids"}``.
``hash_ids`` are already block-level; ``timestamp`` and ``output_length`` are optional here.
Opening and streaming files is the shell's job (`prefixflight.cli`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import final

import attrs

from .._errors import TraceFormatError

__all__ = ["TraceReader", "TraceRecord", "parse_trace_line"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@attrs.frozen(kw_only=True)
class TraceRecord:
    """One request of a trace."""

    input_length: int
    hash_ids: tuple[int, ...]
    timestamp: float | None = None
    output_length: int | None = None


def parse_trace_line(text: str | bytes, *, source: str = "<trace>", line: int = 1) -> TraceRecord:
    """Parse one line; raise `TraceFormatError` naming ``source``, ``line`` and the field."""
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceFormatError(source, line, None, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(
            source, line, None, f"expected a JSON object, got {type(obj).__name__}"
        )
    if "input_length" not in obj:
        raise TraceFormatError(source, line, "input_length", "missing")
    if "hash_ids" not in obj:
        raise TraceFormatError(source, line, "hash_ids", "missing")
    n = obj["input_length"]
    if not _is_int(n):
        raise TraceFormatError(source, line, "input_length", f"expected an int, got {n!r}")
    if n < 0:
        raise TraceFormatError(source, line, "input_length", f"must be >= 0, got {n}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceFormatError(source, line, "hash_ids", f"expected a list, got {ids!r}"[:200])
    for h in ids:
        if not _is_int(h):
            raise TraceFormatError(
                source, line, "hash_ids", f"expected a list of ints, found {h!r}"
            )
    ts = obj.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise TraceFormatError(source, line, "timestamp", f"expected a number, got {ts!r}")
    out = obj.get("output_length")
    if out is not None:
        if not _is_int(out):
            raise TraceFormatError(source, line, "output_length", f"expected an int, got {out!r}")
        if out < 0:
            raise TraceFormatError(source, line, "output_length", f"must be >= 0, got {out}")
    return TraceRecord(input_length=n, hash_ids=tuple(ids), timestamp=ts, output_length=out)


@final
class TraceReader:
    """Records from lines of text, streamed: memory is O(1) in the trace's length.

    Blank lines are ignored. With ``skip_invalid=True`` a bad line is counted in
    `skipped_lines` and skipped; otherwise it raises `TraceFormatError`.
    """

    def __init__(
        self,
        lines: Iterable[str | bytes],
        *,
        source: str = "<trace>",
        skip_invalid: bool = False,
    ) -> None:
        self._lines = lines
        self.source = source
        self.skip_invalid = skip_invalid
        self.skipped_lines = 0
        self.lines_read = 0

    def __iter__(self) -> Iterator[TraceRecord]:
        source = self.source
        for number, text in enumerate(self._lines, start=1):
            self.lines_read = number
            if not text.strip():
                continue
            try:
                yield parse_trace_line(text, source=source, line=number)
            except TraceFormatError:
                if not self.skip_invalid:
                    raise
                self.skipped_lines += 1
