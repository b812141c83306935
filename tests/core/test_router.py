"""BurstRouter: llm-d's sixteen assignment scenarios, config validation, window lifecycle."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from prefixflight.core import (
    BlockHash,
    BurstConfig,
    BurstRouter,
    ConfigError,
    ReplicaLoad,
    RouteRequest,
    UsageError,
)
from prefixflight.core.routing import NoAffinity, Placed, assign_batch

BS = 64


def reps(n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(name=f"pod{i + 1}") for i in range(n)]


class Batch:
    """Builds requests with explicit block hashes (as llm-d's tests do) and runs a batch."""

    def __init__(self) -> None:
        self.requests: list[RouteRequest] = []

    def group(self, n: int, blocks: Sequence[BlockHash]) -> list[int]:
        ids = []
        for _ in range(n):
            rid = len(self.requests)
            self.requests.append(
                RouteRequest(request_id=rid, blocks=tuple(blocks), num_tokens=len(blocks) * BS)
            )
            ids.append(rid)
        return ids

    def assign(self, n_replicas: int, **config: object) -> dict[int, str | None]:
        out = assign_batch(self.requests, reps(n_replicas), BurstConfig(**config))  # type: ignore[arg-type]
        assert [a.request_id for a in out] == [r.request_id for r in self.requests]
        return {int(a.request_id): (a.replica if isinstance(a, Placed) else None) for a in out}


def on(result: dict[int, str | None], ids: list[int]) -> set[str | None]:
    return {result[i] for i in ids}


def counts(result: dict[int, str | None]) -> Counter[str | None]:
    return Counter(result.values())


# -- the sixteen scenarios --------------------------------------------------------------------


def test_unlimited_group_colocates_whole() -> None:
    b = Batch()
    g = b.group(8, [1, 2, 3])
    r = b.assign(4)
    assert on(r, g) == {"pod1"}  # one replica: the least loaded, lowest name on ties


def test_cap_spreads_evenly() -> None:
    b = Batch()
    b.group(8, [1, 2, 3])
    r = b.assign(4, max_per_replica=2)
    assert sorted(counts(r).values()) == [2, 2, 2, 2]


def test_cap_fills_before_spilling() -> None:
    b = Batch()
    b.group(8, [1, 2, 3])
    r = b.assign(4, max_per_replica=4)
    assert sorted(counts(r).values()) == [4, 4]  # two replicas filled to k, two untouched


def test_singleton_gets_no_affinity() -> None:
    b = Batch()
    b.group(1, [1, 2, 3])
    assert b.assign(2) == {0: None}


def test_empty_prefix_gets_no_affinity() -> None:
    b = Batch()
    b.group(2, [])
    assert b.assign(2) == {0: None, 1: None}


def test_distinct_groups_spread_across_replicas() -> None:
    b = Batch()
    ga = b.group(8, [1, 2, 3])
    gb = b.group(8, [9, 9, 9])
    r = b.assign(4)
    assert len(on(r, ga)) == 1 and len(on(r, gb)) == 1
    assert on(r, ga) != on(r, gb)


def test_shared_prefix_families_colocate_within_fair_share() -> None:
    b = Batch()
    x1, x2 = b.group(2, [1, 2, 3]), b.group(2, [1, 2, 4])
    y1, y2 = b.group(2, [7, 8, 5]), b.group(2, [7, 8, 6])
    r = b.assign(2, min_colocate_blocks=2)
    assert len(on(r, x1 + x2)) == 1 and len(on(r, y1 + y2)) == 1
    assert on(r, x1) != on(r, y1)
    assert sorted(counts(r).values()) == [4, 4]


def test_many_groups_sharing_one_prefix_spread_without_stampede() -> None:
    b = Batch()
    gs = [b.group(2, [1, 2, n]) for n in (3, 4, 5, 6)]
    r = b.assign(4, min_colocate_blocks=2)
    assert all(len(on(r, g)) == 1 for g in gs)
    assert sorted(counts(r).values()) == [2, 2, 2, 2]


def test_shared_prefix_below_threshold_does_not_colocate() -> None:
    b = Batch()
    x1, x2 = b.group(2, [1, 2, 3]), b.group(2, [1, 2, 4])
    b.group(2, [7, 8, 5])
    b.group(2, [7, 8, 6])
    r = b.assign(2, min_colocate_blocks=3)
    assert on(r, x1) != on(r, x2)
    assert sorted(counts(r).values()) == [4, 4]


def test_singleton_attaches_to_overlapping_group_which_stays_whole() -> None:
    b = Batch()
    gx, sx = b.group(2, [1, 2, 3]), b.group(1, [1, 2, 8])
    gy, sy = b.group(2, [7, 8, 5]), b.group(1, [7, 8, 9])
    r = b.assign(2, min_colocate_blocks=2)
    assert len(on(r, gx)) == 1 and len(on(r, gy)) == 1
    assert on(r, sx) == on(r, gx) and on(r, sy) == on(r, gy)
    assert sorted(counts(r).values()) == [3, 3]


def test_lone_singleton_gets_no_affinity() -> None:
    b = Batch()
    g = b.group(2, [1, 2, 3])
    (lone,) = b.group(1, [5, 5, 5])
    r = b.assign(2, min_colocate_blocks=2)
    assert r[lone] is None
    assert len(on(r, g)) == 1 and None not in on(r, g)


def test_overlapping_singletons_colocate_without_groups() -> None:
    b = Batch()
    for n in (3, 4, 5, 6):
        b.group(1, [1, 2, n])
    r = b.assign(2, min_colocate_blocks=2)
    assert None not in r.values()
    assert sorted(counts(r).values()) == [2, 2]


def test_single_replica_places_everything() -> None:
    b = Batch()
    b.group(4, [1, 2, 3])
    b.group(4, [9, 9, 9])
    r = b.assign(1, min_colocate_blocks=2)
    assert set(r.values()) == {"pod1"}


def test_balance_by_tokens_spreads_a_large_prefix() -> None:
    def run(balance_by: str) -> tuple[set[str | None], set[str | None], set[str | None]]:
        b = Batch()
        long, s1, s2 = b.group(2, [1, 2, 3, 4]), b.group(2, [5]), b.group(2, [6])
        r = b.assign(2, balance_by=balance_by)
        return on(r, long), on(r, s1), on(r, s2)

    long, _, s2 = run("requests")
    assert long == s2  # by requests a short unit joins the long one: blocks unbalanced
    long, s1, s2 = run("tokens")
    assert long != s1 and s1 == s2  # by tokens the long unit stays alone


def test_balance_by_tokens_discounts_a_shared_prefix() -> None:
    b = Batch()
    shared = list(range(1, 10))
    units = [b.group(2, [*shared, tail]) for tail in (10, 11, 12)]
    r = b.assign(2, min_colocate_blocks=9, balance_by="tokens")
    assert len(on(r, units[0] + units[1] + units[2])) == 1  # prefilled once, on one replica


def test_overflow_guard_balances_beyond_the_cap() -> None:
    b = Batch()
    b.group(8, [1, 2, 3])
    r = b.assign(2, max_per_replica=2)
    assert None not in r.values()
    assert sorted(counts(r).values()) == [4, 4]


def test_overflow_guard_places_one_at_a_time() -> None:
    b = Batch()
    b.group(9, [1, 2, 3])
    r = b.assign(3, max_per_replica=2)  # 6 fill the cap, 3 overflow one per replica
    assert sorted(counts(r).values()) == [3, 3, 3]


# -- prefix-match info, ties, tokens ----------------------------------------------------------


def test_placed_carries_full_match_on_its_replica_only() -> None:
    b = Batch()
    b.group(2, [1, 2, 3])
    (a, _) = assign_batch(b.requests, reps(2), BurstConfig())
    assert isinstance(a, Placed)
    assert a.match_blocks(a.replica) == 3
    assert a.match_blocks("elsewhere") == 0


def test_running_requests_break_ties_then_names() -> None:
    b = Batch()
    g = b.group(2, [1, 2])
    loads = [
        ReplicaLoad(name="a", running=5),
        ReplicaLoad(name="b", running=1),
        ReplicaLoad(name="c", running=1),
    ]
    out = assign_batch(b.requests, loads, BurstConfig())
    assert {a.replica for a in out if isinstance(a, Placed)} == {"b"}
    assert len(g) == 2


def test_key_is_capped_at_the_match_limit() -> None:
    b = Batch()
    b.group(1, [1, 2, 3])
    b.group(1, [1, 2, 4])
    # Capped at two blocks, the two prompts are one identical group.
    r = b.assign(2, max_prefix_tokens_to_match=2 * BS)
    assert len(set(r.values())) == 1 and None not in r.values()


def test_router_hashes_prompts_with_the_partial_block() -> None:
    router = BurstRouter(BurstConfig(block_size=4), reps(2))
    short = router.request("a", [1, 2, 3])
    assert len(short.blocks) == 1  # shorter than one block, still keyed
    assert router.request("b", [1, 2, 3, 4, 5]).blocks[0] != short.blocks[0]


# -- config validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_ms", 0),
        ("window_ms", 10_001),
        ("window_ms", 1.5),
        ("max_per_replica", 0),
        ("max_per_replica", -2),
        ("block_size", 0),
        ("max_prefix_tokens_to_match", 63),
        ("max_prefix_tokens_to_match", -1),
        ("min_colocate_blocks", -1),
        ("max_batch_size", 0),
        ("max_batch_size", -5),
        ("balance_by", "bytes"),
        ("full_batch", "seal"),
        ("window_ms", True),
        ("window_ms", 10_001),
        ("max_batch_size", 1.5),
        ("lone_wait_ms", 0),
        ("lone_wait_ms", 101),
        ("lone_wait_ms", 2.5),
        ("lone_wait_ms", True),
        ("quiet_ms", 0),
        ("quiet_ms", 101),
        ("quiet_ms", 1.5),
    ],
)
def test_invalid_config_is_rejected_naming_the_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        BurstConfig(**{field: value})  # type: ignore[arg-type]
    assert field in str(info.value) and repr(value) in str(info.value)


