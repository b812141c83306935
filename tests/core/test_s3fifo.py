"""S3FIFO to the letter of seed 002: one named test per "Common mistakes" bullet, the edge
cases DESIGN.md pins, configuration errors and pinning."""

from __future__ import annotations

import math

import pytest

from prefixflight.core import (
    LRU,
    S3FIFO,
    CapacityError,
    ConfigError,
    PrefixCache,
    UsageError,
)
from prefixflight.core.cache import compiled


def accesses(policy: S3FIFO | LRU, *blocks: int) -> list[object]:
    evicted: list[object] = []
    for b in blocks:
        evicted += policy.access([b])
    policy.check_invariants()
    return evicted


# -- "Common mistakes" (seed 002), one test each ---------------------------------------------


def test_mistake_lru_instead_of_s3fifo() -> None:
    # A warm block survives a scan of one-hit wonders in S3FIFO (they pass through S into
    # the ghost) while LRU evicts it after `capacity` new blocks.
    seq = (1, 1, 2, 3, 1, 4, 5, 6, 7)
    s3, lru = S3FIFO(4, small_ratio=0.25), LRU(4)
    accesses(s3, *seq)
    accesses(lru, *seq)
    assert 1 in s3
    assert 1 not in lru
    assert len(s3) < len(lru) == 4  # different final sizes, too


def test_mistake_forgetting_the_min_clamp() -> None:
    cache = PrefixCache(S3FIFO(8, small_ratio=0.5), block_size=4)
    assert cache.access([1, 2], 6) == 0
    assert cache.access([1, 2], 6) == 6  # not 2 * 4 = 8


def test_mistake_counting_ghost_hits_as_residency() -> None:
    policy = S3FIFO(4, small_ratio=0.25)  # S holds 1 block
    accesses(policy, 1, 2)  # 1 is cold when 2 arrives: S -> G
    assert 1 in policy.ghost_queue()
    assert 1 not in policy
    cache = PrefixCache(policy, block_size=4)
    assert cache.access([1], 4) == 0  # a ghost hit is a miss
    assert policy.main_queue() == ((1, 0),)  # ...that fast-tracks 1 into M with freq 0


def test_mistake_forgetting_to_saturate_freq() -> None:
    policy = S3FIFO(10, max_freq=3)
    accesses(policy, *([7] * 20))
    assert policy.freq(7) == 3


def test_mistake_plain_fifo_eviction_in_main() -> None:
    policy = S3FIFO(3, small_ratio=0.0)  # no small queue: new blocks go to M
    accesses(policy, 1, 2, 3, 1)  # 1 is warm
    assert accesses(policy, 4) == [2]  # second chance spares 1; plain FIFO would evict 1
    assert 1 in policy


def test_mistake_requeue_at_the_head() -> None:
    policy = S3FIFO(3, small_ratio=0.0)
    accesses(policy, 1, 2, 3, 1, 4)
    assert policy.main_queue() == ((3, 0), (1, 0), (4, 0))  # 1 requeued at the tail


def test_mistake_set_intersection_instead_of_longest_prefix() -> None:
    cache = PrefixCache(S3FIFO(8, small_ratio=0.5), block_size=4)
    cache.access([2, 3], 8)
    assert cache.access([1, 2, 3], 12) == 0  # 2 and 3 are resident, but block 0 missed


def test_mistake_updating_freq_only_on_prefix_hits() -> None:
    policy = S3FIFO(8, small_ratio=0.5)
    cache = PrefixCache(policy, block_size=4)
    cache.access([1], 4)
    cache.access([9, 1], 8)  # 9 misses first: the prefix hit is 0, yet 1 is accessed
    assert policy.freq(1) == 1


def test_mistake_final_cache_blocks_including_the_ghost() -> None:
    policy = S3FIFO(10)
    accesses(policy, *range(30))
    assert policy.ghost_queue()
    assert len(policy) == len(policy.small_queue()) + len(policy.main_queue())
    assert len(policy) == len(policy.resident())


def test_mistake_resetting_freq_on_promotion() -> None:
    policy = S3FIFO(4, small_ratio=0.25)
    accesses(policy, 1, 1, 1, 2)  # 1 leaves S with freq 2
    assert policy.main_queue() == ((1, 2),)


