"""PREFIXFLIGHT_REQUIRE_TORCH=1 turns "torch cannot be imported" from a skip into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_without_torch(
    tmp_path: Path, require: bool, *paths: str
) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "torch"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('torch is broken here')\n")
    env = {k: v for k, v in os.environ.items() if k != "PREFIXFLIGHT_REQUIRE_TORCH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    if require:
        env["PREFIXFLIGHT_REQUIRE_TORCH"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_without_the_flag_torch_tests_skip(tmp_path: Path) -> None:
    done = _run_without_torch(
        tmp_path, False, "tests/backends/test_torch_sampling.py", "tests/cli/test_bench_cmd.py"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped" in done.stdout and "failed" not in done.stdout


def test_with_the_flag_the_backend_tests_fail_at_once(tmp_path: Path) -> None:
    done = _run_without_torch(tmp_path, True, "tests/backends/test_torch_sampling.py")
    out = done.stdout + done.stderr
    assert done.returncode not in (0, 5), out
    assert "torch is broken here" in out and "conftest" in out


def test_with_the_flag_a_torch_skip_elsewhere_is_a_failure(tmp_path: Path) -> None:
    done = _run_without_torch(tmp_path, True, "tests/cli/test_bench_cmd.py")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "PREFIXFLIGHT_REQUIRE_TORCH=1 but" in out and " failed" in done.stdout
    assert "skipped" not in done.stdout.splitlines()[-1], out
