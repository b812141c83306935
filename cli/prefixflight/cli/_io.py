"""Files and streams: opening traces (plain, gzip, stdin, bundled), writing output.

Traces are read as bytes, line by line, and every line is decoded and parsed by the core's
pure `TraceReader`: a line that is not UTF-8 is a per-line error with its line number (and
skippable), on stdin as in a file. When msgspec is installed (the ``serve`` extra), its typed
JSON decoder reads each line first, about four times faster than the standard library's; a
line it does not accept goes to the core's parser, so the records, errors and skipped lines
are the same with or without it. Gzip data is recognised by its magic bytes, on stdin too.
Output files are written atomically: a temporary file beside the target, then a rename, so a
failed write (a full disk, a file-size limit) leaves the previous file as it was and no
partial file behind.
"""

from __future__ import annotations

import gzip
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from prefixflight.core import PrefixflightError, UsageError
from prefixflight.core.cache import TraceReader

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable
    from pathlib import Path
    from typing import TypeAlias

    _Fields: TypeAlias = tuple[int, list[int], float | None, int | None]

__all__ = [
    "BUNDLED_TRACES",
    "InputError",
    "OutputError",
    "bundled_trace",
    "open_trace",
    "read_trace",
    "write_atomic",
    "write_stdout",
]

BUNDLED_TRACES = {
    "conversation": "conversation_trace.jsonl.gz",
    "synthetic": "synthetic_trace.jsonl.gz",
}
"""Real Mooncake FAST'25 traces shipped with the package (see data/SOURCE.md)."""

_GZIP_MAGIC = b"\x1f\x8b"


class InputError(UsageError):
    """An input that cannot be read: a missing file, corrupt gzip data, a closed stdin."""


class OutputError(PrefixflightError):
    """An output that cannot be written: a full disk, a file-size limit, a closed stdout."""


def _bundled_filename(name: str) -> str:
    try:
        return BUNDLED_TRACES[name]
    except KeyError:
        choices = ", ".join(sorted(BUNDLED_TRACES))
        raise InputError(f"no bundled trace {name!r}; choose one of: {choices}") from None


def bundled_trace(name: str) -> Traversable:
    """The bundled trace ``"conversation"`` or ``"synthetic"``, as a package resource.

    Open it with ``.open("rb")``, or get a file system path with
    ``importlib.resources.as_file`` (it works from a zipped install too).
    """
    filename = _bundled_filename(name)
    from importlib import resources

    return resources.files("prefixflight.cli").joinpath("data", filename)


def _stdin() -> IO[bytes]:
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise InputError("cannot read the trace from stdin: stdin is closed")
    try:
        buffer: IO[bytes] = sys.stdin.buffer
        buffer.fileno()
    except (AttributeError, OSError, ValueError) as exc:
        raise InputError(f"cannot read the trace from stdin: {exc}") from None
    return buffer


def _peek(stream: IO[bytes], n: int) -> bytes:
    peek = getattr(stream, "peek", None)
    if peek is None:
        return b""
    try:
        data: bytes = peek(n)
    except OSError as exc:  # e.g. stdin closed at the file-descriptor level
        raise InputError(f"cannot read the trace from stdin: {exc.strerror or exc}") from None
    return data[:n]


@contextmanager
def _bundled_path(name: str) -> Iterator[str]:
    """A file system path of a bundled trace: the package's own file in a regular install
    (without importing `importlib.resources`, which costs start-up time), a temporary copy
    from ``importlib.resources.as_file`` otherwise (e.g. a zipped install)."""
    filename = _bundled_filename(name)
    here = os.path.join(os.path.dirname(__file__), "data", filename)
    if os.path.isfile(here):
        yield here
        return
    from importlib import resources

    with resources.as_file(bundled_trace(name)) as path:
        yield str(path)


