"""FlightCoordinator: every transition and fault path of the single flight."""

from __future__ import annotations

from typing import Any

import pytest

from prefixflight.core import (
    BlockHasher,
    ConfigError,
    FlightConfig,
    FlightCoordinator,
    FlightKey,
    ReleasePolicy,
    UsageError,
)
from prefixflight.core.flight import (
    Aborted,
    Arrived,
    Finished,
    Independent,
    Lead,
    Placement,
    PrefillDone,
    Progress,
    Promote,
    Release,
    ReleaseReason,
    Tick,
    Wait,
)

PROMPT = tuple(range(100, 133))  # 33 tokens: 2 full blocks of 16 reusable by a follower
KEY = FlightKey.of(PROMPT)


def arrive(
    rid: int, now: float = 0.0, key: FlightKey = KEY, blocks: tuple[object, ...] = ()
) -> Arrived:
    return Arrived(request_id=rid, key=key, now=now, blocks=blocks)


def snapshot(c: FlightCoordinator) -> object:
    return (c.placements(), c.flights(), c.stats, c.now)


def test_identical_requests_elect_one_leader_and_release_after_prefill() -> None:
    c = FlightCoordinator()
    assert c.handle(arrive(1)) == (Lead(request_id=1, flight=0),)
    assert c.handle(arrive(2, 0.5)) == (Wait(request_id=2, flight=0),)
    assert c.handle(arrive(3, 1.0)) == (Wait(request_id=3, flight=0),)
    assert c.placements() == {1: Placement.LEADING, 2: Placement.WAITING, 3: Placement.WAITING}
    out = c.handle(PrefillDone(request_id=1, now=2.0))
    assert out == (Release(flight=0, request_ids=(2, 3), reason=ReleaseReason.PREFILL_PUBLISHED),)
    # the flight is gone; every member is tracked as released until it terminates
    assert len(c) == 0
    assert c.placements() == {r: Placement.RELEASED for r in (1, 2, 3)}
    s = c.stats
    assert (s.flights_opened, s.followers, s.waits) == (1, 2, 2)
    assert s.total_wait == pytest.approx(1.5 + 1.0)
    assert s.max_wait == pytest.approx(1.5)
    bs = c.config.block_size
    assert s.tokens_not_recomputed == 2 * ((len(PROMPT) - 1) // bs * bs)
    for r in (1, 2, 3):
        assert c.handle(Finished(request_id=r, now=3.0)) == ()
    assert c.placements() == {}
    c.check_invariants()


def test_new_identical_request_after_release_opens_a_new_flight() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    c.handle(PrefillDone(request_id=1, now=1.0))
    assert c.handle(arrive(2, 2.0)) == (Lead(request_id=2, flight=1),)
    assert c.stats.flights_opened == 2


def test_on_completion_waits_for_the_leaders_end() -> None:
    c = FlightCoordinator(FlightConfig(policy=ReleasePolicy.ON_COMPLETION))
    c.handle(arrive(1))
    c.handle(arrive(2))
    assert c.handle(PrefillDone(request_id=1, now=1.0)) == ()
    assert c.placement(2) is Placement.WAITING
    # a late identical arrival still joins the open flight
    assert c.handle(arrive(3, 2.0)) == (Wait(request_id=3, flight=0),)
    out = c.handle(Finished(request_id=1, now=5.0))
    assert out == (Release(flight=0, request_ids=(2, 3), reason=ReleaseReason.LEADER_FINISHED),)
    assert c.placements() == {2: Placement.RELEASED, 3: Placement.RELEASED}


def test_independent_never_coordinates() -> None:
    c = FlightCoordinator(FlightConfig(policy=ReleasePolicy.INDEPENDENT))
    assert c.handle(arrive(1)) == (Independent(request_id=1),)
    assert c.handle(arrive(2)) == (Independent(request_id=2),)
    assert c.handle(PrefillDone(request_id=1, now=1.0)) == ()
    assert c.placements() == {1: Placement.INDEPENDENT, 2: Placement.INDEPENDENT}
    assert c.stats.flights_opened == 0


def test_namespaces_never_share_a_flight() -> None:
    c = FlightCoordinator()
    a = c.handle(arrive(1, key=FlightKey.of(PROMPT, "tenant-a")))
    b = c.handle(arrive(2, key=FlightKey.of(PROMPT, "tenant-b")))
    assert isinstance(a[0], Lead) and isinstance(b[0], Lead)
    assert a[0].flight != b[0].flight


def test_different_prompts_never_share_a_flight() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    out = c.handle(arrive(2, key=FlightKey.of((*PROMPT, 7))))
    assert isinstance(out[0], Lead)


@pytest.mark.parametrize(
    "event",
    [
        PrefillDone(request_id=9, now=1.0),
        Finished(request_id=9, now=1.0),
        Aborted(request_id=9, now=1.0),
        Progress(request_id=9, published_blocks=1, now=1.0),
        Arrived(request_id=1, key=KEY, now=1.0),  # duplicate
        PrefillDone(request_id=2, now=1.0),  # a waiting follower cannot prefill
        Finished(request_id=2, now=1.0),  # ... nor finish
        Tick(now=-1.0),  # time going backwards
        "tick",  # not an event
    ],
)
def test_rejected_events_leave_the_state_unchanged(event: object) -> None:
    c = FlightCoordinator(FlightConfig(max_wait=0.5))
    c.handle(arrive(1))
    c.handle(arrive(2))
    before = snapshot(c)
    with pytest.raises(UsageError):
        c.handle(event)  # type: ignore[arg-type]
    assert snapshot(c) == before
    c.check_invariants()


def test_unknown_after_termination() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    c.handle(Finished(request_id=1, now=1.0))
    with pytest.raises(UsageError, match="unknown request id 1"):
        c.handle(Finished(request_id=1, now=1.0))


def test_leader_abort_before_publishing_promotes_the_oldest_follower() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    c.handle(arrive(2, 1.0))
    c.handle(arrive(3, 2.0))
    out = c.handle(Aborted(request_id=1, now=3.0))
    assert out == (Promote(flight=0, request_id=2),)
    assert c.placements() == {2: Placement.LEADING, 3: Placement.WAITING}
    assert c.stats.promotions == 1
    out = c.handle(PrefillDone(request_id=2, now=4.0))
    assert out == (Release(flight=0, request_ids=(3,), reason=ReleaseReason.PREFILL_PUBLISHED),)


def test_last_leader_abort_without_followers_closes_the_flight() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    assert c.handle(Aborted(request_id=1, now=1.0)) == ()
    assert len(c) == 0 and c.placements() == {}


def test_follower_abort_just_leaves() -> None:
    c = FlightCoordinator()
    c.handle(arrive(1))
    c.handle(arrive(2))
    c.handle(arrive(3))
    assert c.handle(Aborted(request_id=2, now=1.0)) == ()
    out = c.handle(PrefillDone(request_id=1, now=2.0))
    assert out == (Release(flight=0, request_ids=(3,), reason=ReleaseReason.PREFILL_PUBLISHED),)


def test_on_completion_leader_abort_after_prefill_releases_followers() -> None:
    c = FlightCoordinator(FlightConfig(policy=ReleasePolicy.ON_COMPLETION))
    c.handle(arrive(1))
    c.handle(arrive(2))
    c.handle(PrefillDone(request_id=1, now=1.0))
    out = c.handle(Aborted(request_id=1, now=2.0))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.LEADER_ABORTED),)


