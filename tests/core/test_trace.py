from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflight.core import TraceFormatError, TraceRecord, parse_trace_line
from prefixflight.core.cache import TraceReader
from prefixflight.core.cache._trace import _loads


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


# -- the fast JSON path: exactly `json.loads`, value or error -------------------------------
_JSON_TEXT = st.one_of(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=6,
    ).map(json.dumps),
    st.text(alphabet=' \t\r\n\x0c\ufeff{}[]",:0123456789.eE+-aelnrstuNIfinity', max_size=12),
)


@settings(max_examples=300)
@given(text=_JSON_TEXT, before=st.sampled_from(["", " ", "\ufeff", "\n"]),
       after=st.sampled_from(["", " ", "\n", " \t\r\n", "\x0c", " 1", "}", "\u00a0"]))  # fmt: skip
def test_the_fast_json_path_is_json_loads(text: str, before: str, after: str) -> None:
    line = before + text + after
    try:
        want: object = json.loads(line)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)) as got:
            _loads(line)
        assert str(got.value) == str(exc)
        return
    got_value = _loads(line)
    assert json.dumps(got_value) == json.dumps(want)  # NaN != NaN: compare the texts


def test_replay_reads_fields_without_records_but_checks_them_alike() -> None:
    lines = [
        '{"input_length": 3, "hash_ids": [1]}\n',
        '{"input_length": 3, "hash_ids": [true]}\n',
        "\n",
        '{"input_length": 5, "hash_ids": [1, 2], "timestamp": 1e999}\n',
        '{"input_length": 4, "hash_ids": [1]} \n',
    ]
    records = TraceReader(lines, skip_invalid=True)
    fields = TraceReader(lines, skip_invalid=True)
    assert [(r.input_length, list(r.hash_ids)) for r in records] == list(fields._requests())
    assert records.skipped_lines == fields.skipped_lines == 2
    with pytest.raises(TraceFormatError, match="<trace>:2: field 'hash_ids'"):
        list(TraceReader(lines)._requests())