def test_block_size_tokens_is_a_deprecated_name_of_block_size() -> None:
    with pytest.warns(DeprecationWarning, match="block_size_tokens is now block_size") as seen:
        old = BurstConfig(block_size_tokens=32)  # type: ignore[call-arg]  # hidden from type checkers
    assert seen[0].filename == __file__  # the warning points at the caller
    assert old == BurstConfig(block_size=32)
    with pytest.warns(DeprecationWarning, match="block_size_tokens is now block_size"):
        assert old.block_size_tokens == 32  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning):  # both names, agreeing
        same = BurstConfig(block_size=8, block_size_tokens=8)  # type: ignore[call-arg]
    assert same == BurstConfig(block_size=8)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="block_size=8"):
        BurstConfig(block_size=8, block_size_tokens=16)  # type: ignore[call-arg]


def test_valid_config_edges() -> None:
    BurstConfig(window_ms=1, max_per_replica=1, max_batch_size=1, max_prefix_tokens_to_match=64)
    BurstConfig(window_ms=10_000, max_per_replica=-1, max_batch_size=-1, balance_by="tokens")
    assert BurstConfig().max_prefix_blocks == 2048
    assert BurstConfig(max_prefix_tokens_to_match=200).max_prefix_blocks == 3


def test_router_needs_unique_replicas() -> None:
    with pytest.raises(ConfigError, match="at least one replica"):
        BurstRouter(BurstConfig(), [])
    with pytest.raises(ConfigError, match="'x'"):
        BurstRouter(BurstConfig(), [ReplicaLoad(name="x"), ReplicaLoad(name="x")])


