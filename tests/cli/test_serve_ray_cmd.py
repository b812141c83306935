"""``serve --replicas``'s flags (parsing only: the command itself runs in tests/serve)."""

from __future__ import annotations

import pytest

from prefixflight.cli._main import build_parser


def test_flags_parse_with_defaults() -> None:
    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--router", "pow2", "--model", "tiny"]
    )
    assert (args.replicas, args.router, args.model, args.window_ms, args.burst) == (
        3,
        "pow2",
        "tiny",
        100,
        8,
    )
    assert not args.keep and args.residency == "none"
    args = build_parser().parse_args(["serve", "--replicas", "2", "--residency", "kv_events"])
    assert args.residency == "kv_events"
    assert build_parser().parse_args(["serve"]).replicas is None  # one engine over HTTP


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "must be >= 1, got 0"),
        (["--router", "random"], "invalid choice: 'random'"),
        (["--burst", "x"], "expected an int, got 'x'"),
        (["--residency", "guess"], "invalid choice: 'guess'"),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_residency_needs_the_burst_router(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixflight.cli import main

    argv = ["serve", "--replicas", "2", "--router", "pow2", "--residency", "kv_events"]
    assert main([*argv, "--model", "tiny"]) == 1  # refused before Ray starts
    assert "--residency kv_events needs --router burst" in capsys.readouterr().err
