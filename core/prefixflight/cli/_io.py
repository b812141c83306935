"""Files and streams: opening traces (plain, gzip, stdin, bundled), writing output."""

from __future__ import annotations

import gzip
import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import IO

from prefixflight.core import TraceReader, UsageError

__all__ = ["BUNDLED_TRACES", "bundled_trace", "open_trace", "read_trace"]

BUNDLED_TRACES = {
    "conversation": "conversation_trace.jsonl.gz",
    "synthetic": "synthetic_trace.jsonl.gz",
}
"""Real Mooncake FAST'25 traces shipped with the package (see data/SOURCE.md)."""


def bundled_trace(name: str) -> Path:
    """The path of a bundled trace: ``"conversation"`` or ``"synthetic"``."""
    try:
        filename = BUNDLED_TRACES[name]
    except KeyError:
        choices = ", ".join(sorted(BUNDLED_TRACES))
        raise UsageError(f"no bundled trace {name!r}; choose one of: {choices}") from None
    return Path(str(resources.files("prefixflight.cli").joinpath("data", filename)))


def _resolve(spec: str) -> str | Path:
    if spec.startswith("bundled:"):
        return bundled_trace(spec.removeprefix("bundled:"))
    return spec


@contextmanager
def open_trace(spec: str | Path) -> Iterator[IO[str]]:
    """Open a trace for streaming text lines: a path, a ``.gz`` file, ``-`` (stdin) or
    ``bundled:NAME``. Raises `UsageError` naming the file if it cannot be opened."""
    target = _resolve(spec) if isinstance(spec, str) else spec
    if target == "-":
        yield sys.stdin
        return
    path = Path(target)
    try:
        with path.open("rb") as probe:
            magic = probe.read(2)
    except OSError as exc:
        raise UsageError(f"cannot open trace {str(path)!r}: {exc.strerror or exc}") from None
    if magic == b"\x1f\x8b":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            yield fh
    else:
        with path.open("r", encoding="utf-8") as fh:
            yield fh


@contextmanager
def read_trace(spec: str | Path, *, skip_invalid: bool = False) -> Iterator[TraceReader]:
    """A streaming `TraceReader` over a trace file; errors name the file and line."""
    name = "<stdin>" if spec == "-" else str(spec)
    with open_trace(spec) as fh:
        try:
            yield TraceReader(fh, source=name, skip_invalid=skip_invalid)
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, io.UnsupportedOperation) as exc:
            raise UsageError(f"cannot read trace {name!r}: {exc}") from None
