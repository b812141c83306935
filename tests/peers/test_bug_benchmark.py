"""The bug benchmark's CI cases (``benchmarks/bugs/run.py --ci``): one case per engine, each
at the release the peers venv has or one that builds in seconds, found (exit 1) as
``cases.toml`` expects, with how many examples it took; and the cases file itself is sound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, peers_env

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli there
    import tomli as tomllib

RUN = ROOT / "benchmarks" / "bugs" / "run.py"


def _cases() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((RUN.parent / "cases.toml").read_text())
    return data


def test_every_case_is_complete_and_ci_covers_every_engine_with_a_case() -> None:
    data = _cases()
    cases = data["case"]
    real = [c for c in cases if c["set"] == "real"]
    assert len(real) >= 8 and len({c["engine"] for c in real}) >= 3
    for c in cases:
        assert set(c["runs"].values()) <= {0, 1}, c["id"]
        if c["set"] == "real":
            assert c["url"] and c["last_buggy"] in c["runs"], c["id"]
            assert c["runs"][c["last_buggy"]] == 1, c["id"]
            if c["status"] == "fixed":
                assert c["runs"][c["first_fixed"]] == 0, c["id"]
        if "ci" in c:
            assert c["ci"] in c["runs"], c["id"]
    assert {c["engine"] for c in cases if "ci" in c} == set(data["engines"])


@pytest.mark.peers
def test_ci_cases_are_found_at_their_releases(peers_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "bugs.json"
    env = peers_env()
    env["PREFIXFLIGHT_PEERS_VENV"] = str(peers_python.parents[1])
    env.setdefault("PREFIXFLIGHT_BUGS_CACHE", str(ROOT / ".venv-bugs"))
    done = subprocess.run(
        [sys.executable, str(RUN), "--ci", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    engines = {c["engine"] for c in _cases()["case"] if "ci" in c}
    assert {r["engine"] for r in doc["runs"]} == engines
    for r in doc["runs"]:
        assert r["ok"] and r["exit"] == r["expected"] == 1, r
        assert r["found_after_examples"] >= 1 and r["message"], r
    assert os.path.isdir(env["PREFIXFLIGHT_BUGS_CACHE"])  # the s3fifo release venv, cached