def test_max_wait_releases_a_follower_to_compute_alone() -> None:
    c = FlightCoordinator(FlightConfig(policy=ReleasePolicy.ON_COMPLETION, max_wait=1.0))
    c.handle(arrive(1))
    c.handle(arrive(2, 0.0))
    c.handle(arrive(3, 0.5))
    assert c.handle(Tick(now=1.0)) == ()  # waited exactly max_wait: not longer
    out = c.handle(Tick(now=1.25))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.TIMEOUT),)
    out = c.handle(Tick(now=2.0))
    assert out == (Release(flight=0, request_ids=(3,), reason=ReleaseReason.TIMEOUT),)
    assert c.stats.timeouts == 2
    assert c.stats.tokens_not_recomputed == 0  # they compute on their own
    assert c.flights() == {0: (1, ())}


def _blocks(tokens: tuple[int, ...]) -> tuple[object, ...]:
    return BlockHasher(4).hash_tokens(tokens)


def test_partial_prefix_waits_for_the_shared_blocks_only() -> None:
    c = FlightCoordinator(FlightConfig(min_shared_blocks=2, block_size=4))
    doc = tuple(range(1, 13))  # 3 blocks
    q1, q2 = (*doc, 50, 51), (*doc[:8], 60, 61, 62, 63, 64)  # share 3 and 2 blocks
    c.handle(arrive(1, key=FlightKey.of(q1), blocks=_blocks(q1)))
    out = c.handle(arrive(2, key=FlightKey.of(q2), blocks=_blocks(q2)))
    assert out == (Wait(request_id=2, flight=0, blocks=2),)
    assert c.handle(Progress(request_id=1, published_blocks=1, now=1.0)) == ()
    out = c.handle(Progress(request_id=1, published_blocks=2, now=2.0))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.BLOCKS_PUBLISHED),)
    assert c.stats.partial_followers == 1
    assert c.stats.tokens_not_recomputed == 8
    # once the blocks are published, a newcomer has nothing to wait for
    out = c.handle(arrive(3, 3.0, key=FlightKey.of((*doc[:8], 9)), blocks=_blocks((*doc[:8], 9))))
    assert isinstance(out[0], Lead)


