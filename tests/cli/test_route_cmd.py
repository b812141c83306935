"""``prefixflight route``: flag mistakes are one-line usage errors (exit 2), and the command
serves (a subprocess on a free loopback port) and stops on Ctrl-C or SIGTERM with exit 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefixflight.cli import main
from prefixflight.cli._main import build_parser

from ..conftest import source_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "localhost:8000"], "must start with http:// or https://"),
        (["--backend", "http://h:1", "--backend", "http://h:1"], "must be unique"),
        (
            ["--backend", "http://h:1", "--backend", "http://h:2", "--kv-events", "tcp://h:5"],
            "--kv-events was given 1 times for 2 backends",
        ),
        (["--backend", "http://h:1", "--kv-events", "h:5557"], "--kv-events must be a ZMQ"),
        (["--backend", "http://h:1", "--kv-events-replay", "tcp://h:6"], "needs --kv-events"),
        (["--backend", "http://h:1", "--kv-events-topic", "kv@a@m"], "needs --kv-events"),
        (
            [
                *("--backend", "http://h:1", "--kv-events", "tcp://h:5"),
                *("--kv-events-topic", "a", "--kv-events-topic", "b"),
            ],
            "--kv-events-topic was given 2 times for 1 backends",
        ),
        (["--backend", "http://h:1", "--window-ms", "20", "--lone-wait-ms", "30"], "lone_wait_ms"),
        (["--backend", "http://h:1", "--window-ms", "20", "--quiet-ms", "30"], "quiet_ms"),
        (["--backend", "http://h:1", "--policy", "random"], "invalid choice: 'random'"),
        (["--backend", "http://h:1", "--max-per-replica", "0"], "max_per_replica"),
        (["--backend", "http://h:1", "--port", "70000"], "a port is at most 65535"),
        ([], "the following arguments are required: --backend"),
    ],
)
def test_flag_mistakes_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["route", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line.startswith("prefixflight route: error:") and message in line, line
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--block-size", "--block-size-tokens"])
def test_the_route_key_block_size_flag_and_its_old_spelling(flag: str) -> None:
    parser = build_parser("route")
    args = parser.parse_args(["route", "--backend", "http://h:1", flag, "32"])
    assert args.block_size == 32
    assert parser.parse_args(["route", "--backend", "http://h:1"]).block_size == 64


def test_the_old_block_size_flag_spelling_is_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["route", "--help"])
    out = capsys.readouterr().out
    assert "--block-size N" in out and "--block-size-tokens" not in out


def test_a_tokenizer_that_cannot_be_read_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    assert main(["route", "--backend", "http://h:1", "--tokenizer", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prefixflight route: error: --tokenizer {tmp_path}: cannot load")
    assert len(err.splitlines()) == 1
    missing = tmp_path / "BADPATH"
    assert main(["route", "--backend", "http://h:1", "--tokenizer", str(missing)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"prefixflight route: error: --tokenizer {missing}: no such folder (give the folder of "
        "a Hugging Face tokenizer, the backends' model)"
    )


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_command_serves_and_stops_gracefully(stop: signal.Signals) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    env = source_env(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixflight.cli",
            "route",
            "--backend",
            _closed_port_url(),
            "--port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("prefixflight route: http://127.0.0.1:"), line
        url = line.split()[2]
        health = httpx.get(url + "/health", timeout=10)  # its one backend refuses connections
        assert health.status_code == 503, health.text
        assert "no backend is up" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "no backend is up"
    finally:
        proc.send_signal(stop)
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        rest = proc.stderr.read()
        proc.stderr.close()
    assert code == 0, rest
    assert "Traceback" not in rest