# -- window lifecycle -------------------------------------------------------------------------


def req(rid: int | str, blocks: Sequence[BlockHash] = (1, 2)) -> RouteRequest:
    return RouteRequest(request_id=rid, blocks=tuple(blocks), num_tokens=len(blocks) * BS)


def snapshot(r: BurstRouter) -> tuple[object, ...]:
    return (r.pending, r.deadline, r.now, r.replicas)


def test_window_seals_at_deadline_and_a_second_window_opens_after() -> None:
    r = BurstRouter(BurstConfig(window_ms=100), reps(4))
    assert r.arrive(req(1), 0.0) == ()
    assert r.deadline == pytest.approx(0.1)
    assert r.arrive(req(2), 0.05) == ()
    assert r.tick(0.099) == ()
    first = r.tick(0.1)
    assert [a.request_id for a in first] == [1, 2]
    assert len({a.replica for a in first if isinstance(a, Placed)}) == 1
    assert r.deadline is None and r.pending == ()
    assert r.arrive(req(3), 0.2) == ()
    assert r.deadline == pytest.approx(0.3)
    (only,) = r.tick(0.31)
    assert isinstance(only, NoAffinity) and only.request_id == 3
    r.check_invariants()


def test_quiet_seal_places_a_burst_once_it_stops_arriving() -> None:
    r = BurstRouter(BurstConfig(window_ms=100, quiet_ms=5), reps(2))
    for i, t in enumerate((0.0, 0.002, 0.004)):
        assert r.arrive(req(i), t) == ()
        assert r.deadline == pytest.approx(t + 0.005)  # each arrival moves the seal later
    assert r.tick(0.0089) == ()
    sealed = r.tick(0.0091)
    assert [a.request_id for a in sealed] == [0, 1, 2]
    assert len({a.replica for a in sealed if isinstance(a, Placed)}) == 1
    r.check_invariants()


