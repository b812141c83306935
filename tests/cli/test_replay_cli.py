from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixflight.cli import bundled_trace, main

LINES = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 700, "output_length": 5, "hash_ids": [1, 3]},
    {"timestamp": 2, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return path


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, object], str]:
    status = main(args)
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 and out else {}), err


def test_replay_prints_the_report(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, report, _ = run(
        ["replay", str(trace), "--capacity-blocks", "8", "--policy", "LRU", "--per-request"], capsys
    )
    assert status == 0
    assert report["policy"] == "lru"
    assert report["total_hit_tokens"] == 512 + 1024
    assert report["per_request"] == [
        {"idx": 0, "prompt_tokens": 1000, "hit_tokens": 0},
        {"idx": 1, "prompt_tokens": 700, "hit_tokens": 512},
        {"idx": 2, "prompt_tokens": 1024, "hit_tokens": 1024},
    ]


def test_gzip_stdin_and_output_file_agree(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes()))
    _, plain, _ = run(["replay", str(trace), "--capacity-blocks", "4"], capsys)
    _, zipped, _ = run(["replay", str(gz), "--capacity-blocks", "4"], capsys)
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--capacity-blocks", "4", "-o", str(out)]) == 0
    piped = subprocess.run(
        [sys.executable, "-m", "prefixflight.cli", "replay", "-", "--capacity-blocks", "4"],
        input=trace.read_text(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert plain == zipped == json.loads(out.read_text()) == json.loads(piped.stdout)


def test_config_file_and_flag_override(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"policy": "S3FIFO", "cache_capacity_blocks": 2, "block_size": 256}))
    _, report, _ = run(
        ["replay", str(trace), "--config", str(cfg), "--capacity-blocks", "6"], capsys
    )
    assert (report["policy"], report["cache_capacity_blocks"], report["block_size"]) == (
        "s3fifo",
        6,
        256,
    )
    assert report["length_mismatch_lines"] == 3  # 2 hash ids for 1000 tokens at 256


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"input_length": 5, "hash_ids": [1]}\nnot json\n', ":2: not valid JSON"),
        ('{"input_length": true, "hash_ids": [1]}\n', ":1: field 'input_length'"),
        ('{"input_length": 5}\n', ":1: field 'hash_ids': missing"),
    ],
)
def test_bad_input_exits_1_naming_file_line_and_field(
    tmp_path: Path, content: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    status, _, err = run(["replay", str(path), "--capacity-blocks", "4"], capsys)
    assert status == 1
    assert f"{path}{fragment}" in err
    assert "Traceback" not in err


def test_skip_invalid_reports_skipped_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"input_length": 5, "hash_ids": [1]}\n[]\n{"input_length": -1, "hash_ids": []}\n'
    )
    status, report, _ = run(
        ["replay", str(path), "--capacity-blocks", "4", "--skip-invalid"], capsys
    )
    assert status == 0
    assert report["skipped_lines"] == 2 and report["total_requests"] == 1


@pytest.mark.parametrize(
    ("args", "status", "fragment"),
    [
        (["replay", "x.jsonl"], 2, "--capacity-blocks is required"),
        (["replay", "x.jsonl", "--capacity-blocks", "4", "--policy", "fifo"], 2, "'fifo'"),
        (["replay", "x.jsonl", "--capacity-blocks", "four"], 2, "'four'"),
        (["replay", "missing.jsonl", "--capacity-blocks", "4"], 1, "missing.jsonl"),
        (["replay", "bundled:nope", "--capacity-blocks", "4"], 1, "'nope'"),
        (["replay", "bundled:synthetic", "--capacity-blocks", "-4"], 2, "-4"),
        (["replay", "bundled:synthetic", "--capacity-blocks", "4", "--small-ratio", "2"], 2, "'2'"),
        (
            ["replay", "bundled:synthetic", "--capacity-blocks", "4", "--config", "nope.json"],
            1,
            "nope.json",
        ),
    ],
)
def test_usage_and_input_errors_exit_without_traceback(
    args: list[str], status: int, fragment: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prefixflight.cli", *args], capture_output=True, text=True
    )
    assert proc.returncode == status
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_main_job_replays_the_bundled_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert bundled_trace("conversation").is_file()
    status, report, _ = run(
        ["replay", "bundled:conversation", "--capacity-blocks", "4096", "-q"], capsys
    )
    assert status == 0 and report["total_requests"] == 12031
