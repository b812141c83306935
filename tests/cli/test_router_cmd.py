"""``prefixflight simulate router``: the table, the JSON schema, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixflight.cli._main import main

SMALL = ["simulate", "router", "--steps", "2", "--prompts", "4", "--output-tokens", "4:16", "-q"]


def test_prints_both_routers_and_writes_the_json_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert main([*SMALL, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "baseline" in table and "burst" in table and "prefix-cache hit rate" in table
    doc = json.loads(out.read_text())
    assert set(doc) == {"baseline", "burst", "workload"}
    for arm in ("baseline", "burst"):
        for key in (
            "groups_fully_colocated",
            "mean_distinct_replicas",
            "hit_rate",
            "mean_step_time",
            "p95_step_time",
        ):
            assert isinstance(doc[arm][key], float), (arm, key)
    assert doc["burst"]["groups_fully_colocated"] == 1.0
    assert doc["workload"]["samples"] == 8 and doc["workload"]["burst_config"]["window_ms"] == 100


def test_replays_a_bundled_trace_with_a_burst_overlay(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "router",
        "--trace",
        "bundled:conversation",
        "--limit",
        "30",
        "--clones",
        "4",
        "--jitter-ms",
        "5",
        "-q",
    ]
    assert main(argv) == 0
    assert "clone groups fully co-located" in capsys.readouterr().out


def test_a_flag_value_the_config_rejects_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--window-ms", "20000"])
    assert info.value.code == 2
    assert "window_ms must be in 1..10000, got 20000" in capsys.readouterr().err


def test_bad_span_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--prompt-tokens", "a:b"])
    assert info.value.code == 2


def test_prints_the_workload_and_settings_it_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = [*SMALL, "--window-ms", "50", "--min-colocate-blocks", "2", "--balance-by", "tokens"]
    assert main([*argv, "--json", str(out)]) == 0
    head = capsys.readouterr().out.split("\n\n")[0]
    doc = json.loads(out.read_text())["workload"]
    assert f"2 steps x 4 prompts x 8 samples = {doc['requests']} requests, seed 0" in head
    assert "prompts 64-128 tokens" in head and "outputs 4-16" in head
    assert "4 replicas, 65536 cache blocks of 16 tokens" in head
    assert "baseline router: approx (index lag 10 ms)" in head
    assert "burst router: window 50 ms, k -1, blocks of 64 tokens, max prefix tokens 0" in head
    assert "min colocate blocks 2, max batch size 1000 (no_affinity when full), balance" in head
    assert "balance by tokens" in head
    assert max(len(line) for line in head.splitlines()) <= 100
