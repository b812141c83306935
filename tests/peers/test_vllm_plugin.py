"""prefixflight.vllm's queue inside vLLM 0.33.0's own `KVCacheManager` (the peers
environment): ``"lru"`` gives stock vLLM's hits request for request wherever vLLM caches no
copy of a block, both policies keep every invariant after every step, and where vLLM caches
copies the plugin reuses them before evicting anything (more hits than stock, never a broken
pool). The driver is ``vllm_plugin_side.py``, run in that environment."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .conftest import HERE, peers_env

pytestmark = pytest.mark.peers


@pytest.fixture(scope="module")
def report(peers_python: Path) -> dict[str, Any]:
    run = subprocess.run(
        [str(peers_python), "vllm_plugin_side.py", "12"],
        cwd=HERE,
        env=peers_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_lru_gives_stock_vllms_hits_when_no_block_is_cached_twice(report: dict[str, Any]) -> None:
    row = report["lru/unaligned"]
    assert row["copies"] == 0 and row["evicted"] > 0  # eviction happened, copies did not
    assert row["differs"] == []


@pytest.mark.parametrize(
    "case", ["lru/unaligned", "lru/aligned", "s3fifo/unaligned", "s3fifo/aligned"]
)
def test_the_pool_and_the_policy_agree_after_every_step(report: dict[str, Any], case: str) -> None:
    assert report[case]["broken"] == []


def test_copies_are_reused_before_any_eviction(report: dict[str, Any]) -> None:
    row = report["lru/aligned"]
    assert row["copies"] > 0
    assert row["hit_tokens"] >= row["stock_hit_tokens"]


def test_a_chain_of_any_depth_leaves_with_its_first_block(report: dict[str, Any]) -> None:
    """3,000 cached blocks in one chain; invalidating the first evicts the 2,999 others, in
    one loop (a recursion through vLLM's eviction hook overflowed Python's stack on the
    synthetic Mooncake trace's long prompts)."""
    assert report["deep_chain"] == {"orphans_evicted": 2999, "broken": [], "cached": 0}


def test_s3fifo_orders_evictions_its_own_way(report: dict[str, Any]) -> None:
    row = report["s3fifo/unaligned"]
    assert row["differs"] and row["hit_tokens"] != row["stock_hit_tokens"]


def _repro(python: Path, flag: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "vllm_priority_preempt_uncomputed.py", flag],
        cwd=HERE.parents[1] / "benchmarks" / "peers" / "repro",
        env=peers_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_checked_mode_flags_the_block_vllm_caches_without_computing_it(peers_python: Path) -> None:
    """vLLM's priority-preemption finding (benchmarks/peers/repro), with the plugin's
    checks over vLLM's own preemption: the uncomputed block is logged as a violation."""
    run = _repro(peers_python, "--plugin-checks-only")
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]  # reproduced
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "violation" in line]
    assert lines == [
        "prefixflight invariant violation: cached but never computed: block 3 "
        "(a free cached block no step wrote)"
    ]


def test_the_plugin_uncaches_what_a_preempted_request_never_computed(peers_python: Path) -> None:
    """The same scenario under the plugin's scheduler: the preempted request's registered
    block loses its hash, so it resumes computing it, and checked mode sees nothing."""
    run = _repro(peers_python, "--plugin")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "not reproduced" in out and "violation" not in out
