"""vLLM, SGLang, libCacheSim and Dynamo's KV router index under the kit, in their own
environment: each passes with its declared differences; broken subclasses of their real
classes are caught through --impl (broken Dynamo-backed indexes through --adapter: its tree
cannot be subclassed); libCacheSim's crashes come back as findings, shrunk; vLLM's scheduler
finding replays; Dynamo's differences replay standalone.

One process per engine runs ``prefixflight conform`` as shipped and then once per broken
class (``run_impls.py``), so each engine is imported once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .conftest import HERE, ROOT, peers_env

pytestmark = pytest.mark.peers

# engine -> (the declared differences per check and adapter, {broken class: what its
# failure says})
_ENGINES: dict[str, tuple[dict[str, list[str]], dict[str, str]]] = {
    "vllm": (
        {"engine VLLMAdapter": ["hit_cap", "publish", "touch", "pins", "capacity",
                                "duplicates", "invalidated"],
         "engine VLLMPluginLRU": ["hit_cap", "publish", "touch", "pins", "capacity",
                                  "duplicates", "orphans", "policy"],
         "engine VLLMPluginS3FIFO": ["hit_cap", "publish", "touch", "capacity", "duplicates",
                                     "orphans", "policy"],
         "scheduler VLLMSchedulerAdapter": ["same_step_reads", "preemption"]},
        {
            "UnderReportingKVCacheManager": "the engine hit 0 tokens, the reference hit 16",
            "LeakyKVCacheManager": "leaked",
            "HeadFirstBlockPool": "cached blocks differ",
            "FreedPrefixScheduler": "freed while in use",
            "LeakyAbortScheduler": "a reference leaked",
            "DroppingScheduler": "nothing was delivered",
            # prefixflight.vllm's queue, each with one mistake
            "adapter:ReleaseCountingS3FIFOPlugin": "cached blocks differ",
            "adapter:EmptyLastPlugin": "cached blocks differ",
            "adapter:OrphanKeepingPlugin": "after invalidate(",
        },
    ),
    "sglang": (
        {"engine SGLangAdapter": ["hit_cap", "pins", "unit", "capacity"]},
        {
            "UnderMatchingRadixCache": "the engine refused it, the reference hit 16",
            "PageDroppingRadixCache": "cached blocks differ",
            "ShortEvictingRadixCache": "after evict(",
        },
    ),
    "libcachesim": (
        {
            "s3fifo isolated_LibCacheSimS3FIFO": ["ops", "evictions", "sizing",
                                                  "main_evictions", "on_promote", "promote_at",
                                                  "small_queue", "min_small_blocks"],
            "lru isolated_LibCacheSimLRU": ["ops", "evictions"],
        },
        {"NoRemoveS3FIFO": "after remove(", "StaleLRU": "the implementation"},
    ),
    "dynamo": (
        {"index DynamoIndexAdapter": ["order", "removals", "copies"]},
        {
            "adapter:RemovalDroppingIndex": "the index predicts 1 cached blocks of a, the "
            "engine has 0",
            "adapter:ParentIgnoringIndex": "the index predicts 1 cached blocks of a.a, the "
            "engine has 2",
        },
    ),
}  # fmt: skip


def _run(python: Path, *args: str) -> Any:
    run = subprocess.run(
        [str(python), *args],
        cwd=HERE,
        env=peers_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("engine", sorted(_ENGINES))
def test_engine_passes_as_shipped_and_its_broken_subclasses_are_caught(
    peers_python: Path, engine: str
) -> None:
    declared, broken = _ENGINES[engine]
    shipped, *forks = _run(peers_python, str(HERE / "run_impls.py"), engine, "100", "30", *broken)
    assert shipped["status"] == 0, shipped["stdout"]
    checks = shipped["report"]["checks"]
    assert {f"{c['name']} {c['adapter']}": [d["name"] for d in c["declared"]] for c in checks} == (
        declared
    )
    assert all(c["examples"] == 100 and c["passed"] for c in checks)
    for fork, says in zip(forks, broken.values(), strict=True):
        assert fork["status"] == 1, f"{fork['impl']} was not caught:\n{fork['stdout']}"
        out = fork["stdout"]
        assert "UNDECLARED DIFFERENCE" in out and says in out, f"{fork['impl']}:\n{out}"
        name = fork["impl"].removeprefix("adapter:")
        how = "--impl" if name == fork["impl"] else "--adapter"
        assert "minimal example:" in out and f"{how} broken:{name}" in out


def test_libcachesim_crashes_are_findings(peers_python: Path) -> None:
    found = _run(peers_python, str(HERE / "crashes.py"))
    s3fifo, lru = found["s3fifo"], found["lru"]
    assert s3fifo["signal"] == 6  # SIGABRT, in S3FIFO_init
    assert s3fifo["call"] == "UnguardedS3FIFO(capacity=1, small_ratio=0.1)"  # shrunk
    assert "Invalid cache size configuration" in s3fifo["stderr"]
    assert lru["signal"] == 11 and lru["call"] == "evict()"  # SIGSEGV on an empty LRU
    assert lru["steps"][-2:] == ["state.evict()", "state.teardown()"]


def test_vllm_priority_preemption_leaves_uncomputed_blocks_cached(peers_python: Path) -> None:
    """The scheduler machine's finding in vLLM, replayed: under priority scheduling with a
    long-prefill threshold, a request preempted after it was scheduled in the same step
    leaves a block registered whose KV is never computed (the same sequence under FCFS
    passes); the standalone reproduction exits 1 while vLLM does this."""
    found = _run(peers_python, str(HERE / "vllm_findings.py"))
    assert found["priority"] == (
        "step 3 (r1[10:13]*): page 2 caches block a.a.a, but its position 10 holds nothing"
    )
    assert found["fcfs"] is None
    assert found["repro"]["returncode"] == 1, found["repro"]["stdout"]
    assert "REPRODUCED" in found["repro"]["stdout"]


@pytest.mark.parametrize(
    "repro", ["dynamo_child_before_parent", "dynamo_removal_after_parent", "dynamo_copies"]
)
def test_dynamos_differences_replay_on_dynamo_alone(peers_python: Path, repro: str) -> None:
    """What the index machine finds in Dynamo's tree under the default declarations (a child
    stored before its parent is refused; a child's removal after its parent's fails; one
    removal of two copies drops the block), replayed by the standalone scripts."""
    script = ROOT / "benchmarks" / "peers" / "repro" / f"{repro}.py"
    run = subprocess.run(
        [str(peers_python), str(script)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "REPRODUCED" in run.stdout
