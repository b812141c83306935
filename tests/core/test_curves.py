"""LRUCurve (Mattson's stack distances) equals one LRU replay per capacity, per request."""

from __future__ import annotations

import gzip
import itertools
import json
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflight.core import (
    LRU,
    ConfigError,
    PrefixCache,
    TraceRecord,
    UsageError,
    replay,
)
from prefixflight.core.cache import CurvePoint, LRUCurve, auto_capacities, lru_curve


def _records(draw_requests: list[tuple[list[int], int]]) -> list[TraceRecord]:
    return [TraceRecord(input_length=n, hash_ids=tuple(ids)) for ids, n in draw_requests]


# Prompts drawn from a few shared prefixes over a small block alphabet, so blocks are
# re-accessed at every stack depth; duplicates inside one request are allowed.
_request = st.tuples(
    st.lists(st.integers(0, 40), max_size=12),
    st.integers(0, 12 * 8),
)
_prefixes = st.lists(st.lists(st.integers(0, 40), max_size=6), min_size=1, max_size=4)


@st.composite
def _traces(draw: st.DrawFn) -> list[TraceRecord]:
    prefixes = draw(_prefixes)
    reqs = draw(st.lists(st.tuples(st.sampled_from(prefixes), _request), max_size=40))
    return _records([(p + ids, n) for p, (ids, n) in reqs])


def _replay_per_request(
    records: list[TraceRecord], capacity: int, block_size: int
) -> tuple[list[int], PrefixCache]:
    cache = PrefixCache(LRU(capacity), block_size)
    return [cache.access(r.hash_ids, r.input_length) for r in records], cache


@given(
    records=_traces(),
    capacities=st.lists(st.integers(0, 45), min_size=1, max_size=6, unique=True),
    block_size=st.sampled_from([1, 8]),
)
def test_curve_equals_lru_replays_per_request(
    records: list[TraceRecord], capacities: list[int], block_size: int
) -> None:
    curve = LRUCurve(capacities, block_size)
    rows = [curve.access(r.hash_ids, r.input_length) for r in records]
    for j, cap in enumerate(capacities):
        expected, cache = _replay_per_request(records, cap, block_size)
        assert [row[j] for row in rows] == expected
        point = curve.points()[j]
        assert point.total_hit_tokens == cache.stats.hit_tokens
        assert point.total_prompt_tokens == cache.stats.prompt_tokens
        assert point.total_requests == len(records)
        assert point.final_cache_blocks == len(cache)
    # the bulk path gives the same totals
    bulk = LRUCurve(capacities, block_size)
    bulk.feed(records)
    assert bulk.points() == curve.points()


@given(records=_traces())
def test_stack_distance_is_the_lru_depth(records: list[TraceRecord]) -> None:
    curve = LRUCurve([1])
    unbounded = LRU(10**9)
    for r in records:
        order = unbounded.order()  # least recently used first
        depth = {b: len(order) - i for i, b in enumerate(order)}
        assert curve.stack_distances(r.hash_ids) == [depth.get(b) for b in r.hash_ids]
        curve.access(r.hash_ids, r.input_length)
        unbounded.access(r.hash_ids)


@settings(max_examples=5)
@given(st.integers(1500, 5000))
def test_many_chunks_of_access_times(n: int) -> None:
    # thousands of accesses: the recency stack spans several chunks and Fenwick nodes
    records = [
        TraceRecord(input_length=4 * 16, hash_ids=(i % 7, i % 300, i % 1201, i)) for i in range(n)
    ]
    caps = [0, 3, 50, 400, 1300, 4000]
    curve = LRUCurve(caps, 16)
    rows = [curve.access(r.hash_ids, r.input_length) for r in records]
    for j, cap in enumerate(caps):
        assert [row[j] for row in rows] == _replay_per_request(records, cap, 16)[0]


def _bundled(name: str) -> list[TraceRecord]:
    path = resources.files("prefixflight.cli").joinpath("data", f"{name}_trace.jsonl.gz")
    with gzip.open(str(path), "rt", encoding="utf-8") as fh:
        return [
            TraceRecord(input_length=o["input_length"], hash_ids=tuple(o["hash_ids"]))
            for o in map(json.loads, fh)
        ]


@pytest.mark.parametrize(
    ("name", "capacities"),
    [("conversation", [256, 4096, 40000]), ("synthetic", [512, 8192])],
)
def test_curve_equals_replays_on_real_traces(name: str, capacities: list[int]) -> None:
    records = _bundled(name)
    curve = LRUCurve(capacities, 512)
    rows = [curve.access(r.hash_ids, r.input_length) for r in records]
    for j, cap in enumerate(capacities):
        assert [row[j] for row in rows] == _replay_per_request(records, cap, 512)[0]
    report = replay(records, policy="lru", cache_capacity_blocks=capacities[0])
    point = lru_curve(records, capacities)[0]
    assert (point.total_hit_tokens, point.overall_hit_rate, point.final_cache_blocks) == (
        report.total_hit_tokens,
        report.overall_hit_rate,
        report.final_cache_blocks,
    )


def test_point_to_dict_is_the_sweep_schema() -> None:
    p = CurvePoint(
        capacity=8,
        total_requests=2,
        total_prompt_tokens=40,
        total_hit_tokens=10,
        final_cache_blocks=3,
    )
    assert p.to_dict() == {
        "capacity": 8,
        "total_hit_tokens": 10,
        "overall_hit_rate": 0.25,
        "final_cache_blocks": 3,
    }
    assert (
        CurvePoint(
            capacity=1,
            total_requests=0,
            total_prompt_tokens=0,
            total_hit_tokens=0,
            final_cache_blocks=0,
        ).overall_hit_rate
        == 0.0
    )


@pytest.mark.parametrize(
    ("capacities", "match"),
    [
        ([], "at least one"),
        ([4, 4], "duplicates"),
        ([-1], "capacity"),
        ([True], "capacity"),
        ([2.0], "capacity"),
    ],
)
def test_bad_capacities_are_rejected(capacities: list[object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LRUCurve(capacities)  # type: ignore[arg-type]


def test_rejected_request_changes_nothing() -> None:
    curve = LRUCurve([1, 4], 2)
    curve.access((1, 2, 3), 6)
    before = (curve.points(), curve.stack_distances((1, 2, 3, 4)))
    with pytest.raises(UsageError, match="-1"):
        curve.access((3, 4), -1)
    assert (curve.points(), curve.stack_distances((1, 2, 3, 4))) == before


@given(st.integers(0, 10**7), st.integers(2, 40), st.integers(1, 64))
def test_auto_capacities_are_log_spaced_up_to_the_distinct_count(
    distinct: int, points: int, smallest: int
) -> None:
    caps = auto_capacities(distinct, points, smallest)
    assert list(caps) == sorted(set(caps))
    assert caps[-1] == distinct
    assert len(caps) <= points
    if distinct > smallest:
        assert caps[0] == smallest
        ratios = [b / a for a, b in itertools.pairwise(caps)]
        step = (distinct / smallest) ** (1 / (points - 1))
        assert all(r <= step * 1.5 + 1 for r in ratios)
