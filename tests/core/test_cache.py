from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.core import (
    LRU,
    S3FIFO,
    PrefixCache,
    TraceRecord,
    UsageError,
    replay,
)
from prefixflight.core.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixflight.specs import traces


class Mirror:
    """What a router keeps: the resident set rebuilt from KV events alone."""

    def __init__(self) -> None:
        self.blocks: set[object] = set()
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)
        match event:
            case BlockStored(block_hashes=hs):
                assert not self.blocks & set(hs), "stored twice"
                self.blocks |= set(hs)
            case BlockRemoved(block_hashes=hs):
                assert set(hs) <= self.blocks, "removed a block never stored"
                self.blocks -= set(hs)
            case AllBlocksCleared():
                self.blocks.clear()


@given(traces(), st.integers(0, 12), st.sampled_from(["s3fifo", "lru"]))
def test_events_mirror_the_cache_and_never_change_the_numbers(
    records: list[TraceRecord], capacity: int, policy: str
) -> None:
    mirror = Mirror()
    plain = replay(
        records, policy=policy, cache_capacity_blocks=capacity, block_size=4, per_request=True
    )
    with_events = replay(
        records,
        policy=policy,
        cache_capacity_blocks=capacity,
        block_size=4,
        per_request=True,
        event_sink=mirror,
    )
    assert with_events == plain
    cache = PrefixCache(
        S3FIFO(capacity) if policy == "s3fifo" else LRU(capacity), 4, event_sink=Mirror()
    )
    for rec in records:
        cache.access(rec.hash_ids, rec.input_length)
        sink = cache._sink
        assert isinstance(sink, Mirror)
        assert sink.blocks == cache.policy.resident()


def test_stats_count_tokens_and_blocks() -> None:
    cache = PrefixCache(S3FIFO(16, small_ratio=0.5), block_size=4)
    cache.access([1, 2, 3], 10)
    cache.access([1, 2, 4], 12)
    s = cache.stats
    assert (s.requests, s.prompt_tokens, s.hit_tokens, s.blocks, s.hit_blocks) == (2, 22, 8, 6, 2)
    assert s.token_hit_rate == 8 / 22
    assert s.block_hit_rate == 2 / 6


def test_publish_attaches_pages_and_returns_them_on_eviction() -> None:
    events: list[KVEvent] = []
    cache = PrefixCache(LRU(2), block_size=2, event_sink=events.append)
    assert cache.publish(["a", "b"], [10, 11], token_ids=[1, 2, 3, 4]) == []
    assert (cache.page("a"), cache.page("b")) == (10, 11)
    assert events[0] == BlockStored(
        block_hashes=("a",), parent_block_hash=None, token_ids=(1, 2), block_size=2
    )
    assert events[1] == BlockStored(
        block_hashes=("b",), parent_block_hash="a", token_ids=(3, 4), block_size=2
    )
    cache.pin(["a"])
    assert cache.publish(["c"], [12], parent="b") == [("b", 11)]
    assert cache.evict() == ("c", 12)
    assert cache.evict() is None  # only "a" is left, and it is pinned
    assert cache.stats.evictions == 2
    cache.check_invariants()


def test_pin_and_unpin_are_all_or_nothing() -> None:
    policy = LRU(4)
    cache = PrefixCache(policy, block_size=1)
    cache.access([1, 2], 2)
    with pytest.raises(UsageError, match="3"):
        cache.pin([1, 3])
    assert policy.pin_count(1) == 0
    cache.pin([1, 2])
    with pytest.raises(UsageError, match="2"):
        cache.unpin([1, 2, 2])
    assert (policy.pin_count(1), policy.pin_count(2)) == (1, 1)
    cache.unpin([1, 2])
    cache.clear()
    assert len(cache) == 0


def test_publish_rejects_mismatched_pages_without_change() -> None:
    cache = PrefixCache(LRU(4), block_size=2)
    with pytest.raises(UsageError, match="1 pages for 2 blocks"):
        cache.publish(["a", "b"], [1])
    with pytest.raises(UsageError, match="3 token ids"):
        cache.publish(["a"], token_ids=[1, 2, 3])
    assert len(cache) == 0


def test_negative_token_count_is_rejected_without_change() -> None:
    cache = PrefixCache(LRU(4), block_size=2)
    with pytest.raises(UsageError, match="-1"):
        cache.access([1], -1)
    with pytest.raises(UsageError, match="True"):
        cache.access([1], True)
    assert cache.stats.requests == 0 and len(cache) == 0


def test_evictions_before_a_capacity_error_are_forgotten() -> None:
    from prefixflight.core import CapacityError

    cache = PrefixCache(S3FIFO(2, small_ratio=0.5), block_size=1)  # S holds 1, M holds 1
    cache.publish(["x"], [0])
    cache.access(["x"], 1)  # x is warm
    cache.publish(["y"], [1])  # x moves to M, y waits in S
    cache.pin(["x"])
    with pytest.raises(CapacityError) as info:
        cache.access(["q", "q", "z"], 3)  # q evicts y; z needs M, which is all pinned
    assert info.value.applied == 2
    assert cache.page("y") is None
    assert cache.stats.evictions == 1
    assert cache.stats.requests == 1  # the failed request is not counted
    cache.check_invariants()


@pytest.mark.parametrize("with_sink", [False, True])
def test_a_failed_publication_loses_no_page(with_sink: bool) -> None:
    from prefixflight.core import CapacityError

    events: list[KVEvent] = []
    cache = PrefixCache(
        S3FIFO(4, small_ratio=0.5), block_size=1, event_sink=events.append if with_sink else None
    )
    for i, b in enumerate(["m1", "m2", "c", "d"]):
        cache.publish([b], [i])
        if b != "c":
            cache.pin([b])
    with pytest.raises(CapacityError) as info:
        cache.publish(["x", "y"], [10, 11])  # x evicts c; y finds every victim pinned
    err = info.value
    kept = {cache.page(b) for b in cache.policy.resident()}
    returned = {p for _, p in err.evicted} | set(err.unused_pages)
    assert kept | returned == {0, 1, 2, 3, 10, 11}  # every page is kept or handed back
    assert not kept & returned
    cache.check_invariants()
