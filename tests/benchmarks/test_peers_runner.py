"""The peers harness (benchmarks/peers/run.py) on tiny workloads: our side runs, and a peer
that is not installed is skipped with a message, never a failure. Timings are not checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "run.py"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_run", _RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_run"] = module
    spec.loader.exec_module(module)
    return module


def test_missing_peers_are_skipped_and_ours_runs(
    runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for peer in ("vllm", "sglang", "libcachesim"):
        if importlib.util.find_spec(peer) is not None:
            pytest.skip(f"{peer} is installed here: the skip path cannot be exercised")
    messages: list[str] = []
    out = tmp_path / "peers.json"
    status = runner.main(
        [
            "--workloads",
            "engine,policy",
            "--rounds",
            "2",
            "--requests",
            "150",
            "--keys",
            "3000",
            "--objects",
            "500",
            "--capacities",
            "64",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        log=messages.append,
    )
    assert status == 0
    skipped = [m for m in messages if m.startswith("skipping")]
    assert {m.split()[1].rstrip(":") for m in skipped} == {"vLLM", "SGLang", "libCacheSim"}
    table = capsys.readouterr().out
    assert "**prefixflight S3FIFO**" in table
    import json

    doc = json.loads(out.read_text())
    engine, policy = doc["groups"]
    names = [r["name"] for r in engine["rows"]]
    assert names == [
        "prefixflight S3FIFO",
        "prefixflight LRU",
        "plain-Python minimal block cache",
    ]
    # ours with either policy and the minimal cache do the same work on the engine path
    rates = {r["name"]: r["hit_rate"] for r in engine["rows"]}
    assert rates["prefixflight S3FIFO"] == rates["prefixflight LRU"] > 0
    assert all(len(r["rounds"]) == 2 for g in doc["groups"] for r in g["rows"])
    # the batch-shaped and the per-key S3FIFO stream count the same hits
    prates = {r["name"]: r["hit_rate"] for r in policy["rows"]}
    assert prates["prefixflight S3FIFO"] == prates["prefixflight S3FIFO, one call per key"]


def test_engine_workload_shares_the_prefix(runner: ModuleType) -> None:
    prompts = runner.engine_prompts(n=200, seed=3)
    assert all(512 <= len(p) <= 4096 for p in prompts)
    heads = [bytes(p[:16]) for p in prompts]
    shared = max(heads.count(h) for h in set(heads))
    assert 30 <= shared <= 90  # about 30% start with the common prefix


def test_policy_stream_agrees_with_per_call_replay(runner: ModuleType) -> None:
    stream = runner.zipf_stream(n=5000, objects=300, seed=2)
    for policy in ("s3fifo", "lru"):
        batch = runner.ours_policy(stream, 50, policy)
        from prefixflight.core import LRU, S3FIFO

        pol = S3FIFO(50) if policy == "s3fifo" else LRU(50)
        hits = 0
        for key in stream:
            hits += key in pol
            pol.access([key])
        assert batch.hit_rate == hits / len(stream)
