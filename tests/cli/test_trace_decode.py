"""The shell's msgspec decoding of trace lines changes nothing: the same records, the same
errors (file, line, field, message) and the same skipped lines as the core's pure parser."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflight.cli import read_trace
from prefixflight.cli._io import msgspec_decoder
from prefixflight.core import TraceFormatError
from prefixflight.core.cache import TraceReader

pytest.importorskip("msgspec")
DECODE = msgspec_decoder()

_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)
_FIELD = st.sampled_from(["input_length", "hash_ids", "timestamp", "output_length", "x"])


@st.composite
def _line(draw: st.DrawFn) -> str | bytes:
    """A record that is valid, or one with a field of any JSON type, a missing or repeated
    field, an unusual number or string, or not JSON, not UTF-8 or not an object at all."""
    rec: dict[str, object] = {
        "input_length": draw(st.integers(min_value=-2, max_value=2**64)),
        "hash_ids": draw(st.lists(st.integers(min_value=-(2**64), max_value=2**65), max_size=4)),
    }
    if draw(st.booleans()):
        rec["timestamp"] = draw(st.integers(-5, 10**20) | st.floats(allow_nan=True))
    if draw(st.booleans()):
        rec["output_length"] = draw(st.integers(min_value=-2, max_value=2**64) | _VALUE)
    for _ in range(draw(st.integers(0, 2))):
        rec[draw(_FIELD)] = draw(_VALUE)
    if draw(st.booleans()):
        rec.pop(draw(_FIELD), None)
    text = json.dumps(rec)
    kinds = ["json", "dupe", "splice", "raw", "bytes", "badstring", "value", "digits"]
    kind = draw(st.sampled_from(kinds))
    if kind == "dupe":  # a repeated key: json takes the last value
        text = text[:-1] + f', "{draw(_FIELD)}": {json.dumps(draw(_VALUE))}}}'
    elif kind == "splice":  # an unusual token where a value goes
        token = draw(st.sampled_from(["NaN", "-Infinity", "1e400", "01", '"\\ud800"', "1.0"]))
        text = text[:-1] + f', "{draw(_FIELD)}": {token}}}'
    elif kind == "raw":
        text = draw(st.text(alphabet='{}[]",:0123456789.eE+-nulltruefals \t', max_size=20))
    elif kind == "value":
        text = json.dumps(draw(_VALUE))
    elif kind == "digits":  # past the interpreter's limit on an int's digits: json rejects it
        text = text[:-1] + f', "x": {"7" * 4400}}}'
    if kind in ("bytes", "badstring") or draw(st.booleans()):
        data = text.encode()
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b""]))
        if kind == "bytes":
            data += bad
        elif kind == "badstring":  # not UTF-8 inside the string of a field nobody reads
            data = data[:-1] + b', "x": "' + bad + b'"}'
        return data + draw(st.sampled_from([b"", b"\n", b"\r\n", b" "]))
    return text


def _outcome(lines: list[str | bytes], decode: object, skip: bool) -> object:
    reader = TraceReader(lines, source="t.jsonl", skip_invalid=skip, decode=decode)  # type: ignore[arg-type]
    try:
        records = list(reader)
    except TraceFormatError as exc:
        return ("error", exc.source, exc.line, exc.field, str(exc))
    return (json.dumps([repr(r) for r in records]), reader.skipped_lines, reader.lines_read)


@settings(max_examples=400)
@given(lines=st.lists(_line(), min_size=1, max_size=6), skip=st.booleans())
def test_msgspec_lines_read_exactly_as_the_pure_parser_reads_them(
    lines: list[str | bytes], skip: bool
) -> None:
    assert DECODE is not None
    assert _outcome(lines, DECODE, skip) == _outcome(lines, None, skip)


def test_fields_come_back_with_their_json_types() -> None:
    assert DECODE is not None
    line = b'{"timestamp": 5, "input_length": 7, "hash_ids": [1, 2], "output_length": 3}\n'
    assert DECODE(line) == (7, [1, 2], 5, 3)
    assert type(DECODE(b'{"timestamp": 5.0, "input_length": 1, "hash_ids": []}')[2]) is float
    for bad in (b'{"input_length": true, "hash_ids": []}', b"\xff", b'{"hash_ids": []}'):
        with pytest.raises(Exception):  # noqa: B017 (any error: the pure parser decides)
            DECODE(bad)


def _trace(tmp_path: Path) -> Path:
    lines = [
        b'{"input_length": 700, "hash_ids": [1, 2]}',
        b'{"input_length": 700, "hash_ids": [1, true]}',
        b"\xff\xfe",
        b"",
        b'{"input_length": 1024, "hash_ids": [1, 2], "timestamp": 1e999}',
        b'{"input_length": 512, "hash_ids": [1], "input_length": 600}',
    ]
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    return path


@pytest.mark.parametrize("skip", [False, True])
def test_read_trace_with_and_without_msgspec(tmp_path: Path, skip: bool) -> None:
    path = _trace(tmp_path)
    got = []
    for fast in (True, False):
        with read_trace(path, skip_invalid=skip, fast=fast) as reader:
            got.append(_outcome(list(reader._lines), reader._decode, skip))
    assert got[0] == got[1]
    if not skip:
        assert got[0][0] == "error" and got[0][2] == 2  # type: ignore[index]


def test_the_cli_without_msgspec_prints_the_same(tmp_path: Path) -> None:
    """``prefixflight replay`` with msgspec and with it made unimportable: the same report,
    the same skipped lines, the same error."""
    path = _trace(tmp_path)
    block = "import sys; sys.modules['msgspec'] = None; "  # `import msgspec` now fails
    outs = []
    for prefix in ("", block):
        code = prefix + "from prefixflight.cli import main; sys.exit(main())"
        if not prefix:
            code = "import sys; " + code
        runs = []
        argv = [sys.executable, "-c", code, "replay", str(path), "--capacity-blocks", "8"]
        for extra in (["--skip-invalid"], []):
            proc = subprocess.run(
                [*argv, *extra],
                capture_output=True,
                text=True,
            )
            runs.append((proc.returncode, proc.stdout, proc.stderr))
        outs.append(runs)
    assert outs[0] == outs[1]
    assert outs[0][0][0] == 0 and '"skipped_lines": 3' in outs[0][0][1]
    assert outs[0][1][0] == 1 and ":2: field 'hash_ids'" in outs[0][1][2]
