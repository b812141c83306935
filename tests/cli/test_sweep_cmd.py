"""``prefixflight sweep``: table, JSON schema, plot, errors; numbers equal per-capacity replays."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefixflight.cli import main
from prefixflight.cli._sweep_cmd import sweep
from prefixflight.core import TraceRecord, replay


def _write_trace(path: Path, n: int = 120, seed: int = 7) -> list[TraceRecord]:
    rng = random.Random(seed)
    records = []
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            prefix = [0, 1, 2][: rng.randint(0, 3)] if i % 3 else [50, 51]
            ids = prefix + [rng.randint(3, 60) for _ in range(rng.randint(0, 6))]
            length = max(0, len(ids) * 512 - rng.randint(0, 511))
            fh.write(
                json.dumps(
                    {"timestamp": i, "input_length": length, "output_length": 1, "hash_ids": ids}
                )
                + "\n"
            )
            records.append(TraceRecord(input_length=length, hash_ids=tuple(ids)))
    return records


def _expected(records: list[TraceRecord], policy: str, cap: int) -> dict[str, object]:
    report = replay(records, policy=policy, cache_capacity_blocks=cap)
    return {
        "capacity": cap,
        "total_hit_tokens": report.total_hit_tokens,
        "overall_hit_rate": report.overall_hit_rate,
        "final_cache_blocks": report.final_cache_blocks,
    }


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sweep_json_equals_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    trace = tmp_path / "t.jsonl"
    records = _write_trace(trace)
    out = tmp_path / "curves.json"
    status = main(
        [
            "sweep",
            str(trace),
            "--policy",
            "s3fifo",
            "--policy",
            "LRU",
            "--capacities",
            "8,0,3,20",
            "--json",
            str(out),
            "-j",
            jobs,
            "-q",
        ]
    )
    assert status == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"trace", "capacities", "curves"}
    assert doc["trace"] == str(trace)
    assert doc["capacities"] == [0, 3, 8, 20]
    assert list(doc["curves"]) == ["s3fifo", "lru"]
    for policy, points in doc["curves"].items():
        assert points == [_expected(records, policy, c) for c in doc["capacities"]]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["capacity", "s3fifo", "hit"]
    assert [line.split()[0] for line in table[1:]] == ["0", "3", "8", "20"]
    lru20 = doc["curves"]["lru"][3]
    assert f"{100 * lru20['overall_hit_rate']:.3f}%" in table[4]


def test_auto_capacities_end_at_the_distinct_block_count(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    records = _write_trace(trace, n=60)
    distinct = len({b for r in records for b in r.hash_ids})
    doc = sweep(str(trace), ["lru"], None)
    assert doc["capacities"][-1] == distinct
    assert doc["curves"]["lru"][-1]["final_cache_blocks"] == distinct


def test_the_help_says_which_capacities_auto_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    from prefixflight.core.cache import auto_capacities

    defaults = inspect.signature(auto_capacities).parameters
    points, smallest = defaults["points"].default, defaults["smallest"].default
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"'auto': about {points} log-spaced from {smallest} blocks up to the trace's" in text
    assert "every capacity" not in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, n=40)
    png = tmp_path / "curve.png"
    assert (
        main(["sweep", str(trace), "--capacities", "0,2,4,16", "--plot", str(png), "-j", "1", "-q"])
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["sweep", "-", "--capacities", "4"], 2, "give a file"),
        (["sweep", "missing.jsonl", "--capacities", "4", "--policy", "lru"], 1, "missing.jsonl"),
        (["sweep", "x", "--capacities", "4,big"], 2, "'big'"),
        (["sweep", "x", "--capacities", "-3"], 2, "-3"),
        (["sweep", "x", "--capacities", "4", "--policy", "lfu"], 2, "'lfu'"),
        (["sweep", "x", "--capacities", "4", "--block-size", "0"], 2, "--block-size"),
        (["sweep", "x", "--capacities", "4", "--jobs", "0"], 2, "--jobs"),
        (["sweep", "x", "--capacities", "4", "--ghost-admit-freq", "4"], 2, "ghost_admit_freq"),
        (["sweep", "x", "--capacities", "4", "--json", ""], 2, "--json"),
    ],
)
def test_bad_input_exits_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    if status == 2:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    else:
        assert main(argv) == status
    assert message in capsys.readouterr().err


def test_bad_trace_line_in_a_worker_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"input_length": 3, "hash_ids": [1]}\n{"input_length": "x"}\n')
    assert (
        main(["sweep", str(trace), "--capacities", "1,2", "--policy", "s3fifo", "-j", "2", "-q"])
        == 1
    )
    assert "bad.jsonl:2" in capsys.readouterr().err