def test_mistake_int_instead_of_round_for_the_small_queue() -> None:
    assert S3FIFO(4096).small_capacity == round(409.6) == 410  # int() gives 409
    assert S3FIFO(5, small_ratio=0.5).small_capacity == 2  # banker's: round(2.5) == 2


def test_mistake_ghost_capacity_equal_to_small() -> None:
    policy = S3FIFO(10)  # S 1, M 9, G 9
    accesses(policy, *range(20))  # every block passes S cold and lands in G
    assert policy.ghost_capacity == policy.main_capacity == 9
    assert len(policy.ghost_queue()) == 9


# -- edge cases pinned by DESIGN.md ----------------------------------------------------------


def test_small_queue_of_size_zero_sends_new_blocks_to_main_with_freq_0() -> None:
    policy = S3FIFO(3, small_ratio=0.1)  # round(0.3) == 0
    assert policy.small_capacity == 0
    accesses(policy, 5)
    assert policy.main_queue() == ((5, 0),)


def test_main_of_size_zero_admits_nothing_and_ghosts_nothing() -> None:
    policy = S3FIFO(3, small_ratio=1.0)
    assert policy.main_capacity == 0
    evicted = accesses(policy, 1, 1, 2, 3, 4, 5)
    assert evicted == [1, 2]  # warm 1 is dropped too: nothing enters main
    assert policy.main_queue() == () and policy.ghost_queue() == ()
    assert [b for b, _ in policy.small_queue()] == [3, 4, 5]


def test_capacity_zero_keeps_nothing() -> None:
    for policy in (S3FIFO(0), LRU(0)):
        assert accesses(policy, 1, 1, 2) == []
        assert len(policy) == 0


def test_duplicate_blocks_in_one_request_are_accessed_in_order() -> None:
    policy = S3FIFO(10)
    policy.access([4, 4, 4])
    assert policy.freq(4) == 2


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"capacity": -1}, "-1"),
        ({"capacity": True}, "True"),
        ({"capacity": 2.0}, "2.0"),
        ({"capacity": 4, "small_ratio": 1.5}, "1.5"),
        ({"capacity": 4, "small_ratio": -0.1}, "-0.1"),
        ({"capacity": 4, "small_ratio": math.nan}, "nan"),
        ({"capacity": 4, "max_freq": -1}, "-1"),
        ({"capacity": 4, "ghost_admit_freq": -2}, "-2"),
        ({"capacity": 4, "max_freq": 1, "ghost_admit_freq": 2}, "2"),
    ],
)
def test_invalid_configuration_names_the_value(kwargs: dict[str, object], named: str) -> None:
    if compiled and isinstance(kwargs["capacity"], float):
        # the compiled build checks a non-int's type at the call, before the validation runs
        # (docs/performance.md); a type checker rejects such a call already
        with pytest.raises(TypeError, match="float"):
            S3FIFO(**kwargs)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError, match=named):
        S3FIFO(**kwargs)  # type: ignore[arg-type]


def test_lru_rejects_negative_capacity() -> None:
    with pytest.raises(ConfigError, match="-3"):
        LRU(-3)


# -- pinning ---------------------------------------------------------------------------------


def test_a_pinned_block_is_never_evicted() -> None:
    policy = S3FIFO(3, small_ratio=0.0)
    accesses(policy, 1, 2, 3)
    policy.pin(1)
    assert accesses(policy, 4, 5) == [2, 3]
    assert 1 in policy
    policy.unpin(1)
    assert accesses(policy, 6) == [1]


def test_admission_fails_cleanly_when_everything_is_pinned() -> None:
    for policy in (S3FIFO(2, small_ratio=0.0), LRU(2)):
        policy.access([1, 2])
        policy.pin(1)
        policy.pin(2)
        before = policy.resident()
        with pytest.raises(CapacityError) as info:
            policy.access([1, 3])
        assert info.value.applied == 1  # the hit on 1 was applied, 3 was not
        assert policy.resident() == before
        assert policy.evict() is None
        policy.check_invariants()


def test_pin_errors_name_the_block() -> None:
    policy = S3FIFO(4)
    with pytest.raises(UsageError, match="42"):
        policy.pin(42)
    with pytest.raises(UsageError, match="42"):
        policy.unpin(42)
    policy.access([42])
    policy.pin(42)
    with pytest.raises(UsageError, match="pinned"):
        policy.remove(42)
    with pytest.raises(UsageError, match="pinned"):
        policy.clear()
