"""``prefixflight simulate flight``: tables on stdout, rows in JSON, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixflight.cli import main

FIELDS = {
    "policy",
    "concurrency",
    "prompt_tokens",
    "recovered_tokens_per_follower",
    "mean_ttft",
    "slowest_completion",
}


def test_simulate_flight_prints_tables_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "flight.json"
    assert (
        main(
            [
                "simulate",
                "flight",
                "--output-tokens",
                "16",
                "--late-after-tokens",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for title in ("Incremental publication", "Single flight", "Late arrival", "Partial-prefix",
                  "findings"):  # fmt: skip
        assert title in text
    data = json.loads(out.read_text())
    policies = {
        "incremental_publication": {"publish_on_completion", "publish_per_step"},
        "single_flight": {"independent", "on_completion", "after_prefill"},
        "late_arrival": {"independent", "on_completion", "after_prefill"},
    }
    for table, names in policies.items():
        rows = data[table]
        assert rows and all(row.keys() >= FIELDS for row in rows)
        assert {row["policy"] for row in rows} == names
    assert {r["concurrency"] for r in data["single_flight"]} == {2, 4, 8}
    # the printed table shows the JSON's numbers
    first = data["single_flight"][0]
    assert f"{first['mean_ttft']:.3f}" in text


def test_defaults_are_the_calibrated_model_and_flags_replace_measured_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from prefixflight.sim import CostModel

    short = ["simulate", "flight", "--output-tokens", "4", "--late-after-tokens", "2"]

    def first_line(cost: CostModel) -> str:
        return (
            f"cost model: step = {cost.step_overhead * 1e3:.2f} ms + "
            f"{cost.prefill_per_token * 1e3:.4f} ms x prefill tokens + "
            f"{cost.decode_per_request * 1e3:.2f} ms x decodes"
        )

    assert main(short) == 0
    assert capsys.readouterr().out.startswith(first_line(CostModel.calibrated()))
    assert main([*short, "--prefill-seconds", "2.5"]) == 0
    assert capsys.readouterr().out.startswith(first_line(CostModel.calibrated(prefill_seconds=2.5)))


def test_simulate_needs_a_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate"])
    assert exc.value.code == 2
    assert "flight" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--output-tokens", "0"],
        ["--late-after-tokens", "200"],
        ["--overhead-share", "2"],
        ["--prefill-tokens", "0"],
    ],
)
def test_bad_options_are_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "flight", *args])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_unwritable_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "x.json"
    assert (
        main(
            [
                "simulate",
                "flight",
                "--output-tokens",
                "8",
                "--late-after-tokens",
                "2",
                "--json",
                str(target),
            ]
        )
        == 1
    )
    assert "cannot write" in capsys.readouterr().err