def test_quiet_seal_never_outlasts_the_window() -> None:
    r = BurstRouter(BurstConfig(window_ms=20, quiet_ms=5), reps(2))
    for i in range(5):  # one arrival every 4 ms: never quiet for 5 ms
        assert r.arrive(req(i), i * 0.004) == ()
    assert r.deadline == pytest.approx(0.02)  # min(0 + 20 ms, 16 ms + 5 ms)
    assert [a.request_id for a in r.tick(0.02)] == [0, 1, 2, 3, 4] and r.pending == ()


def test_adaptive_window_releases_a_lone_request_after_its_wait() -> None:
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10), reps(2))
    assert r.arrive(req(1, (1, 2)), 0.0) == ()
    assert r.deadline == pytest.approx(0.1) and r.wake_at == pytest.approx(0.01)
    assert r.tick(0.009) == ()
    assert r.tick(0.01) == (NoAffinity(request_id=1),)
    assert r.pending == () and r.deadline is None and r.wake_at is None
    r.check_invariants()


def test_adaptive_window_keeps_a_burst_together_until_the_seal() -> None:
    """Samples arriving within the lone wait share their key: none is released early."""
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10), reps(2))
    for i in range(4):
        assert r.arrive(req(i, (7, 8)), 0.002 * i) == ()
    r.arrive(req("lone", (9,)), 0.02)
    assert r.wake_at == pytest.approx(0.03)  # the lone one's release, before the seal
    assert r.tick(0.05) == (NoAffinity(request_id="lone"),)
    assert r.wake_at == pytest.approx(0.1)
    sealed = r.tick(0.1)
    assert [a.request_id for a in sealed] == [0, 1, 2, 3]
    assert len({a.replica for a in sealed if isinstance(a, Placed)}) == 1
    r.check_invariants()


def test_adaptive_window_releases_a_first_sample_whose_peers_come_late() -> None:
    """The trade-off: a sample arriving after its group's first one waited out the lone
    wait does not pull it back; the rest of the group still co-locates."""
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10), reps(2))
    r.arrive(req(0, (7, 8)), 0.0)
    assert r.arrive(req(1, (7, 8)), 0.02) == (NoAffinity(request_id=0),)
    r.arrive(req(2, (7, 8)), 0.021)
    assert r.wake_at == pytest.approx(0.12)  # the release emptied the window: 1 opened anew
    assert [a.request_id for a in r.tick(0.121) if isinstance(a, Placed)] == [1, 2]


