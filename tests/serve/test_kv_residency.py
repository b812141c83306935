"""Residency by KV events without Ray: real publishers and a real subscriber on 127.0.0.1.

A `PrefixCache` keyed as an engine keys it (``BlockHasher(page size, namespace=bytes)``)
publishes through a `KVEventPublisher`; `KVEventResidency` learns the endpoints from stats
shaped like a replica's ``record_routing_stats`` and answers the router. Every wait polls a
real condition with a deadline; nothing sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from prefixflight.core import LRU, BlockHasher, BurstConfig, PrefixCache, ReplicaLoad, UsageError
from prefixflight.serve.kv_events import KVEventPublisher, KVEventSubscriber, PublisherAddress
from prefixflight.serve.ray import (
    KV_ENDPOINT_KEYS,
    GenerateRequest,
    KVEventResidency,
    RoutingState,
)
from prefixflight.serve.ray._kv_residency import publisher_address

BS = 16  # the engine's default page size
LOOPBACK = "tcp://127.0.0.1:*"
LOADS = [ReplicaLoad(name=n) for n in ("a", "b", "c")]


def prompt(seed: int, n: int = 70) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 7) % 500 + 1 for i in range(n))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # a polling interval, not synchronisation: the condition decides


@contextmanager
def replica() -> Iterator[tuple[KVEventPublisher, PrefixCache]]:
    """A publisher and the prefix cache it follows, keyed as the engine's scheduler keys it."""
    pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    try:
        yield pub, PrefixCache(LRU(64), block_size=BS, event_sink=pub)
    finally:
        pub.close()


def stats(pub: KVEventPublisher) -> dict[str, Any]:
    """What ``EngineReplica.record_routing_stats`` reports about its publisher."""
    endpoint, replay = KV_ENDPOINT_KEYS
    return {"running": 0, endpoint: pub.endpoint, replay: pub.replay_endpoint}


