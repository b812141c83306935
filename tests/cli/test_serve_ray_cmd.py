"""``serve-ray``'s flags (parsing only: the command itself runs in tests/serve)."""

from __future__ import annotations

import pytest

from prefixflight.cli._main import build_parser


def test_flags_parse_with_defaults() -> None:
    args = build_parser().parse_args(["serve-ray", "--replicas", "3", "--router", "pow2"])
    assert (args.replicas, args.router, args.model, args.window_ms, args.burst) == (
        3,
        "pow2",
        "tiny",
        100,
        8,
    )
    assert not args.keep


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "must be >= 1, got '0'"),
        (["--router", "random"], "invalid choice: 'random'"),
        (["--burst", "x"], "expected an int, got 'x'"),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve-ray", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