def test_adaptive_window_shares_by_leading_blocks_with_min_colocate_blocks() -> None:
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10, min_colocate_blocks=2), reps(2))
    r.arrive(req("a", (1, 2, 3)), 0.0)
    r.arrive(req("b", (1, 2, 4)), 0.001)  # shares two leading blocks with a
    r.arrive(req("c", (1, 5)), 0.002)  # shares one: lone
    assert r.tick(0.05) == (NoAffinity(request_id="c"),)
    assert r.pending == ("a", "b")


def test_adaptive_window_cancel_turns_a_request_lone() -> None:
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10), reps(2))
    r.arrive(req(0, (7,)), 0.0)
    r.arrive(req(1, (7,)), 0.001)
    assert r.tick(0.05) == ()
    r.cancel(1)  # 0 shares with nobody now, and its wait is over
    assert r.wake_at == pytest.approx(0.01)
    r.check_invariants()
    assert r.tick(0.05) == (NoAffinity(request_id=0),)
    assert r.deadline is None


def test_adaptive_window_an_id_released_may_arrive_again() -> None:
    r = BurstRouter(BurstConfig(window_ms=100, lone_wait_ms=10), reps(2))
    r.arrive(req(0, (7,)), 0.0)
    r.arrive(req(1, (7,)), 0.0)
    r.cancel(1)
    with pytest.raises(UsageError, match="already waiting"):
        r.arrive(req(0, (3,)), 0.005)  # its wait is not over
    assert r.arrive(req(0, (3,)), 0.01) == (NoAffinity(request_id=0),)
    assert r.pending == (0,)


def test_late_arrival_seals_the_open_batch_and_opens_a_new_one() -> None:
    r = BurstRouter(BurstConfig(window_ms=100), reps(2))
    r.arrive(req(1), 0.0)
    r.arrive(req(2), 0.01)
    sealed = r.arrive(req(3), 0.1)
    assert [a.request_id for a in sealed] == [1, 2]
    assert r.pending == (3,) and r.deadline == pytest.approx(0.2)
    r.check_invariants()


def test_cancelled_request_is_dropped_from_the_batch() -> None:
    r = BurstRouter(BurstConfig(), reps(2))
    r.arrive(req(1), 0.0)
    r.arrive(req(2), 0.0)
    r.arrive(req(3), 0.0)
    r.cancel(2)
    assert r.pending == (1, 3)
    assert [a.request_id for a in r.tick(1.0)] == [1, 3]


def test_cancelling_every_request_closes_the_window() -> None:
    r = BurstRouter(BurstConfig(), reps(2))
    r.arrive(req(1), 0.0)
    r.cancel(1)
    assert r.deadline is None and r.tick(5.0) == ()
    r.check_invariants()


def test_a_full_batch_answers_no_affinity_and_seals_on_the_timer() -> None:
    """As llm-d: an arrival at a full batch gets "batch full" (NoAffinity, left to the
    fallback) and is not added; the batch still seals only at its deadline."""
    r = BurstRouter(BurstConfig(max_batch_size=3, window_ms=100), reps(2))
    assert r.arrive(req(1), 0.0) == ()
    assert r.arrive(req(2), 0.0) == ()
    assert r.arrive(req(3), 0.001) == ()  # full now, but not sealed
    assert r.pending == (1, 2, 3) and r.deadline == pytest.approx(0.1)
    assert r.arrive(req(4), 0.002) == (NoAffinity(request_id=4),)
    assert r.pending == (1, 2, 3) and r.deadline == pytest.approx(0.1)
    r.check_invariants()
    assert r.tick(0.05) == ()
    sealed = r.tick(0.1)
    assert [a.request_id for a in sealed] == [1, 2, 3]
    assert all(isinstance(a, Placed) for a in sealed)  # one identical group, co-located
    # a late arrival seals the full batch first, then opens a new window
    for i in (5, 6, 7):
        r.arrive(req(i), 0.2)
    out = r.arrive(req(8), 0.35)
    assert [a.request_id for a in out] == [5, 6, 7]
    assert list(r.pending) == [8]


