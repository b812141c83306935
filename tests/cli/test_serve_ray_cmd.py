"""``serve --replicas``'s flags: parsing, their defaults, the flags that apply only with or
only without ``--replicas``, the help's group (Ray itself runs in tests/serve)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from prefixflight.cli import main
from prefixflight.cli._main import build_parser
from prefixflight.cli._serve_ray_cmd import RAY_DEFAULTS


def test_flags_parse_and_the_ray_flags_not_given_are_unset() -> None:
    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--router", "pow2", "--model", "tiny"]
    )
    assert (args.replicas, args.router, args.model) == (3, "pow2", "tiny")
    assert (args.window_ms, args.burst, args.max_tokens, args.keep) == (None, None, None, None)
    args = build_parser().parse_args(["serve", "--replicas", "2", "--residency", "kv_events"])
    assert args.residency == "kv_events"
    assert build_parser().parse_args(["serve"]).replicas is None  # one engine over HTTP


def test_run_ray_fills_in_the_defaults_of_the_flags_not_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray.serve")
    import prefixflight.serve.ray as ray_app

    seen: dict[str, Any] = {"requests": []}

    async def generate(request: Any) -> Any:
        seen["requests"].append(request)
        return SimpleNamespace(replica="r0", role="leader", cached_tokens=0, prompt_tokens=30)

    def run_local(replicas: int, router: str, model: Any, **kwargs: Any) -> Any:
        seen.update(replicas=replicas, router=router, **kwargs)
        return SimpleNamespace(generate=SimpleNamespace(remote=generate))

    monkeypatch.setattr(ray_app, "run_local", run_local)
    monkeypatch.setattr(ray_app, "shutdown", lambda: None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the torch commands set it if unset
    assert main(["serve", "--replicas", "2", "--model", "tiny"]) == 0
    assert (seen["replicas"], seen["router"], seen["router_kwargs"]) == (
        2,
        RAY_DEFAULTS["router"],
        {"window_ms": RAY_DEFAULTS["window_ms"]},
    )
    assert len(seen["requests"]) == RAY_DEFAULTS["burst"]
    assert {r.max_tokens for r in seen["requests"]} == {RAY_DEFAULTS["max_tokens"]}
    assert "8 identical prompts on 1 of 2 replicas" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "5"], "--max-tokens 5 applies only with --replicas N (Ray Serve "
         "replicas); the HTTP server takes max_tokens from each request"),
        (["--burst", "3", "--keep", "--window-ms", "5"],
         "--window-ms 5, --burst 3, --keep apply only with --replicas N"),
        (["--router", "burst"], "--router burst applies only with --replicas N"),  # the default
        (["--residency", "stats"], "--residency stats applies only"),
        (["--num-cpus", "2", "--torch-threads", "1"], "--num-cpus 2, --torch-threads 1 apply"),
    ],
)  # fmt: skip
def test_a_ray_flag_without_replicas_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])  # before anything is imported or loaded
    assert exc.value.code == 2
    assert f"prefixflight serve: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "9000"], "--port 9000 applies only to the HTTP server, not with --replicas 2"),
        (["--kv-events", "--access-log"], "--access-log, --kv-events tcp://127.0.0.1:* apply"),
        (["--api-key", "sekrit"], "--api-key applies only to the HTTP server"),  # not echoed
    ],
)
def test_an_http_server_flag_with_replicas_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--replicas", "2", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"prefixflight serve: error: {message}" in err and "sekrit" not in err


def test_the_help_keeps_the_ray_flags_in_their_own_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    usage, *sections = text.split("\n\n")
    assert len(usage.splitlines()) == 2  # one line for each way to run it, not every flag
    ray_flags = {"--replicas", *("--" + d.replace("_", "-") for d in RAY_DEFAULTS)}
    for section in sections:
        flags = set(re.findall(r"^  (--[a-z-]+)", section, re.MULTILINE))
        if section.startswith("Ray Serve replicas"):
            assert flags == ray_flags
        else:
            assert not flags & ray_flags, section


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
    argv = ["serve", "--replicas", "2", "--router", "pow2", "--residency", "kv_events"]
    assert main([*argv, "--model", "tiny"]) == 1  # refused before Ray starts
    assert "--residency kv_events needs --router burst" in capsys.readouterr().err
