"""Replay equals seed 002's reference on the real traces, totals and every request."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.cli import read_trace
from prefixflight.core import ConfigError, ReplayConfig, TraceRecord, replay
from prefixflight.specs import reference_replay, traces


@cache
def real_trace(name: str) -> tuple[TraceRecord, ...]:
    with read_trace(f"bundled:{name}") as reader:
        return tuple(reader)


def test_the_published_value() -> None:
    records = itertools.islice(real_trace("conversation"), 2000)
    report = replay(records, policy="s3fifo", cache_capacity_blocks=4096)
    assert report.total_hit_tokens == 2394659
    assert report.overall_hit_rate == 0.08726327241088713
    assert report.final_cache_blocks == 2535


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
@pytest.mark.parametrize("capacity", [1024, 4096, 16384])
def test_real_traces_equal_the_reference(name: str, policy: str, capacity: int) -> None:
    records = real_trace(name)
    ours = replay(records, policy=policy, cache_capacity_blocks=capacity, per_request=True)
    ref = reference_replay(records, policy=policy, cache_capacity_blocks=capacity)
    assert ours.per_request is not None
    assert [(r.prompt_tokens, r.hit_tokens) for r in ours.per_request] == ref.per_request
    assert [r.idx for r in ours.per_request] == list(range(len(records)))
    assert ours.total_hit_tokens == ref.total_hit_tokens
    assert ours.total_prompt_tokens == ref.total_prompt_tokens
    assert ours.final_cache_blocks == ref.final_cache_blocks
    # seed 002's quick sanity checks
    d = ours.to_dict()
    assert d["overall_hit_rate"] == d["total_hit_tokens"] / d["total_prompt_tokens"]
    assert sum(r["hit_tokens"] for r in d["per_request"]) == d["total_hit_tokens"]
    assert sum(r["prompt_tokens"] for r in d["per_request"]) == d["total_prompt_tokens"]
    assert d["final_cache_blocks"] <= capacity
    assert "length_mismatch_lines" not in d  # the real traces are consistent at 512


@given(
    traces(block_size=4),
    st.integers(0, 10),
    st.sampled_from(["s3fifo", "LRU", "S3FIFO"]),
    st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
    st.integers(0, 3),
)
def test_generated_traces_equal_the_reference(
    records: list[TraceRecord], capacity: int, policy: str, ratio: float, max_freq: int
) -> None:
    kw = dict(
        policy=policy,
        cache_capacity_blocks=capacity,
        block_size=4,
        small_ratio=ratio,
        max_freq=max_freq,
    )
    ours = replay(records, per_request=True, **kw)  # type: ignore[arg-type]
    ref = reference_replay(records, **kw)  # type: ignore[arg-type]
    assert ours.per_request is not None
    assert [(r.prompt_tokens, r.hit_tokens) for r in ours.per_request] == ref.per_request
    assert ours.final_cache_blocks == ref.final_cache_blocks
    assert ours.policy == policy.lower()


def test_report_schema_is_exact() -> None:
    report = replay([], cache_capacity_blocks=4)
    assert list(report.to_dict()) == [
        "policy",
        "block_size",
        "cache_capacity_blocks",
        "total_requests",
        "total_prompt_tokens",
        "total_hit_tokens",
        "overall_hit_rate",
        "final_cache_blocks",
    ]
    assert report.overall_hit_rate == 0.0
    per = replay(
        [TraceRecord(input_length=5, hash_ids=(1,))], cache_capacity_blocks=4, per_request=True
    ).to_dict()
    assert per["per_request"] == [{"idx": 0, "prompt_tokens": 5, "hit_tokens": 0}]


def test_length_mismatches_are_valid_and_counted() -> None:
    recs = [TraceRecord(input_length=1000, hash_ids=(1, 2, 3))] * 2  # ceil(1000/512) == 2
    d = replay(recs, policy="lru", cache_capacity_blocks=8).to_dict()
    assert d["length_mismatch_lines"] == 2
    assert d["total_hit_tokens"] == 1000  # the second request hits, clamped to its length


def test_config_is_validated_and_named() -> None:
    with pytest.raises(ConfigError, match="'fifo'"):
        ReplayConfig(policy="fifo", cache_capacity_blocks=4)
    with pytest.raises(ConfigError, match="-2"):
        ReplayConfig(cache_capacity_blocks=-2)
    with pytest.raises(ConfigError, match="'bogus'"):
        ReplayConfig.from_mapping({"bogus": 1, "cache_capacity_blocks": 4})
    with pytest.raises(ConfigError, match="not both"):
        replay([], ReplayConfig(cache_capacity_blocks=1), policy="lru")


def test_bundled_traces_exist_and_are_the_real_ones() -> None:
    assert len(real_trace("conversation")) == 12031
    assert len(real_trace("synthetic")) == 3993
    assert Path(str(read_trace)).name  # the shell is importable without extras
