"""The batch-shaped engine path of PrefixCache (publish without events, publish_pages,
evict_many) has exactly the outcome of the block-by-block path."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflight.core import LRU, S3FIFO, CapacityError, PrefixCache, UsageError
from prefixflight.core.cache import KVEvent

_block = st.integers(0, 14)
_op = st.one_of(
    st.tuples(st.just("publish"), st.lists(_block, max_size=7)),
    st.tuples(st.just("pin"), st.lists(_block, max_size=3)),
    st.tuples(st.just("unpin"), st.lists(_block, max_size=3)),
    st.tuples(st.just("evict_many"), st.integers(0, 4)),
    st.tuples(st.just("access"), st.lists(_block, max_size=5)),
)


def _make(policy: str, capacity: int, events: bool) -> PrefixCache:
    pol = LRU(capacity) if policy == "lru" else S3FIFO(capacity, small_ratio=0.25)
    sink_events: list[KVEvent] = []
    return PrefixCache(pol, 4, event_sink=sink_events.append if events else None)


def _state(cache: PrefixCache) -> Any:
    pol = cache.policy
    view: tuple[Any, ...]
    if isinstance(pol, S3FIFO):
        view = (pol.small_queue(), pol.main_queue(), pol.ghost_queue())
    else:
        assert isinstance(pol, LRU)
        view = (pol.order(),)
    pages = {b: cache.page(b) for b in pol.resident()}
    return view, pages, cache.stats


def _apply(cache: PrefixCache, op: tuple[str, Any], next_page: int) -> Any:
    name, arg = op
    try:
        if name == "publish":
            pages = list(range(next_page, next_page + len(arg)))
            return cache.publish_pages(arg, pages)
        if name == "pin":
            return cache.pin(arg)
        if name == "unpin":
            return cache.unpin(arg)
        if name == "evict_many":
            return cache.evict_many(arg)
        return cache.access(arg, 4 * len(arg))
    except CapacityError as exc:
        return ("CapacityError", exc.applied)
    except UsageError as exc:
        return ("UsageError", str(exc))


@given(
    policy=st.sampled_from(["lru", "s3fifo"]),
    capacity=st.integers(0, 6),
    ops=st.lists(_op, max_size=30),
)
def test_batch_path_equals_block_by_block(
    policy: str, capacity: int, ops: list[tuple[str, Any]]
) -> None:
    fast = _make(policy, capacity, events=False)
    slow = _make(policy, capacity, events=True)  # events force the block-by-block path
    for step, op in enumerate(ops):
        assert _apply(fast, op, 100 * step) == _apply(slow, op, 100 * step), op
        assert _state(fast) == _state(slow)
        fast.check_invariants()


def test_publish_pages_returns_duplicates_and_evicted_pages() -> None:
    cache = PrefixCache(LRU(3), 4)
    assert cache.publish_pages(["a", "b"], [0, 1]) == ([], [])
    # "a" is already resident: its page 2 comes back; "c" and "d" fill and evict "b"... LRU:
    evicted, unused = cache.publish_pages(["a", "c", "d"], [2, 3, 4])
    assert unused == [2]
    assert evicted == [("b", 1)]
    assert [cache.page(b) for b in ("a", "c", "d")] == [0, 3, 4]
    with pytest.raises(UsageError, match="2 pages for 1 blocks"):
        cache.publish_pages(["x"], [1, 2])


def test_evict_many_stops_at_pinned_blocks() -> None:
    cache = PrefixCache(S3FIFO(4), 4)
    cache.publish(["a", "b", "c"], [0, 1, 2])
    cache.pin(["b"])
    got = cache.evict_many(5)
    assert sorted(got) == [("a", 0), ("c", 2)]
    assert cache.stats.evictions == 2
    assert list(cache.policy.resident()) == ["b"]
    with pytest.raises(UsageError, match="-1"):
        cache.evict_many(-1)


@given(
    policy=st.sampled_from(["lru", "s3fifo"]),
    capacity=st.integers(0, 6),
    blocks=st.lists(_block, max_size=20),
    pins=st.lists(_block, max_size=4),
    count=st.integers(0, 8),
)
def test_policy_evict_many_equals_repeated_evict(
    policy: str, capacity: int, blocks: list[int], pins: list[int], count: int
) -> None:
    def make() -> LRU | S3FIFO:
        pol: LRU | S3FIFO = LRU(capacity) if policy == "lru" else S3FIFO(capacity, 0.25)
        pol.access(blocks)  # nothing is pinned yet: never a CapacityError
        for b in pins:
            if b in pol:
                pol.pin(b)
        return pol

    many, one = make(), make()
    expected = []
    for _ in range(count):
        victim = one.evict()
        if victim is None:
            break
        expected.append(victim)
    assert many.evict_many(count) == expected
    view = "order" if policy == "lru" else "main_queue"
    assert getattr(many, view)() == getattr(one, view)()
    assert many.resident() == one.resident()
    many.check_invariants()


def test_capacity_error_carries_its_payload_from_construction() -> None:
    """The payload is given when the error is made, not patched in by the layers above."""
    import pickle

    from prefixflight.core import CapacityError

    err = CapacityError("full", applied=2, evicted=[(b"x", 3)], unused_pages=(5, 6))
    assert (err.applied, err.evicted, err.unused_pages) == (2, [(b"x", 3)], [5, 6])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.applied, back.evicted, back.unused_pages) == (
        "full", 2, [(b"x", 3)], [5, 6],
    )  # fmt: skip
