from __future__ import annotations

import pytest

from prefixflight.core import TraceFormatError, TraceReader, TraceRecord, parse_trace_line


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        ("not json", None, "not valid JSON"),
        ("[1, 2]", None, "expected a JSON object, got list"),
        ('{"hash_ids": []}', "input_length", "missing"),
        ('{"input_length": 3}', "hash_ids", "missing"),
        ('{"input_length": true, "hash_ids": []}', "input_length", "True"),
        ('{"input_length": 1.5, "hash_ids": []}', "input_length", "1.5"),
        ('{"input_length": -4, "hash_ids": []}', "input_length", "-4"),
        ('{"input_length": 4, "hash_ids": [1, false]}', "hash_ids", "False"),
        ('{"input_length": 4, "hash_ids": "abc"}', "hash_ids", "abc"),
        ('{"input_length": 4, "hash_ids": [], "timestamp": "x"}', "timestamp", "x"),
        ('{"input_length": 4, "hash_ids": [], "output_length": -1}', "output_length", "-1"),
    ],
)
def test_bad_lines_name_file_line_and_field(line: str, field: str | None, fragment: str) -> None:
    with pytest.raises(TraceFormatError) as info:
        parse_trace_line(line, source="t.jsonl", line=7)
    err = info.value
    assert (err.source, err.line, err.field) == ("t.jsonl", 7, field)
    assert str(err).startswith("t.jsonl:7: ")
    assert fragment in str(err)


def test_a_good_line() -> None:
    rec = parse_trace_line(
        '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}'
    )
    assert rec == TraceRecord(input_length=700, hash_ids=(1, 2), timestamp=5, output_length=3)


def test_reader_streams_skips_blank_lines_and_counts_skipped() -> None:
    lines = [
        '{"input_length": 1, "hash_ids": [1]}',
        "",
        "oops",
        '{"input_length": 2, "hash_ids": []}',
    ]
    with pytest.raises(TraceFormatError, match="x:3"):
        list(TraceReader(lines, source="x"))
    reader = TraceReader(lines, source="x", skip_invalid=True)
    assert [r.input_length for r in reader] == [1, 2]
    assert reader.skipped_lines == 1


def test_trace_errors_cross_process_boundaries() -> None:
    import pickle

    err = TraceFormatError("t.jsonl", 3, "hash_ids", "missing")
    back = pickle.loads(pickle.dumps(err))
    assert (back.source, back.line, back.field, str(back)) == ("t.jsonl", 3, "hash_ids", str(err))