def test_partial_prefix_below_the_threshold_does_not_wait() -> None:
    c = FlightCoordinator(FlightConfig(min_shared_blocks=2, block_size=4))
    a, b = tuple(range(1, 13)), (1, 2, 3, 4, 9, 9, 9, 9, 9)
    c.handle(arrive(1, key=FlightKey.of(a), blocks=_blocks(a)))
    assert isinstance(c.handle(arrive(2, key=FlightKey.of(b), blocks=_blocks(b)))[0], Lead)


def test_partial_waiters_of_an_aborted_flight_are_released() -> None:
    c = FlightCoordinator(FlightConfig(min_shared_blocks=1, block_size=4))
    a, b = tuple(range(1, 13)), (1, 2, 3, 4, 9)
    c.handle(arrive(1, key=FlightKey.of(a), blocks=_blocks(a)))
    c.handle(arrive(2, key=FlightKey.of(b), blocks=_blocks(b)))
    out = c.handle(Aborted(request_id=1, now=1.0))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.LEADER_ABORTED),)
    assert len(c) == 0


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_wait"):
        FlightConfig(max_wait=-1.0)
    with pytest.raises(ConfigError, match="min_shared_blocks"):
        FlightConfig(min_shared_blocks=0)
    with pytest.raises(ConfigError, match="policy"):
        FlightConfig(policy="after_prefill")  # type: ignore[arg-type]


def test_events_validate_their_fields() -> None:
    with pytest.raises(UsageError, match="now"):
        Tick(now=float("nan"))
    with pytest.raises(UsageError, match="request_id"):
        Finished(request_id=1.5, now=0.0)  # type: ignore[arg-type]


def test_flight_key_is_exact() -> None:
    assert FlightKey.of([1, 2, 3]) == FlightKey.of((1, 2, 3))
    assert FlightKey.of([1, 2, 3]) != FlightKey.of([1, 2, 3, 0])
    assert FlightKey.of([1, 2, 3], "x") != FlightKey.of([1, 2, 3], "y")
    with pytest.raises(UsageError):
        FlightKey.of([1 << 70])


def test_partial_waiter_abort_just_leaves() -> None:
    c = FlightCoordinator(FlightConfig(min_shared_blocks=1, block_size=4))
    a, b = tuple(range(1, 13)), (1, 2, 3, 4, 9)
    c.handle(arrive(1, key=FlightKey.of(a), blocks=_blocks(a)))
    c.handle(arrive(2, key=FlightKey.of(b), blocks=_blocks(b)))
    assert c.handle(Aborted(request_id=2, now=1.0)) == ()
    assert c.flights() == {0: (1, ())}
    assert c.handle(PrefillDone(request_id=1, now=2.0)) == ()
    c.check_invariants()


# -- cases found by outside probing ------------------------------------------------------------


def test_a_reused_id_gets_its_own_deadline() -> None:
    """A follower that aborts and re-arrives in the same open flight waits ``max_wait`` from
    its new arrival, not from its first one."""
    c = FlightCoordinator(FlightConfig(policy=ReleasePolicy.ON_COMPLETION, max_wait=1.0))
    c.handle(arrive(1))
    c.handle(arrive(2, 0.0))  # deadline 1.0
    c.handle(Aborted(request_id=2, now=0.5))
    assert c.handle(arrive(2, 0.8)) == (Wait(request_id=2, flight=0),)  # deadline 1.8
    assert c.handle(Tick(now=1.5)) == ()
    assert c.placement(2) is Placement.WAITING
    out = c.handle(Tick(now=1.9))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.TIMEOUT),)
    assert c.stats.max_wait == pytest.approx(1.1)
    c.check_invariants()


def test_a_promotion_chain_id_gets_its_own_deadline() -> None:
    """An id promoted to lead, then gone, then back as a follower of the same flight: the
    deadline of its first wait does not apply to its second."""
    c = FlightCoordinator(FlightConfig(max_wait=1.0))
    c.handle(arrive(1))
    c.handle(arrive(2, 0.0))  # deadline 1.0
    c.handle(arrive(3, 0.1))  # deadline 1.1
    assert c.handle(Aborted(request_id=1, now=0.2)) == (Promote(flight=0, request_id=2),)
    assert c.handle(Aborted(request_id=2, now=0.3)) == (Promote(flight=0, request_id=3),)
    assert c.handle(arrive(2, 0.9)) == (Wait(request_id=2, flight=0),)  # deadline 1.9
    assert c.handle(Tick(now=1.5)) == ()
    assert c.flights() == {0: (3, (2,))}
    out = c.handle(Tick(now=2.0))
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.TIMEOUT),)


