"""Hypothesis profiles and the torch guard.

Profiles: Hypothesis' automatic ``ci`` profile in CI (derandomised, no deadline), ``dev``
(random seeds) in development, and by HYPOTHESIS_PROFILE: ``soak`` (2,000 examples of up to
100 steps per machine, fresh seeds, no example database, no explain phase so a failure
reports at once, with the reproducing blob) and ``fresh`` (the same settings at the
default example count; ``tests/specs/fresh_seeds.py`` runs every machine this way for a time
budget in CI).

With PREFIXFLIGHT_REQUIRE_TORCH=1 (the torch tox env and CI set it) a test that would be
skipped because torch or transformers cannot be imported fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Generator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

_BOUNDED_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

settings.register_profile(
    "soak",
    max_examples=2000,
    stateful_step_count=100,
    deadline=None,
    database=None,
    derandomize=False,
    print_blob=True,
    phases=_BOUNDED_PHASES,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fresh",
    deadline=None,
    database=None,
    derandomize=False,
    print_blob=True,
    phases=_BOUNDED_PHASES,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None)
_profile = os.environ.get("HYPOTHESIS_PROFILE")
if _profile:
    settings.load_profile(_profile)
elif not os.environ.get("CI"):
    settings.load_profile("dev")

REQUIRE_TORCH = os.environ.get("PREFIXFLIGHT_REQUIRE_TORCH") == "1"
_TORCH_SKIP = re.compile(r"could not import '(torch|transformers)'")


def _fail_torch_skip(report: Any) -> None:
    if REQUIRE_TORCH and report.skipped and _TORCH_SKIP.search(str(report.longrepr)):
        report.outcome = "failed"
        report.longrepr = f"PREFIXFLIGHT_REQUIRE_TORCH=1 but {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_torch_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    _fail_torch_skip(outcome.get_result())


@pytest.fixture(scope="session")
def vllm_launcher() -> ModuleType:
    """benchmarks/vllm/launch.py, which starts vLLM from its own venv (standard library only,
    so it is loaded by path, once for the session)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm" / "launch.py"
    spec = importlib.util.spec_from_file_location("vllm_launch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_launch"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def vllm_venv(vllm_launcher: ModuleType) -> Path:
    """vLLM's own venv (``$PREFIXFLIGHT_VLLM_VENV``, default ``<repo>/.venv-vllm``), built by
    benchmarks/vllm/setup.sh when missing; a test that needs it fails, never skips, when it
    cannot be built."""
    try:
        return Path(vllm_launcher.vllm_venv())
    except vllm_launcher.VLLMError as exc:
        pytest.fail(f"the vLLM venv is needed and could not be built: {exc}")


def source_roots() -> list[Path]:
    """The folders this process imported prefixflight from (the one above each
    ``prefixflight.__path__`` entry: pyproject's hatch ``sources`` in a checkout), in import
    order, so that no test spells the roots out."""
    import prefixflight

    return list(dict.fromkeys(Path(p).parent for p in prefixflight.__path__))


def source_env(**extra: str) -> dict[str, str]:
    """This process's environment (plus ``extra``) for a subprocess that imports the same
    prefixflight: the PYTHONPATH starts with `source_roots`."""
    env = dict(os.environ, **extra)
    paths = [*map(str, source_roots()), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
