"""Mooncake FAST'25 trace records: parsing is a pure function of text.

One JSON object per line: ``{"timestamp", "input_length", "output_length", "hash_ids"}``.
``hash_ids`` are already block-level; ``timestamp`` and ``output_length`` are optional here.
Opening and streaming files is the shell's job (`prefixflight.cli`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from json.scanner import make_scanner
from typing import Any, TypeAlias, cast, final

import attrs

from .._errors import TraceFormatError
from ..validate import is_int, is_real

__all__ = ["TraceReader", "TraceRecord", "parse_trace_line"]


_INT = frozenset({int})


@final
@attrs.frozen(kw_only=True)
class TraceRecord:
    """One request of a trace."""

    input_length: int
    hash_ids: tuple[int, ...]
    timestamp: float | None = None
    output_length: int | None = None


def parse_trace_line(text: str | bytes, *, source: str = "<trace>", line: int = 1) -> TraceRecord:
    """Parse one line; raise `TraceFormatError` naming ``source``, ``line`` and the field.

    Bytes must be UTF-8; the error for bytes that are not names the line and the column.
    NaN and infinite timestamps are rejected; so is JSON nested too deeply to parse.
    """
    n, ids, ts, out = _parse_fields(text, source, line)
    return TraceRecord(input_length=n, hash_ids=tuple(ids), timestamp=ts, output_length=out)


_Fields: TypeAlias = tuple[int, list[int], float | None, int | None]
Decoder: TypeAlias = Callable[[str | bytes], _Fields]
"""A fast decoder of one trace line's fields (see `TraceReader`)."""

# the scanner behind `json.loads` (C, from the standard library's `_json`, where it exists)
_scan_once: Callable[[str, int], tuple[object, int]] = make_scanner(cast(Any, json.JSONDecoder()))
_JSON_SPACE = " \t\n\r"


def _loads(text: str) -> object:
    """`json.loads(text)`, without its per-call Python layers when ``text`` is one JSON
    value with nothing but JSON whitespace after it (what `json.loads` itself would scan
    from position 0); anything else goes through `json.loads`, for its exact result or
    error."""
    try:
        obj, end = _scan_once(text, 0)
    except StopIteration:  # leading whitespace, a byte order mark, not JSON at all
        return json.loads(text)
    if end != len(text) and text[end:].strip(_JSON_SPACE):
        return json.loads(text)  # raises "Extra data"
    return obj


def _parse_fields(text: str | bytes, source: str, line: int) -> _Fields:
    """`parse_trace_line`'s checks, returning the fields (``hash_ids`` as the parsed list)."""
    if isinstance(text, bytes):
        raw = text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start : exc.start + 1].hex()
            raise TraceFormatError(
                source, line, None, f"not valid UTF-8 (byte 0x{bad} at column {exc.start + 1})"
            ) from None
    try:
        obj = _loads(text)
    except ValueError as exc:
        raise TraceFormatError(source, line, None, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise TraceFormatError(source, line, None, "not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(
            source, line, None, f"expected a JSON object, got {type(obj).__name__}"
        )
    if "input_length" not in obj:
        raise TraceFormatError(source, line, "input_length", "missing")
    if "hash_ids" not in obj:
        raise TraceFormatError(source, line, "hash_ids", "missing")
    n = obj["input_length"]
    if not is_int(n):
        raise TraceFormatError(source, line, "input_length", f"expected an int, got {n!r}")
    if n < 0:
        raise TraceFormatError(source, line, "input_length", f"must be >= 0, got {n}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceFormatError(source, line, "hash_ids", f"expected a list, got {ids!r}"[:200])
    if not _INT.issuperset(map(type, ids)):  # exactly int: json makes no subclasses but bool
        # (a name of its own: ``bad`` above is a str, and the compiled build keeps that type)
        wrong = next(h for h in ids if type(h) is not int)
        raise TraceFormatError(
            source, line, "hash_ids", f"expected a list of ints, found {wrong!r}"
        )
    ts = obj.get("timestamp")
    if ts is not None:
        if not is_real(ts):
            raise TraceFormatError(source, line, "timestamp", f"expected a number, got {ts!r}")
        if not math.isfinite(ts):
            raise TraceFormatError(source, line, "timestamp", f"must be finite, got {ts!r}")
    out = obj.get("output_length")
    if out is not None:
        if not is_int(out):
            raise TraceFormatError(source, line, "output_length", f"expected an int, got {out!r}")
        if out < 0:
            raise TraceFormatError(source, line, "output_length", f"must be >= 0, got {out}")
    return n, ids, ts, out


def _strip_bom(text: str | bytes) -> str | bytes:
    if isinstance(text, bytes):
        return text[3:] if text.startswith(b"\xef\xbb\xbf") else text
    return text[1:] if text.startswith("\ufeff") else text


@final
class TraceReader:
    """Records from lines of text, streamed: memory is O(1) in the trace's length.

    Lines are text or UTF-8 bytes; a UTF-8 byte order mark at the start of the first line is
    ignored, and so are blank lines. With ``skip_invalid=True`` a bad line is counted in
    `skipped_lines` and skipped; otherwise it raises `TraceFormatError`.

    ``decode``, if given, is a faster decoder tried on each line first (prefixflight's shell
    gives msgspec's typed JSON decoder when msgspec is installed). It returns the line's
    ``(input_length, hash_ids, timestamp, output_length)`` with the types `parse_trace_line`
    requires (an int, a list of ints, an int, a float or None, an int or None), or raises.
    A line it raises on, or whose values are out of range, goes to `parse_trace_line`'s
    parser, whose record or error is the answer: the same records, errors and skipped lines
    with or without it.
    """

    def __init__(
        self,
        lines: Iterable[str | bytes],
        *,
        source: str = "<trace>",
        skip_invalid: bool = False,
        decode: Decoder | None = None,
    ) -> None:
        self._lines = lines
        self.source = source
        self.skip_invalid = skip_invalid
        self.skipped_lines = 0
        self.lines_read = 0
        self._decode = decode

    def __iter__(self) -> Iterator[TraceRecord]:
        for n, ids, ts, out in self._fields():
            yield TraceRecord(input_length=n, hash_ids=tuple(ids), timestamp=ts, output_length=out)

    def _requests(self) -> Iterator[tuple[int, list[int]]]:
        """``(input_length, hash_ids)`` of every record, checked exactly as `__iter__` checks
        them but without building `TraceRecord` objects: what a replay reads."""
        for n, ids, _, _ in self._fields():
            yield n, ids

    def _fields(self) -> Iterator[_Fields]:
        source = self.source
        decode = self._decode
        isfinite = math.isfinite
        for number, text in enumerate(self._lines, start=1):
            self.lines_read = number
            if number == 1:
                text = _strip_bom(text)
            if not text or text.isspace():  # blank (no copy, unlike strip)
                continue
            if decode is not None:
                try:
                    fields = decode(text)
                except Exception:  # the reference parser below decides, and names the error
                    pass
                else:
                    n, _, ts, out = fields  # the ranges `_parse_fields` checks
                    if n >= 0 and (ts is None or isfinite(ts)) and (out is None or out >= 0):
                        yield fields
                        continue
            try:
                yield _parse_fields(text, source, number)
            except TraceFormatError:
                if not self.skip_invalid:
                    raise
                self.skipped_lines += 1