def test_flights_lists_waiting_members_oldest_first() -> None:
    """Partial-prefix waiters and exact followers are listed together in arrival order."""
    c = FlightCoordinator(FlightConfig(min_shared_blocks=1, block_size=4))
    a, b = tuple(range(1, 13)), (1, 2, 3, 4, 9)
    c.handle(arrive(1, key=FlightKey.of(a), blocks=_blocks(a)))
    out = c.handle(arrive(2, 1.0, key=FlightKey.of(b), blocks=_blocks(b)))
    assert out == (Wait(request_id=2, flight=0, blocks=1),)
    c.handle(arrive(3, 2.0, key=FlightKey.of(a), blocks=_blocks(a)))  # exact, but younger
    d = (*b, 5)  # partial too, younger still
    c.handle(arrive(4, 3.0, key=FlightKey.of(d), blocks=_blocks(d)))
    assert c.flights() == {0: (1, (2, 3, 4))}


def _unhashable_blocks_event() -> Any:
    return _any(Arrived)(request_id=9, key=FlightKey.of(PROMPT), now=5.0, blocks=([1, 2],))


def _any(cls: object) -> Any:
    """The class, untyped: the wrong types below are the point (a host need not run mypy)."""
    return cls


@pytest.mark.parametrize(
    "make",
    [
        lambda: _any(Progress)(request_id=1, published_blocks=-1, now=1.0),
        lambda: _any(Progress)(request_id=1, published_blocks="2", now=1.0),
        lambda: _any(Progress)(request_id=1, published_blocks=True, now=1.0),
        lambda: _any(Progress)(request_id=1, published_blocks=2.0, now=1.0),
        lambda: _any(Arrived)(request_id=9, key="x", now=1.0),
        lambda: _any(Arrived)(request_id=9, key=KEY, now=1.0, blocks=5),
        lambda: _any(Arrived)(request_id=9, key=KEY, now=1.0, blocks="abc"),
        lambda: _any(Arrived)(request_id=[9], key=KEY, now=1.0),
        lambda: _any(Tick)(now="1.0"),
        lambda: _any(FlightKey)(namespace="x", digest=b"", num_tokens=0),
        lambda: _any(FlightKey)(namespace=b"", digest=b"", num_tokens=-1),
        lambda: _any(FlightKey).of([1, 2], namespace=5),
        lambda: _any(FlightKey).of("abc"),
        _unhashable_blocks_event,
    ],
    ids=[
        "progress-negative",
        "progress-str",
        "progress-bool",
        "progress-float",
        "arrived-key-str",
        "arrived-blocks-int",
        "arrived-blocks-str",
        "arrived-id-list",
        "tick-now-str",
        "key-namespace-str",
        "key-negative-tokens",
        "key-of-namespace-int",
        "key-of-str-tokens",
        "arrived-unhashable-blocks",
    ],
)
def test_rejected_event_inputs_raise_usage_error(make: object) -> None:
    with pytest.raises(UsageError):
        make()  # type: ignore[operator]


def test_unhashable_blocks_leave_state_unchanged() -> None:
    """In partial mode, an arrival with unhashable blocks after a follower's deadline passed
    is rejected before the timeout is applied: no Release is lost, time does not advance."""
    c = FlightCoordinator(FlightConfig(min_shared_blocks=1, block_size=4, max_wait=1.0))
    a = tuple(range(1, 13))
    c.handle(arrive(1, key=FlightKey.of(a), blocks=_blocks(a)))
    c.handle(arrive(2, 0.0, key=FlightKey.of(a), blocks=_blocks(a)))
    before = snapshot(c)
    with pytest.raises(UsageError, match="blocks"):
        c.handle(_unhashable_blocks_event())
    assert snapshot(c) == before
    out = c.handle(Tick(now=5.0))  # the host still sees the timeout
    assert out == (Release(flight=0, request_ids=(2,), reason=ReleaseReason.TIMEOUT),)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_the_coordinator_rejects_non_finite_time(bad: float) -> None:
    c = FlightCoordinator(FlightConfig(max_wait=1.0))
    c.handle(arrive(1))
    c.handle(arrive(2))
    before = snapshot(c)
    for make in (
        lambda: Tick(now=bad),
        lambda: Arrived(request_id=3, key=KEY, now=bad),
        lambda: Progress(request_id=1, published_blocks=1, now=bad),
        lambda: PrefillDone(request_id=1, now=bad),
        lambda: Finished(request_id=1, now=bad),
        lambda: Aborted(request_id=1, now=bad),
    ):
        with pytest.raises(UsageError, match="finite"):
            c.handle(make())
    assert snapshot(c) == before
    assert c.handle(Tick(now=2.0)) == (
        Release(flight=0, request_ids=(2,), reason=ReleaseReason.TIMEOUT),
    )


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, True, "1"])
def test_max_wait_must_be_finite(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_wait"):
        FlightConfig(max_wait=bad)  # type: ignore[arg-type]
