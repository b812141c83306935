"""h2-style total transition test: every (placement x event) pair of the coordinator.

For each place a request can be in (several ways of getting there) and each event kind, build
that state, send the event, and check it is accepted exactly when
`FlightCoordinator.TRANSITIONS` lists the pair, that the request lands where the table says,
and that a rejected event changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixflight.core import (
    BlockHasher,
    FlightConfig,
    FlightCoordinator,
    FlightKey,
    ReleasePolicy,
    RequestId,
    UsageError,
)
from prefixflight.core.flight import (
    Aborted,
    Arrived,
    Finished,
    FlightEvent,
    Placement,
    PrefillDone,
    Progress,
    Tick,
)
from prefixflight.specs import FlightModel

PROMPT = tuple(range(1, 13))
HASH = BlockHasher(4)
KEY = FlightKey.of(PROMPT)
OTHER = (1, 2, 3, 4, 9)  # shares its first block with PROMPT


def _arrive(rid: RequestId, tokens: tuple[int, ...] = PROMPT, now: float = 0.0) -> Arrived:
    blocks = HASH.hash_tokens(tokens)
    return Arrived(request_id=rid, key=FlightKey.of(tokens), now=now, blocks=blocks)


Build = Callable[[ReleasePolicy], tuple[FlightConfig, list[FlightEvent], RequestId]]


def _config(policy: ReleasePolicy, min_shared_blocks: int | None = None) -> FlightConfig:
    return FlightConfig(
        policy=policy, block_size=4, max_wait=10.0, min_shared_blocks=min_shared_blocks
    )


def unknown_never_seen(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy), [_arrive(1), _arrive(2)], 9


def unknown_terminated(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy), [_arrive(1), _arrive(2), Aborted(request_id=2, now=0.5)], 2


def leading(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy), [_arrive(1), _arrive(2)], 1


def leading_promoted(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    events: list[FlightEvent] = [_arrive(1), _arrive(2), _arrive(3), Aborted(request_id=1, now=0.5)]
    return _config(policy), events, 2


def waiting_exact(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy), [_arrive(1), _arrive(2)], 2


def waiting_partial(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy, min_shared_blocks=1), [_arrive(1), _arrive(2, OTHER)], 2


def released_follower(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    # every coordinating policy releases the followers when the leader finishes
    return _config(policy), [_arrive(1), _arrive(2), Finished(request_id=1, now=0.5)], 2


def released_by_timeout(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(policy), [_arrive(1), _arrive(2), Tick(now=10.5)], 2


def independent(policy: ReleasePolicy) -> tuple[FlightConfig, list[FlightEvent], RequestId]:
    return _config(ReleasePolicy.INDEPENDENT), [_arrive(1), _arrive(2)], 1


BUILDS: dict[str, tuple[Build, Placement | None]] = {
    "unknown_never_seen": (unknown_never_seen, None),
    "unknown_terminated": (unknown_terminated, None),
    "leading": (leading, Placement.LEADING),
    "leading_promoted": (leading_promoted, Placement.LEADING),
    "waiting_exact": (waiting_exact, Placement.WAITING),
    "waiting_partial": (waiting_partial, Placement.WAITING),
    "released_follower": (released_follower, Placement.RELEASED),
    "released_by_timeout": (released_by_timeout, Placement.RELEASED),
    "independent": (independent, Placement.INDEPENDENT),
}
EVENTS: dict[str, Callable[[RequestId, float], FlightEvent]] = {
    "arrived_same_prompt": lambda rid, now: _arrive(rid, PROMPT, now),
    "arrived_other_prompt": lambda rid, now: _arrive(rid, (7, 7, 7, 7, 7), now),
    "progress": lambda rid, now: Progress(request_id=rid, published_blocks=1, now=now),
    "prefill_done": lambda rid, now: PrefillDone(request_id=rid, now=now),
    "finished": lambda rid, now: Finished(request_id=rid, now=now),
    "aborted": lambda rid, now: Aborted(request_id=rid, now=now),
    "tick": lambda rid, now: Tick(now=now),
}
POLICIES = (ReleasePolicy.AFTER_PREFILL, ReleasePolicy.ON_COMPLETION)


def _snapshot(c: FlightCoordinator) -> object:
    return (c.placements(), c.flights(), c.stats, c.now, len(c))


def test_the_table_covers_every_place() -> None:
    table = FlightCoordinator.TRANSITIONS
    assert set(table) == {None, *Placement}
    assert {place for _, place in BUILDS.values()} == set(table)
    for row in table.values():
        for event_type, targets in row.items():
            assert event_type is not Tick and targets, "Tick is implicit; no empty targets"


def _accepts(target: FlightCoordinator | FlightModel, event: FlightEvent) -> bool:
    try:
        target.handle(event)
    except UsageError:
        return False
    return True


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
@pytest.mark.parametrize("event_name", list(EVENTS))
@pytest.mark.parametrize("state", list(BUILDS))
def test_every_placement_event_pair(state: str, event_name: str, policy: ReleasePolicy) -> None:
    """The implementation accepts a pair iff the table lists it, and so does the reference
    model of `prefixflight.specs` (an independent reading of the rules)."""
    build, place = BUILDS[state]
    config, events, rid = build(policy)
    c, model = FlightCoordinator(config), FlightModel(config)
    for ev in events:
        c.handle(ev)
        model.handle(ev)
    c.check_invariants()
    assert c.placement(rid) is place, "the builder reaches the place it names"
    event = EVENTS[event_name](rid, c.now + 0.25)
    row = FlightCoordinator.TRANSITIONS[place]
    legal = isinstance(event, Tick) or type(event) in row
    assert _accepts(model, event) == legal, "the table disagrees with the reference model"
    before = _snapshot(c)
    if not legal:
        with pytest.raises(UsageError, match=repr(rid)):
            c.handle(event)
        assert _snapshot(c) == before, "a rejected event changed the state"
        return
    c.handle(event)
    c.check_invariants()
    assert c.placements() == model.placements()
    if isinstance(event, Tick):
        assert c.placement(rid) in {place, Placement.RELEASED}
    else:
        assert c.placement(rid) in row[type(event)]
