"""The Ray-free half of the Ray Serve integration, with plain objects (no Ray, no torch)."""

from __future__ import annotations

import attrs
import pytest

from prefixflight.core import BlockHasher, BurstConfig, ConfigError, ReplicaLoad, UsageError
from prefixflight.serve.ray import (
    BlockSetResidency,
    GenerateRequest,
    RoutingState,
    find_request,
    replica_load,
)

LOADS = [ReplicaLoad(name=n) for n in ("a", "b", "c")]


def prompt(seed: int, n: int = 70) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 7) % 500 + 1 for i in range(n))


def test_request_validation_names_the_value() -> None:
    with pytest.raises(UsageError, match="non-empty prompt"):
        GenerateRequest()
    with pytest.raises(UsageError, match="max_tokens must be an int >= 1, got 0"):
        GenerateRequest(prompt="hi", max_tokens=0)
    with pytest.raises(UsageError, match="got -3"):
        GenerateRequest(prompt_ids=[1, 2, -3])
    with pytest.raises(UsageError, match="got 'abc'"):
        GenerateRequest(prompt_ids="abc")
    r = GenerateRequest(prompt="héllo")
    assert r.route_tokens() == tuple("héllo".encode())
    assert GenerateRequest(prompt="x", prompt_ids=[5, 6]).route_tokens() == (5, 6)


def test_find_request_in_args_and_keywords() -> None:
    r = GenerateRequest(prompt_ids=(1, 2, 3), max_tokens=2)
    assert find_request([r], {}) is r
    assert find_request([], {"request": r}) is r
    assert find_request([], {"prompt_ids": [1, 2, 3], "max_tokens": 2}) == r
    assert find_request([], {"prompt": "", "max_tokens": 2}) is None  # invalid: no prompt
    assert find_request([1, "x"], {"other": 3}) is None  # another method's call


def test_replica_load_takes_the_freshest_running_count_and_ignores_junk() -> None:
    assert replica_load("r") == ReplicaLoad(name="r")
    load = replica_load(
        "r", {"running": 2, "waiting": 5, "kv_utilization": 0.25}, queue_len=4, in_flight=3
    )
    assert load == ReplicaLoad(name="r", running=4, waiting=5, kv_utilization=0.25)
    junk = {"running": "x", "waiting": True, "kv_utilization": float("nan")}
    assert replica_load("r", junk, in_flight=1) == ReplicaLoad(name="r", running=1)
    assert replica_load("r", {"kv_utilization": 3.0}).kv_utilization == 1.0


def test_a_burst_of_identical_prompts_waits_for_its_window_and_lands_together() -> None:
    state = RoutingState(BurstConfig(window_ms=100), seed=0)
    group = GenerateRequest(prompt_ids=prompt(1))
    other = GenerateRequest(prompt_ids=prompt(2))
    out: list[object] = []
    for i in range(8):
        out += state.submit(f"g{i}", group, 10.0 + i * 0.001, LOADS)
        out += state.submit(f"o{i}", other, 10.0 + i * 0.001, LOADS)
    assert not out and len(state.waiting) == 16
    assert state.deadline == pytest.approx(10.1)
    assert state.tick(10.05, LOADS) == ()
    sealed = state.tick(10.1, LOADS)
    assert len(sealed) == 16 and not state.waiting and state.deadline is None
    g = {state.decision(f"g{i}") for i in range(8)}
    o = {state.decision(f"o{i}") for i in range(8)}
    assert len(g) == 1 and len(o) == 1 and g != o  # co-located, and balanced apart
    state.consumed("g0")
    assert state.decision("g0") is None


def test_a_burst_that_straddles_two_windows_stays_on_one_replica() -> None:
    """The second window's samples follow the first window's, before any KV event, although
    the first window's replica is now the busier one (the fallback's record is ``known``)."""
    state = RoutingState(BurstConfig(window_ms=100), seed=0)
    group = GenerateRequest(prompt_ids=prompt(6))
    for i in range(5):
        state.submit(f"g{i}", group, 0.0, LOADS)
    state.tick(0.1, LOADS)
    (first,) = {state.decision(f"g{i}") for i in range(5)}
    busy = [attrs.evolve(x, running=5) if x.name == first else x for x in LOADS]
    for i in range(5, 8):
        state.submit(f"g{i}", group, 0.15, busy)
    state.tick(0.25, busy)
    assert {state.decision(f"g{i}") for i in range(5, 8)} == {first}


