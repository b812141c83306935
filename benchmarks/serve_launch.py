"""Start ``prefixflight serve`` from this checkout on a free loopback port, as a subprocess.

Used by ``benchmarks/hostile_probe.py``, ``tests/serve/fuzz_server.py`` and
``tests/test_docs.py`` (which load it by path, as the tests load
``benchmarks/vllm/launch.py``). The checkout's four source roots go first on ``PYTHONPATH``,
so the server runs this code whatever the venv has installed.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_READERS: dict[int, threading.Thread] = {}  # pid -> the thread that reads its stderr


def start_serve(
    model: str, flags: list[str], *, timeout: float
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``prefixflight serve --model MODEL --port 0 FLAGS``: the process, its base URL (read
    from the line it prints when it listens) and its stderr so far (a list that keeps
    filling). Exits with the log if it does not listen within ``timeout`` seconds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / d) for d in ("core", "specs", "backends", "serve")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    argv = ["serve", "--model", model, "--port", "0", *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixflight.cli", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.put(line)
            log.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _READERS[proc.pid] = reader
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise SystemExit(f"the server did not start: {''.join(log)}") from None
        if " on http://" in line:
            return proc, line.split(" on ")[1].split()[0], log


def stop_serve(proc: subprocess.Popen[str], *, timeout: float = 60) -> int:
    """Stop a server `start_serve` started as Ctrl-C does (SIGINT; killed after ``timeout``
    seconds), let its stderr reader finish, close the pipe; the exit status."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader = _READERS.pop(proc.pid, None)
        if reader is not None:
            reader.join(timeout=30)  # EOF once the process is gone
        if proc.stderr is not None:
            proc.stderr.close()
    return proc.returncode