@contextmanager
def open_trace(spec: str | Path) -> Iterator[Iterable[bytes]]:
    """Open a trace as a binary stream of lines: a path, a ``.gz`` file, ``-`` (stdin) or
    ``bundled:NAME``; gzip data is detected by its magic bytes, on stdin too. Raises a
    `PrefixflightError` naming the file if it cannot be opened."""
    if isinstance(spec, str) and spec.startswith("bundled:"):
        with _bundled_path(spec.removeprefix("bundled:")) as path, open_trace(path) as fh:
            yield fh
        return
    if spec == "-":
        stdin = _stdin()
        if _peek(stdin, 2) == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=stdin, mode="rb") as gz:
                yield gz
        else:
            yield stdin
        return
    path = os.fspath(spec)
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise InputError(f"cannot open trace {path!r}: {exc.strerror or exc}") from None
    with fh:
        if fh.peek(2)[:2] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
                yield gz
        else:
            yield fh


def _checked_lines(stream: Iterable[bytes], name: str) -> Iterator[bytes]:
    """The stream's lines; a read error (corrupt gzip data, an I/O error) becomes one
    `InputError` naming the file and the last line read."""
    number = 0
    try:
        for number, line in enumerate(stream, start=1):  # noqa: B007 (named in errors)
            yield line
    except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise InputError(
            f"{name}: corrupt or truncated gzip data after line {number} "
            f"({str(exc) or type(exc).__name__})"
        ) from None
    except OSError as exc:
        reason = exc.strerror or exc
        raise InputError(f"{name}: cannot read after line {number}: {reason}") from None


def msgspec_decoder() -> Callable[[str | bytes], _Fields] | None:
    """A `TraceReader` ``decode``: msgspec's typed JSON decoder of a trace line's four fields
    (``None`` if msgspec is not installed). It raises on anything but a JSON object with an
    int ``input_length``, a list of ints ``hash_ids`` and optional number ``timestamp`` and
    int ``output_length`` (never a bool); on a line that is not UTF-8 (decoded first: msgspec
    skips the strings of fields it ignores without checking them); and on a line with a run
    of digits longer than the interpreter's integer string limit (which `json` rejects and
    msgspec skips in an ignored field)."""
    try:
        import msgspec
    except ImportError:
        return None
    import re

    from msgspec.structs import astuple

    class Line(msgspec.Struct, gc=False):  # ints and a list: nothing to collect
        input_length: int
        hash_ids: list[int]
        timestamp: int | float | None = None
        output_length: int | None = None

    decode: Callable[[str], Any] = msgspec.json.Decoder(Line).decode
    limit: int = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    long_digits = re.compile(f"[0-9]{{{limit + 1}}}")

    def fields(line: str | bytes) -> _Fields:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        if limit and len(text) > limit and long_digits.search(text):
            raise ValueError("a number longer than the integer string limit")
        return astuple(decode(text))  # the four fields, typed by `Line`

    return fields


@contextmanager
def read_trace(
    spec: str | Path, *, skip_invalid: bool = False, fast: bool = True
) -> Iterator[TraceReader]:
    """A streaming `TraceReader` over a trace file; errors name the file and line.

    Bad lines raise `TraceFormatError` (or are skipped with ``skip_invalid``); corrupt or
    truncated gzip data and read errors raise `InputError` naming the file and the last
    line read (they are not line-local, so ``skip_invalid`` does not skip them). ``fast``:
    decode lines with msgspec first when it is installed (`msgspec_decoder`); the records
    and errors are the same either way.
    """
    name = "<stdin>" if spec == "-" else str(spec)
    with open_trace(spec) as fh:
        decode = msgspec_decoder() if fast else None
        yield TraceReader(
            _checked_lines(fh, name), source=name, skip_invalid=skip_invalid, decode=decode
        )


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """A temporary path beside ``target`` to write; renamed over ``target`` on success.

    On any failure the temporary file is removed and ``target`` is left as it was; an
    `OSError` becomes `OutputError` naming ``target``.
    """
    import tempfile
    from pathlib import Path

    path = Path(target)
    try:
        fd, tmp_name = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix
        )
    except OSError as exc:
        raise OutputError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(target: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically (see `atomic_path`)."""
    with atomic_path(target) as tmp, tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout and flush; `OutputError` if stdout cannot take it (a full
    device, a closed stdout). `BrokenPipeError` (a reader that went away) propagates."""
    out = sys.stdout
    if out is None:
        raise OutputError("cannot write to stdout: stdout is closed")
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise OutputError(f"cannot write to stdout: {reason}") from None
