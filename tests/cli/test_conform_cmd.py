"""``prefixflight conform``: our own engine passes; a fork given by --impl that breaks the spec
exits 1 with its shrunk example; usage errors exit 2 with one line; the JSON says what ran.
(vLLM, SGLang and libCacheSim run in tests/peers, in their own environment.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixflight.cli import main

_BROKEN = '''
import attrs

from prefixflight.core import LRU, Scheduler
from prefixflight.core.flight._pages import PagePool


class LeakyPool(PagePool):
    """release() keeps one private page."""

    def release(self, pinned, private):
        super().release(pinned, sorted(private)[1:])


class StaleLRU(LRU):
    """A hit does not refresh recency."""

    def access(self, blocks):
        return super().access([b for b in blocks if b not in self])


class SilentFinish(Scheduler):
    """complete_step reports no finished requests."""

    def complete_step(self, result, now):
        return attrs.evolve(super().complete_step(result, now), finished=())


class NotAClass:
    pass
'''


def _conform(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixflight.cli", "conform", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def test_prefixflight_passes_and_the_json_says_what_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    args = ["prefixflight", "--examples", "20", "--steps", "20", "--seed", "3"]
    status = main(["conform", *args, "--json", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    assert "prefixflight engine: PrefixEngineConformance over PagePoolAdapter" in text
    assert "declared differences:\n    hit_cap=n-1 (default full)" in text
    doc = json.loads(out.read_text())
    assert doc["engine"] == "prefixflight" and doc["passed"] is True
    engine, s3fifo, _, sched = doc["checks"]
    assert [c["name"] for c in doc["checks"]] == ["engine", "s3fifo", "lru", "scheduler"]
    assert engine["rules"] == ["admit", "finish"]
    assert sched["machine"] == "SchedulerConformance" and sched["declared"] == []
    assert sched["adapter"] == "PrefixflightSchedulerAdapter"
    assert sched["semantics"]["same_step_reads"] == "declared"
    assert "prefixflight scheduler: SchedulerConformance over" in text
    assert s3fifo["rules"] == ["access", "pin", "unpin", "misuse", "remove", "evict"]
    assert {d["name"] for d in engine["declared"]} == {"hit_cap", "touch", "capacity", "orphans"}
    assert engine["semantics"]["evictions"] == "reported"
    assert all(c["examples"] == 20 and c["steps"] == 20 and c["seed"] == 3 for c in doc["checks"])
    assert engine["impl"] == "prefixflight.core.flight._pages:PagePool"


@pytest.mark.parametrize(
    ("cls", "check", "says"),
    [
        ("LeakyPool", "engine", "leaked"),
        ("StaleLRU", "lru", "the implementation"),
        ("SilentFinish", "scheduler", "the scheduler says go on"),
    ],
)
def test_a_broken_fork_exits_1_with_its_shrunk_example(
    tmp_path: Path, cls: str, check: str, says: str
) -> None:
    (tmp_path / "forks.py").write_text(_BROKEN)
    run = _conform(
        tmp_path, "prefixflight", "--impl", f"forks:{cls}", "--examples", "200", "--seed", "1"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"prefixflight {check}:" in run.stdout and "UNDECLARED DIFFERENCE" in run.stdout
    assert says in run.stdout
    assert "minimal example:" in run.stdout and "state." in run.stdout
    assert f"--impl forks:{cls} --seed 1" in run.stdout  # how to replay it
    assert run.stdout.count(": passed") == 0  # only the check the fork replaces ran


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["prefixflight", "--impl", "forks:NotAClass"], "is not a subclass of any of"),
        (["prefixflight", "--impl", "forks:Missing"], "has no attribute 'Missing'"),
        (["prefixflight", "--impl", "nowhere:X"], "cannot import 'nowhere'"),
        (["prefixflight", "--impl", "justaname"], "expected MODULE:CLASS"),
        (["prefixflight", "--examples", "0"], "must be >= 1"),
        (["tensorrt"], "invalid choice"),
        (["prefixflight", "--check", "nope"], "invalid choice: 'nope'"),
        (["sglang", "--check", "scheduler"], "sglang has no check 'scheduler'; its checks: engine"),
        (
            ["prefixflight", "--check", "lru", "--impl", "forks:SilentFinish"],
            "is not a subclass of any of prefixflight.core:LRU",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "forks.py").write_text(_BROKEN)
    run = _conform(tmp_path, *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr


def test_an_engine_that_is_not_installed_is_a_usage_error(tmp_path: Path) -> None:
    """The project's own environment has no vLLM: the message says where to run it."""
    pytest.importorskip("hypothesis")
    try:
        __import__("vllm")
    except ImportError:
        pass
    else:  # pragma: no cover - only in an environment with vLLM
        pytest.skip("vLLM is installed here: the not-installed path cannot be exercised")
    run = _conform(tmp_path, "vllm", "--examples", "1")
    assert run.returncode == 2
    assert "benchmarks/peers/setup.sh" in run.stderr and "Traceback" not in run.stderr


def test_the_engine_modules_import_without_their_engines() -> None:
    """prefixflight never imports vLLM, SGLang or libCacheSim on its own."""
    code = textwrap.dedent(
        """
        import sys
        import prefixflight.cli._conform_cmd, prefixflight.specs.adapters
        import prefixflight.specs._conform
        bad = {m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang', 'libcachesim')}
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_check_runs_only_the_checks_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["prefixflight", "--check", "scheduler", "--check", "lru", "--examples", "5"]
    assert main(["conform", *args, "--seed", "2"]) == 0
    text = capsys.readouterr().out
    assert "prefixflight lru:" in text and "prefixflight scheduler:" in text
    assert "prefixflight engine:" not in text and "prefixflight s3fifo:" not in text


def test_the_cli_knows_every_check_name() -> None:
    """The CLI's --check choices (it cannot import the specs to list them) are the specs'."""
    from prefixflight.cli._conform_cmd import _CHECKS
    from prefixflight.specs._conform import CHECKS

    assert _CHECKS == CHECKS
