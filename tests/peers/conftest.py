"""The peers environment (vLLM, SGLang, libCacheSim, Dynamo's RadixTree): found, or built once,
or a failure.

``PREFIXFLIGHT_PEERS_VENV`` names it (default ``<repo>/.venv-peers``). If its Python cannot
import the four engines and Hypothesis, ``benchmarks/peers/setup.sh`` builds it there (a
few minutes, once: later runs reuse it); if that fails, every test that needs it FAILS with
setup.sh's output, never skips. Commands run with this checkout's source roots first on the
path, so the environment may have been built from another checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
_PROBE = (
    "import dynamo.llm, hypothesis, libcachesim, vllm.v1.core.kv_cache_manager\n"
    "from prefixflight.specs.adapters import stub_torchvision\n"
    "stub_torchvision()\n"
    "import sglang.srt.mem_cache.radix_cache\n"
)


def peers_env() -> dict[str, str]:
    roots = [str(ROOT / r) for r in ("core", "specs", "backends", "serve")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*roots, str(HERE), env.get("PYTHONPATH", "")])
    env.pop("HYPOTHESIS_PROFILE", None)
    return env


def _usable(python: Path) -> str | None:
    """None if ``python`` runs the peers; else why not."""
    if not python.exists():
        return f"{python} does not exist"
    probe = subprocess.run(
        [str(python), "-c", _PROBE], env=peers_env(), capture_output=True, text=True, timeout=300
    )
    return None if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def peers_python() -> Path:
    venv = Path(os.environ.get("PREFIXFLIGHT_PEERS_VENV", ROOT / ".venv-peers"))
    python = venv / "bin" / "python"
    why = _usable(python)
    if why is None:
        return python
    build = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "peers" / "setup.sh"), str(venv)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    after = _usable(python)
    if after is not None:
        tail = (build.stdout + build.stderr)[-3000:]
        pytest.fail(
            f"the peers environment at {venv} is not usable ({why}) and setup.sh could not "
            f"build it (exit {build.returncode}; still: {after}):\n{tail}",
            pytrace=False,
        )
    return python