def test_text_prompts_are_keyed_by_their_bytes() -> None:
    state = RoutingState(BurstConfig(window_ms=50))
    a = state.route_request("1", GenerateRequest(prompt="same text"))
    b = state.route_request("2", GenerateRequest(prompt="same text"))
    c = state.route_request("3", GenerateRequest(prompt="same text", namespace="tenant-2"))
    assert a.blocks == b.blocks and a.blocks != c.blocks and a.num_tokens == 9


def test_rejected_submit_changes_nothing() -> None:
    state = RoutingState(BurstConfig(window_ms=100))
    r = GenerateRequest(prompt_ids=prompt(3))
    state.submit("x", r, 1.0, LOADS)
    with pytest.raises(UsageError, match="'x' is already waiting"):
        state.submit("x", r, 1.01, LOADS)
    with pytest.raises(UsageError, match="time went backwards"):
        state.submit("y", r, 0.5, LOADS)
    assert state.waiting == {"x"} and state.deadline == pytest.approx(1.1)
    (d,) = state.tick(1.1, LOADS)
    assert d.request_id == "x"


def test_a_dead_replica_is_dropped_and_its_unsent_decisions_withdrawn() -> None:
    state = RoutingState(BurstConfig(window_ms=10))
    r = GenerateRequest(prompt_ids=prompt(4))
    for i in range(4):
        state.submit(f"r{i}", r, 0.0, LOADS)
    state.tick(0.01, LOADS)
    dead = state.decision("r0")
    assert dead is not None
    assert set(state.drop_replica(dead)) == {f"r{i}" for i in range(4)}
    alive = [x for x in LOADS if x.name != dead]
    for i in range(4):  # the withdrawn requests are routed again, among the live replicas
        state.submit(f"r{i}", r, 0.02, alive)
    state.tick(0.03, alive)
    again = {state.decision(f"r{i}") for i in range(4)}
    assert len(again) == 1 and dead not in again


def test_residency_sends_a_lone_request_where_its_blocks_are() -> None:
    residency = BlockSetResidency()
    state = RoutingState(BurstConfig(window_ms=10), residency=residency, engine_block_size=16)
    ids = prompt(5, 80)
    blocks = BlockHasher(block_size=16).hash_tokens(ids)
    assert state.engine_blocks(GenerateRequest(prompt_ids=ids)) == blocks
    residency.stored("c", blocks[:3])
    state.submit("lone", GenerateRequest(prompt_ids=ids), 0.0, LOADS)
    state.tick(0.01, LOADS)
    assert state.decision("lone") == "c"
    assert residency.prefix_blocks("c", blocks) == 3
    residency.removed("c", blocks[1:2])
    assert residency.prefix_blocks("c", blocks) == 1
    state.drop_replica("c")
    assert residency.prefix_blocks("c", blocks) == 0 and residency.replicas == ()


def test_state_rejects_bad_configuration() -> None:
    with pytest.raises(ConfigError, match="fallback must be"):
        RoutingState(fallback="random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="engine_block_size must be >= 1, got 0"):
        RoutingState(engine_block_size=0)
    with pytest.raises(ConfigError, match="residency must be a PrefixIndex"):
        RoutingState(residency=object())  # type: ignore[arg-type]


def test_stats_residency_follows_the_replicas_reports() -> None:
    state = RoutingState(BurstConfig(window_ms=10), stats_residency=True)
    ids = prompt(6, 64)
    blocks = BlockHasher(block_size=16).hash_tokens(ids)
    state.observe("b", {"version": 1, "resident_blocks": list(blocks)})
    state.observe("a", {"running": 1})  # no snapshot: nothing learned
    state.submit("x", GenerateRequest(prompt_ids=ids), 0.0, LOADS)
    state.tick(0.01, LOADS)
    assert state.decision("x") == "b"
    state.observe("b", {"version": 1, "resident_blocks": []})  # the same report: ignored
    state.submit("y", GenerateRequest(prompt_ids=ids), 0.02, LOADS)
    state.tick(0.03, LOADS)
    assert state.decision("y") == "b"
    state.observe("b", {"version": 2, "resident_blocks": []})  # evicted since
    state.observe("c", {"version": 7, "resident_blocks": list(blocks[:1])})
    state.submit("z", GenerateRequest(prompt_ids=ids), 0.04, LOADS)
    state.tick(0.05, LOADS)
    assert state.decision("z") == "c"
    with pytest.raises(ConfigError, match="not both"):
        RoutingState(residency=BlockSetResidency(), stats_residency=True)