def publish(pub: KVEventPublisher, cache: PrefixCache, ids: tuple[int, ...], ns: bytes) -> None:
    full = ids[: len(ids) // BS * BS]
    cache.publish(BlockHasher(BS, namespace=ns).hash_tokens(full), token_ids=full)
    pub.flush()


def test_the_router_routes_by_the_blocks_the_replicas_publish() -> None:
    ids, other = prompt(1), prompt(2)
    with replica() as (pa, ca), replica() as (pb, cb):
        publish(pa, ca, ids, b"t")  # before the router subscribes: replayed
        kv = KVEventResidency()
        try:
            state = RoutingState(BurstConfig(window_ms=10), residency=kv, engine_block_size=BS)
            assert state.residency is kv
            state.observe("a", stats(pa))
            state.observe("b", stats(pb))
            state.observe("c", {"running": 0})  # reports no publisher: not followed
            assert kv.replicas == ("a", "b")
            publish(pb, cb, other, b"t")  # after: live
            # the router hashes a str namespace, the engine bytes; the keys are the same
            blocks = state.engine_blocks(GenerateRequest(prompt_ids=ids, namespace="t"))
            blocks_b = state.engine_blocks(GenerateRequest(prompt_ids=other, namespace="t"))
            assert len(blocks) == 4
            wait_for(lambda: kv.prefix_blocks("a", blocks) == 4, "a's blocks")
            wait_for(lambda: kv.prefix_blocks("b", blocks_b) == 4, "b's blocks")
            assert kv.prefix_blocks("b", blocks) == 0
            # the same tokens in another tenant's namespace are other keys
            for ns in ("", "u"):
                elsewhere = state.engine_blocks(GenerateRequest(prompt_ids=ids, namespace=ns))
                assert kv.prefix_blocks("a", elsewhere) == 0
            # a lone request (no window affinity) goes where its prefix is resident
            shared = ids[:40] + prompt(3, 30)
            state.submit("lone", GenerateRequest(prompt_ids=shared, namespace="t"), 0.0, LOADS)
            state.tick(0.01, LOADS)
            assert state.decision("lone") == "a"
            # an eviction reaches the router: a holds only the first block now
            ca.remove(blocks[1])
            pa.flush()
            wait_for(lambda: kv.prefix_blocks("a", blocks) == 1, "a's eviction")
        finally:
            kv.close()


def test_a_dropped_replica_is_unfollowed_and_a_moved_one_starts_over() -> None:
    ids = prompt(4)
    with replica() as (pa, ca), replica() as (pa2, ca2):
        publish(pa, ca, ids, b"")
        kv = KVEventResidency()
        try:
            blocks = BlockHasher(BS).hash_tokens(ids)
            kv.observe("a", stats(pa))
            wait_for(lambda: kv.prefix_blocks("a", blocks) == 4, "a's blocks")
            kv.observe("a", stats(pa))  # the same address again: nothing changes
            assert kv.subscriber.publishers == {"a": publisher_address(stats(pa))}
            kv.observe("a", stats(pa2))  # a publisher restarted elsewhere: its index restarts
            wait_for(lambda: kv.prefix_blocks("a", blocks) == 0, "a's index restarting")
            wait_for(
                lambda: kv.subscriber.publishers.get("a") == publisher_address(stats(pa2)),
                "the new address",
            )
            publish(pa2, ca2, ids[:BS], b"")
            wait_for(lambda: kv.prefix_blocks("a", blocks) == 1, "a's new blocks")
            kv.drop_replica("a")
            assert kv.replicas == ()
            wait_for(lambda: not kv.subscriber.publishers, "a unfollowed")
            assert kv.prefix_blocks("a", blocks) == 0 and "a" not in kv.subscriber.feeds
            kv.drop_replica("a")  # unknown now: ignored
        finally:
            kv.close()
        kv.close()  # idempotent
        kv.observe("a", stats(pa))  # closed: ignored
        assert kv.replicas == ()
        with pytest.raises(UsageError, match="closed"):
            kv.subscriber.add_publisher("a", pa.endpoint)


def test_junk_endpoints_in_stats_are_ignored() -> None:
    assert publisher_address(None) is None
    assert publisher_address({"kv_endpoint": 5}) is None
    assert publisher_address({"kv_endpoint": "nowhere"}) is None
    assert publisher_address({"kv_endpoint": "tcp://h:1", "kv_replay_endpoint": 3}) == (
        PublisherAddress("tcp://h:1", None)
    )
    with pytest.raises(UsageError, match="KVEventSubscriber"):
        KVEventResidency(object())  # type: ignore[arg-type]


def test_an_unstarted_subscriber_adds_and_removes_publishers_at_once() -> None:
    ids = prompt(5)
    blocks = BlockHasher(BS).hash_tokens(ids)
    with replica() as (pub, cache), KVEventSubscriber({}) as sub:
        assert sub.poll(0.01) == 0  # nothing to follow: a bounded wait, no error
        publish(pub, cache, ids, b"")
        assert pub.drain(10.0)
        sub.add_publisher("r", PublisherAddress(pub.endpoint, pub.replay_endpoint))
        assert sub.feeds["r"].next_seq == 1  # caught up through the replay socket at once
        assert sub.index.prefix_blocks("r", blocks) == 4
        kv = KVEventResidency(sub)  # a given subscriber: driven and closed by its owner
        assert kv.replicas == ("r",) and kv.prefix_blocks("r", blocks) == 4
        kv.drop_replica("r")
        assert not sub.publishers and sub.index.prefix_blocks("r", blocks) == 0
        kv.close()
        assert sub.poll(0.0) == 0  # still open
        with pytest.raises(UsageError, match="non-empty"):
            sub.add_publisher("", pub.endpoint)
        with pytest.raises(UsageError, match="PublisherAddress"):
            sub.add_publisher("r", 5)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="non-empty"):
            sub.remove_publisher("")
        sub.remove_publisher("never-followed")


@pytest.mark.torch
def test_a_real_engine_replica_publishes_what_the_router_hashes() -> None:
    """An `EngineReplica` outside Serve (a real tiny engine): its stats name its publisher, and
    the router's engine blocks for a prompt are the keys its KV events carry."""
    pytest.importorskip("torch")
    import asyncio

    from prefixflight.serve.ray import EngineReplica, ModelSpec

    engine = EngineReplica(ModelSpec.tiny(), kv_events=True, report_blocks=0)
    kv = KVEventResidency()
    try:
        name = engine.name
        stats = asyncio.run(engine.record_routing_stats())
        assert stats["resident_blocks"] == []
        address = engine.kv_event_source()
        assert address is not None and address.endpoint.startswith("tcp://127.0.0.1:")
        assert publisher_address(stats) == address
        state = RoutingState(residency=kv, engine_block_size=BS)
        state.observe(name, stats)
        ids = prompt(6, 50)  # three full pages of 16 and a partial one
        req = GenerateRequest(prompt_ids=ids, max_tokens=2, namespace="tenant")
        result = asyncio.run(engine.generate(req))
        assert result.prompt_tokens == 50
        blocks = state.engine_blocks(req)
        assert len(blocks) == 3
        wait_for(lambda: kv.prefix_blocks(name, blocks) == 3, "the engine's blocks")
        other = state.engine_blocks(GenerateRequest(prompt_ids=ids))  # another namespace
        assert kv.prefix_blocks(name, other) == 0
    finally:
        kv.close()
        engine.close()
    engine.close()  # idempotent
    assert engine.kv_event_source() is None
    assert EngineReplica(ModelSpec.tiny()).kv_event_source() is None  # not asked to publish