def test_full_batch_seal_early_option_seals_with_the_last_arrival() -> None:
    """The opt-in prefixflight extension: the arrival that fills the batch seals it."""
    r = BurstRouter(BurstConfig(max_batch_size=3, full_batch="seal_early"), reps(2))
    assert r.arrive(req(1), 0.0) == ()
    assert r.arrive(req(2), 0.0) == ()
    sealed = r.arrive(req(3), 0.001)
    assert [a.request_id for a in sealed] == [1, 2, 3]
    assert r.deadline is None
    assert r.arrive(req(4), 0.002) == () and r.pending == (4,)
    r.check_invariants()


def test_cancel_frees_a_slot_of_a_full_batch() -> None:
    """Documented deviation from llm-d (which keeps a cancelled entry in its batch): here a
    cancelled request leaves the batch, so it no longer counts toward max_batch_size."""
    r = BurstRouter(BurstConfig(max_batch_size=2), reps(2))
    r.arrive(req(1), 0.0)
    r.arrive(req(2), 0.0)
    r.cancel(1)
    assert r.arrive(req(3), 0.01) == () and r.pending == (2, 3)
    assert [a.request_id for a in r.tick(0.1)] == [2, 3]


def test_rejected_events_leave_the_state_unchanged() -> None:
    r = BurstRouter(BurstConfig(), reps(2))
    r.arrive(req(1), 1.0)
    before = snapshot(r)
    with pytest.raises(UsageError, match="backwards"):
        r.arrive(req(2), 0.5)
    with pytest.raises(UsageError, match="backwards"):
        r.tick(0.9)
    with pytest.raises(UsageError, match="already waiting"):
        r.arrive(req(1), 1.01)
    with pytest.raises(UsageError, match="'nope'"):
        r.cancel("nope")
    with pytest.raises(UsageError, match="nan"):
        r.tick(float("nan"))
    with pytest.raises(UsageError, match="finite"):
        r.arrive(req(2), float("inf"))
    with pytest.raises(UsageError, match="finite"):
        r.tick(float("inf"))
    with pytest.raises(UsageError, match="duplicate replica"):
        r.update_replicas([ReplicaLoad(name="a"), ReplicaLoad(name="a")])
    assert snapshot(r) == before
    r.check_invariants()


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": 1, "blocks": ([1], [2]), "num_tokens": 8},
        {"request_id": 1, "blocks": 5, "num_tokens": 8},
        {"request_id": 1, "blocks": "ab", "num_tokens": 8},
        {"request_id": 1.5, "blocks": (), "num_tokens": 0},
        {"request_id": 1, "blocks": (), "num_tokens": -1},
        {"request_id": 1, "blocks": (), "num_tokens": "8"},
    ],
    ids=["unhashable", "blocks-int", "blocks-str", "id-float", "tokens-negative", "tokens-str"],
)
def test_route_request_rejects_bad_fields_before_any_router_sees_them(
    fields: dict[str, object],
) -> None:
    """An unhashable block hash used to be accepted into the window and to fail at the seal,
    after the batch had been cleared: the whole batch was lost."""
    with pytest.raises(UsageError):
        RouteRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [{"name": ""}, {"name": "a", "running": -1}, {"name": "a", "kv_utilization": float("nan")}],
)
def test_replica_load_rejects_bad_fields(fields: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        ReplicaLoad(**fields)  # type: ignore[arg-type]


def test_replica_loads_are_read_when_the_batch_seals() -> None:
    r = BurstRouter(BurstConfig(), reps(2))
    r.arrive(req(1), 0.0)
    r.arrive(req(2), 0.0)
    r.update_replicas([ReplicaLoad(name="pod1", running=9), ReplicaLoad(name="pod2")])
    assert {a.replica for a in r.tick(1.0) if isinstance(a, Placed)} == {"pod2"}
