"""What the benchmarks share: this checkout's code in the processes they start, free ports,
server processes, and results JSON that records the command that wrote it.

A script in a subfolder imports it as ``from benchmarks import harness`` once the checkout
is on ``sys.path`` (its first lines do that); the tests load it by path
(``tests/test_docs.py``, ``tests/serve/fuzz_server.py``). ``python benchmarks/harness.py
pythonpath`` prints the ``PYTHONPATH`` that puts the source roots first, for shell scripts
(``benchmarks/engine/gpu_check.sh``).

The source roots are read from pyproject.toml (``[tool.hatch.build.targets.wheel]``'s
``sources``), the one place that lists them.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest and mypy depend on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
_READERS: dict[int, threading.Thread] = {}  # pid -> the thread that reads its stderr


def source_roots() -> list[Path]:
    """The checkout's source roots (core, specs, ...), as pyproject.toml lists them."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)
    sources = project["tool"]["hatch"]["build"]["targets"]["wheel"]["sources"]
    return [ROOT / s for s in sources]


def pythonpath(existing: str | None = None) -> str:
    """The source roots, then ``existing`` (a ``PYTHONPATH`` already set) if any: a process
    started with it runs this checkout's code whatever its venv has installed."""
    return os.pathsep.join([*(str(r) for r in source_roots()), *([existing] if existing else [])])


def checkout_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with `pythonpath` as ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = pythonpath(env.get("PYTHONPATH"))
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Process:
    """A server started in its own process group, its output in ``log``; `stop` sends the
    group SIGINT (as Ctrl-C does), then SIGKILL after a timeout."""

    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.log = log
        self._out = log.open("w")
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            list(argv),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_http(
        self, url: str, timeout: float, ok: Callable[[bytes], bool] | None = None
    ) -> float:
        """Poll ``url`` until it answers 200 (and ``ok(body)``, if given): the seconds since
        the process started. Raises `RuntimeError` with the log's tail if the process exits
        or ``timeout`` seconds pass first (the process is then stopped)."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}; {self.log}:\n"
                    + self.log.read_text(errors="replace")[-2000:]
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200 and (ok is None or ok(r.read())):
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)  # polling a real condition (the port answering), bounded above
        self.stop()
        raise RuntimeError(
            f"{self.name} did not answer {url} within {timeout:.0f} s; see {self.log}"
        )

    def stop(self, timeout: float = 60) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGINT)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=30)
        self._out.close()


def start_serve(
    model: str, flags: Sequence[str], *, timeout: float
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``prefixflight serve --model MODEL --port 0 FLAGS`` from this checkout: the process,
    its base URL (read from the line it prints when it listens) and its stderr so far (a
    list that keeps filling). Exits with the log if it stops or does not listen within
    ``timeout`` seconds."""
    argv = ["serve", "--model", model, "--port", "0", *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixflight.cli", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=checkout_env(),
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.put(line)
            log.append(line)
        lines.put(None)  # the process closed its stderr: it is gone

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
        if line is None:
            proc.wait(timeout=30)
            raise SystemExit(f"the server exited with {proc.returncode}: {''.join(log)}")
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


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that runs this script with ``argv`` (default: this run's), the
    script named relative to the checkout: what a results file records."""
    script = Path(sys.argv[0]).resolve()
    name = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", str(name), *args])


def write_json(path: Path | str, doc: Mapping[str, Any], *, indent: int = 2) -> None:
    """Write a results file (its folder made if missing): ``doc`` with a leading
    ``"command"`` (`command`) unless it has one."""
    out = dict(doc) if "command" in doc else {"command": command(), **doc}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=indent) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["pythonpath"]:
        raise SystemExit("usage: python benchmarks/harness.py pythonpath")
    print(pythonpath(os.environ.get("PYTHONPATH")))
