"""``prefixflight conform``: our own engine passes; a fork given by --impl that breaks the spec
exits 1 with its shrunk example; usage errors exit 2 with one line; the JSON says what ran.
(vLLM, SGLang, libCacheSim and Dynamo run in tests/peers, in their own environment.)"""

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
from prefixflight.specs import PolicySemantics


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


class NoEvictFIFO:
    semantics = PolicySemantics(policy="fifo")  # the default ops: pin, remove, evict

    def __init__(self, capacity):
        self.keys = []

    def resident(self):
        return frozenset(self.keys)

    def access(self, blocks):
        return []

    def remove(self, block):
        self.keys.remove(block)
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
    engine, s3fifo, _, sched, index = doc["checks"]
    assert [c["name"] for c in doc["checks"]] == ["engine", "s3fifo", "lru", "scheduler", "index"]
    assert index["machine"] == "KVIndexConformance" and index["adapter"] == "ReplicaIndexAdapter"
    assert [d["name"] for d in index["declared"]] == ["order"]
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
        (["tensorrt"], "unknown engine 'tensorrt'; known: prefixflight, vllm, sglang"),
        ([], "name an ENGINE or an --adapter MODULE:CLASS"),
        (["prefixflight", "--adapter", "forks:StaleLRU"], "name an ENGINE or an --adapter"),
        (["--adapter", "forks:StaleLRU"], "StaleLRU declares no semantics"),
        (["--adapter", "forks:StaleLRU", "--check", "s3fifo", "--check", "lru"], "one check"),
        (["--adapter", "forks:NoEvictFIFO"], "NoEvictFIFO has no evict(), pin(), unpin(), "),
        (["--adapter", "forks:StaleLRU", "--check", "engine"], "StaleLRU has no block_size"),
        (["--adapter", "forks:NoEvictFIFO", "--check", "lru"], "cannot run as 'lru'"),
        (["--adapter", "forks:StaleLRU", "--impl", "forks:StaleLRU"], "--impl replaces a class"),
        (["--adapter", "forks:NoEvictFIFO", "--check", "engine"], "the 'engine' check needs Eng"),
        (["--adapter", "broken_syntax:X"], "cannot import 'broken_syntax': SyntaxError"),
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
    (tmp_path / "broken_syntax.py").write_text("class X(:\n")
    run = _conform(tmp_path, *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("engine", ["vllm", "dynamo"])
def test_an_engine_that_is_not_installed_is_a_usage_error(tmp_path: Path, engine: str) -> None:
    """The project's own environment has no vLLM or Dynamo: the message says where to run
    them."""
    pytest.importorskip("hypothesis")
    try:
        __import__(engine)
    except ImportError:
        pass
    else:  # pragma: no cover - only in an environment with the engine
        pytest.skip(f"{engine} is installed here: the not-installed path cannot be exercised")
    run = _conform(tmp_path, engine, "--examples", "1")
    assert run.returncode == 2
    assert "benchmarks/peers/setup.sh" in run.stderr and "Traceback" not in run.stderr


def test_the_engine_modules_import_without_their_engines() -> None:
    """prefixflight never imports vLLM, SGLang, libCacheSim or Dynamo on its own."""
    code = textwrap.dedent(
        """
        import sys
        import prefixflight.cli._conform_cmd, prefixflight.specs.adapters
        import prefixflight.specs._conform
        engines = ('vllm', 'sglang', 'libcachesim', 'dynamo')
        bad = {m for m in sys.modules if m.split('.')[0] in engines}
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


def test_the_cli_reads_the_one_registry(capsys: pytest.CaptureFixture[str]) -> None:
    """--check's choices and the engines --help lists are the registry's."""
    from prefixflight.specs._registry import CHECKS, ENGINES

    assert CHECKS == ("engine", "s3fifo", "lru", "fifo", "lfu", "sieve", "scheduler", "index")
    with pytest.raises(SystemExit):
        main(["conform", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"{', '.join(ENGINES)}, or an engine an installed package registers" in out
    assert "dynamo" in ENGINES  # NVIDIA Dynamo's KV router index (the index check)
    assert f"run only this check of the engine ({', '.join(CHECKS)};" in out


# -- a user's adapter, from the command line ----------------------------------------------------
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "my_s3fifo.py"


def test_a_users_adapter_of_40_lines_runs_from_the_command_line(tmp_path: Path) -> None:
    """docs/examples/my_s3fifo.py (the adapter docs/conformance.md shows) passes as written;
    the same class with a declaration left out, or with a ghost check that never matches
    (the bug the kit found in an S3-FIFO package), exits 1 with its shrunk example."""
    source = EXAMPLE.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 40
    page = (EXAMPLE.parents[1] / "conformance.md").read_text(encoding="utf-8")
    assert f"```python\n{source}```" in page  # the docs show the file as it is
    (tmp_path / "my_s3fifo.py").write_text(source)
    run = _conform(tmp_path, "--adapter", "my_s3fifo:MyS3FIFO", "--seed", "0", "--json", "r.json")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(
        "my_s3fifo:MyS3FIFO s3fifo: S3FIFOConformance over MyS3FIFO (my_s3fifo:MyS3FIFO): "
        "passed 100 examples of up to 50 steps (seed 0,"
    )
    check = json.loads((tmp_path / "r.json").read_text())["checks"][0]
    assert check["rules"] == ["access"]
    assert [d["name"] for d in check["declared"]] == [
        "ops", "sizing", "max_freq", "main_evictions"
    ]  # fmt: skip
    broken = {
        "undeclared": source.replace(', main_evictions="drop"', ""),
        "ghostbug": source.replace("if b in self.ghost else", "if self.ghost.count(b) > 1 else"),
    }
    for name, text in broken.items():
        assert text != source
        (tmp_path / f"{name}.py").write_text(text)
        run = _conform(tmp_path, "--adapter", f"{name}:MyS3FIFO", "--seed", "0")
        assert run.returncode == 1, run.stdout + run.stderr
        assert "UNDECLARED DIFFERENCE" in run.stdout and "minimal example:" in run.stdout
        assert f"replay: prefixflight conform --adapter {name}:MyS3FIFO" in run.stdout


def test_the_fifo_example_runs_and_a_fifo_that_refreshes_is_caught(tmp_path: Path) -> None:
    """docs/examples/my_fifo.py, the shortest adapter (for the README): passes; the same
    class refreshing a block on a hit (an LRU) exits 1."""
    source = (EXAMPLE.parent / "my_fifo.py").read_text(encoding="utf-8")
    (tmp_path / "my_fifo.py").write_text(source)
    run = _conform(tmp_path, "--adapter", "my_fifo:MyFIFO", "--examples", "50", "--seed", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FIFOConformance over MyFIFO (my_fifo:MyFIFO): passed 50 examples" in run.stdout
    lru = source.replace(
        "            if b not in self.blocks and self.capacity:",
        "            self.blocks.pop(b, 0)  # a hit moves it to the end\n"
        "            if self.capacity:",
    )
    assert lru != source
    (tmp_path / "my_lru.py").write_text(lru)
    run = _conform(tmp_path, "--adapter", "my_lru:MyFIFO", "--seed", "0")
    assert run.returncode == 1 and "UNDECLARED DIFFERENCE" in run.stdout, run.stdout


def test_an_installed_package_registers_its_adapter(tmp_path: Path) -> None:
    """An entry point in the group prefixflight.adapters makes `prefixflight conform NAME`
    find the adapter (here a distribution's metadata on the path, as pip installs it)."""
    (tmp_path / "my_s3fifo.py").write_text(EXAMPLE.read_text(encoding="utf-8"))
    info = tmp_path / "my_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[prefixflight.adapters]\nmyengine = my_s3fifo:MyS3FIFO\n"
    )
    run = _conform(tmp_path, "myengine", "--examples", "20", "--seed", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("myengine s3fifo: S3FIFOConformance over MyS3FIFO")
    run = _conform(tmp_path, "myengine", "--check", "lru")
    assert run.returncode == 2 and "myengine has no check 'lru'; its checks: s3fifo" in run.stderr


def test_a_shrunk_example_is_printed_without_steps_that_do_nothing() -> None:
    from prefixflight.specs._adapter import NO_OP
    from prefixflight.specs._conform import _without_no_ops

    lines = ["Draw 1 (pages): 2", NO_OP, "state.evict(now=1, pages=1)", "admit(r0, a) -> hit 0",
             "state.admit(chunks=[], first=0, tail=0, tail_len=1, whole=1)"]  # fmt: skip
    assert _without_no_ops(lines) == [lines[0], *lines[3:]]
