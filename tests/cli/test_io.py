"""The shell's file handling: bundled traces from a zipped install, a reader that goes away."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import prefixflight.cli
import prefixflight.core


def test_bundled_traces_are_read_from_a_zipped_install(tmp_path: Path) -> None:
    archive = tmp_path / "prefixflight.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("prefixflight/", "")  # the namespace package's folder entry
        for package in (prefixflight.cli, prefixflight.core):
            root = Path(str(package.__file__)).parent
            for path in root.rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    zf.write(path, Path("prefixflight", root.name, path.relative_to(root)))
    code = (
        "import json, sys; import prefixflight.cli as cli; "
        "assert cli.__file__.startswith(sys.argv[1]), cli.__file__; "
        "from prefixflight.core import replay; "
        "r = cli.read_trace('bundled:synthetic'); records = r.__enter__(); "
        "print(replay(records, policy='lru', cache_capacity_blocks=64).total_requests)"
    )
    env = {**os.environ, "PYTHONPATH": str(archive)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(archive)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3993"]


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    argv = [sys.executable, "-m", "prefixflight.cli", "replay", "bundled:synthetic",
            "--capacity-blocks", "8", "--per-request", "-q"]  # fmt: skip
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == b"{\n"
        proc.stdout.close()  # like `| head -1`
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 0
    assert err == b""


def test_a_closed_stderr_does_not_stop_the_command() -> None:
    argv = [sys.executable, "-m", "prefixflight.cli", "replay", "bundled:synthetic",
            "--capacity-blocks", "8"]  # fmt: skip
    proc = subprocess.run(
        ["sh", "-c", 'exec "$@" 2>&-', "sh", *argv], capture_output=True, timeout=120
    )
    assert proc.returncode == 0
    assert b'"total_requests": 3993' in proc.stdout


def test_without_a_bar_progress_hands_back_the_items_themselves() -> None:
    """So `replay` gets the `TraceReader` itself and reads its fields without records."""
    from prefixflight.cli._progress import progress

    items = [1, 2]
    assert progress(items, desc="x", unit="y", quiet=True) is items
