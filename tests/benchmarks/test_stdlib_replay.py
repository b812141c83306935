"""benchmarks/cache/stdlib_replay.py, the yardstick of the start-up benchmark, computes exactly
what ``prefixflight replay`` computes (random traces, both policies, edge capacities), and
benchmarks/cache/startup.py runs end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflight.core import TraceRecord, replay

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cache"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", _BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module


STDLIB = _load("stdlib_replay")

records = st.lists(
    st.builds(
        lambda ids, extra: {"input_length": max(0, len(ids) * 4 - extra), "hash_ids": ids},
        st.lists(st.integers(0, 12), max_size=6),
        st.integers(0, 5),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    trace=records,
    policy=st.sampled_from(["s3fifo", "lru"]),
    capacity=st.integers(0, 10),
    small_ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    max_freq=st.integers(0, 3),
)
def test_the_stdlib_script_equals_the_library(
    trace: list[dict[str, Any]], policy: str, capacity: int, small_ratio: float, max_freq: int
) -> None:
    cache = STDLIB.S3FIFO(capacity, small_ratio, max_freq) if policy == "s3fifo" else (
        STDLIB.LRU(capacity)
    )  # fmt: skip
    theirs = STDLIB.replay(trace, cache, 4)
    recs = [TraceRecord(input_length=r["input_length"], hash_ids=tuple(r["hash_ids"]))
            for r in trace]  # fmt: skip
    ours = replay(
        recs,
        policy=policy,
        cache_capacity_blocks=capacity,
        block_size=4,
        small_ratio=small_ratio,
        max_freq=max_freq,
    )
    assert theirs["total_hit_tokens"] == ours.total_hit_tokens
    assert theirs["total_prompt_tokens"] == ours.total_prompt_tokens
    assert theirs["total_requests"] == ours.total_requests
    assert theirs["length_mismatch_lines"] == ours.length_mismatch_lines
    assert len(cache) == ours.final_cache_blocks


def test_the_startup_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(_BENCH / "startup.py"),
            "--trace",
            "bundled:synthetic",
            "--capacity",
            "256",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["report"]["total_requests"] == 3993
    assert doc["stdlib_over_ours"] > 0 and "stdlib script time" in proc.stdout
