"""Block indexes fed by KV events, the feed's seq bookkeeping, and a router reading an index.

No sockets: events go in as values.
"""

from __future__ import annotations

import pytest

from prefixflight.core import (
    LRU,
    BlockHasher,
    PrefixCache,
    ReplicaLoad,
    RouteRequest,
    UsageError,
)
from prefixflight.core.cache import KVEvent
from prefixflight.core.routing import ApproxPrefixConfig, ApproxPrefixRouter
from prefixflight.serve.kv_events import (
    ClusterBlockIndex,
    ReplicaBlockIndex,
    ReplicaFeed,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    fold_hash,
    wire_events,
)

BS = 4


def _stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str | None = None
) -> WireBlockStored:
    return WireBlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=BS,
        medium=medium,
    )


def test_an_index_on_the_publishers_hashes_follows_stores_removals_and_clears() -> None:
    idx = ReplicaBlockIndex("r")
    idx.apply(_stored([11, 12], None, list(range(8))))
    assert idx.keys() == {11, 12}
    assert idx.prefix_blocks([11, 12, 13]) == 2
    assert idx.prefix_blocks([12]) == 1 and idx.prefix_blocks([13, 11]) == 0
    idx.apply(WireBlockRemoved(block_hashes=(12, 99)))
    assert idx.keys() == {11}
    assert idx.stats.removed == 1 and idx.stats.unknown_removed == 1
    idx.apply(WireAllBlocksCleared())
    assert len(idx) == 0 and idx.stats.cleared == 1


def test_a_block_stays_resident_while_some_medium_holds_it() -> None:
    idx = ReplicaBlockIndex("r")
    idx.apply(_stored([1], None, [0] * BS, medium="GPU"))
    idx.apply(_stored([1], None, [0] * BS, medium="CPU"))
    idx.apply(WireBlockRemoved(block_hashes=(1,), medium="GPU"))
    assert idx.media(1) == {"CPU"} and 1 in idx
    idx.apply(WireBlockRemoved(block_hashes=(1,), medium="CPU"))
    assert 1 not in idx


@pytest.mark.parametrize("rebuild", [False, True], ids=["publisher-hashes", "rebuilt-keys"])
def test_a_block_cached_twice_stays_resident_until_its_last_copy_is_removed(
    rebuild: bool,
) -> None:
    """vLLM caches a block twice when two requests compute it, and reports each copy's store
    and removal: the first removal leaves the other copy serving hits."""
    idx = ReplicaBlockIndex("r", hasher=BlockHasher(block_size=BS) if rebuild else None)
    for _ in range(2):
        idx.apply(_stored([7], None, [5] * BS))
    (key,) = idx.keys()
    idx.apply(WireBlockRemoved(block_hashes=(7,)))
    assert idx.keys() == {key} and idx.stats.removed == 1
    idx.apply(WireBlockRemoved(block_hashes=(7,)))
    assert len(idx) == 0 and idx.stats.removed == 2
    idx.apply(WireBlockRemoved(block_hashes=(7,)))
    assert idx.stats.unknown_removed == 1


def test_sha256_digests_and_their_int_form_are_the_same_key() -> None:
    (digest,) = BlockHasher(block_size=BS).hash_tokens([1, 2, 3, 4])
    idx = ReplicaBlockIndex("r")
    idx.apply(_stored([fold_hash(digest)], None, [1, 2, 3, 4]))
    assert digest in idx and idx.prefix_blocks([digest]) == 1


def test_rebuilding_keys_from_tokens_follows_a_publisher_with_an_unknown_seed() -> None:
    theirs = BlockHasher(block_size=BS, namespace="vllm-with-a-secret-seed")
    ours = BlockHasher(block_size=BS, namespace="router")
    system = list(range(100, 108))  # two shared blocks
    a, b = [*system, 1, 2, 3, 4], [*system, 5, 6, 7, 8]
    events: list[KVEvent] = []
    cache = PrefixCache(LRU(3), block_size=BS, event_sink=events.append)
    cache.publish(theirs.hash_tokens(a), token_ids=a)
    # b's first two blocks are resident: only its last block is stored (parent: a's block 1),
    # and LRU(3) evicts a's last block for it
    cache.publish(theirs.hash_tokens(b), token_ids=b)
    idx = ReplicaBlockIndex("vllm-0", hasher=ours)
    idx.apply_batch(WireBatch(ts=0.0, events=wire_events(events)))
    want = {fold_hash(k) for k in ours.hash_tokens(b)}
    assert idx.keys() == want
    assert idx.prefix_blocks(ours.hash_tokens(b)) == 3
    assert idx.prefix_blocks(ours.hash_tokens(a)) == 2
    assert idx.stats.unresolved == 0


def test_a_child_of_an_evicted_parent_is_keyed_through_the_ghosts() -> None:
    ours = BlockHasher(block_size=BS)
    toks = list(range(8))
    k0, k1 = ours.hash_tokens(toks)
    idx = ReplicaBlockIndex("r", hasher=ours)
    idx.apply(_stored([500], None, toks[:4]))
    idx.apply(WireBlockRemoved(block_hashes=(500,)))
    idx.apply(_stored([501], 500, toks[4:]))
    assert idx.keys() == {fold_hash(k1)}
    no_ghosts = ReplicaBlockIndex("r", hasher=ours, ghost_capacity=0)
    no_ghosts.apply(_stored([500], None, toks[:4]))
    no_ghosts.apply(WireBlockRemoved(block_hashes=(500,)))
    no_ghosts.apply(_stored([501], 500, toks[4:]))
    assert len(no_ghosts) == 0 and no_ghosts.stats.unresolved == 1
    assert k0 not in idx


@pytest.mark.parametrize(
    "event",
    [
        _stored([1], 999, [0] * BS),  # unknown parent
        WireBlockStored(
            block_hashes=(1,), parent_block_hash=None, token_ids=(0,) * 8, block_size=8
        ),
        _stored([1], None, []),  # no tokens
        # vLLM hashed a cache salt into the first block: its key is not the tokens' alone
        WireBlockStored(
            block_hashes=(1,),
            parent_block_hash=None,
            token_ids=(0,) * BS,
            block_size=BS,
            extra_keys=(("tenant-salt",),),
        ),
    ],
)
def test_blocks_that_cannot_be_rebuilt_are_counted_not_guessed(event: WireBlockStored) -> None:
    idx = ReplicaBlockIndex("r", hasher=BlockHasher(block_size=BS))
    idx.apply(event)
    assert len(idx) == 0 and idx.stats.unresolved == 1


def test_the_feed_applies_in_order_and_reports_gaps_duplicates_and_restarts() -> None:
    feed = ReplicaFeed(ReplicaBlockIndex("r"))

    def batch(h: int) -> WireBatch:
        return WireBatch(ts=0.0, events=(_stored([h], None, [0] * BS),))

    assert feed.observe_live(0) is None and feed.accept(0, batch(10))
    assert feed.observe_live(3) == 1  # 1 and 2 are missing: replay from 1
    assert feed.accept(1, batch(11)) and feed.accept(2, batch(12)) and feed.accept(3, batch(13))
    assert not feed.accept(3, batch(13))  # already applied (a replay overlapping the stream)
    assert feed.next_seq == 4 and feed.lost == 0
    assert feed.observe_live(6) == 4
    assert feed.accept(6, batch(16))  # the replay could not provide 4 and 5
    assert feed.lost == 2 and feed.index.keys() == {10, 11, 12, 13, 16}
    assert feed.observe_live(0) is None  # numbering went back: the publisher restarted
    assert feed.restarts == 1 and len(feed.index) == 0
    assert feed.accept(0, batch(20)) and feed.index.keys() == {20}
    with pytest.raises(UsageError, match="-1"):
        feed.accept(-1, batch(1))


def test_approx_prefix_router_reads_an_external_index() -> None:
    hasher = BlockHasher(block_size=BS)
    prompt = list(range(16))
    blocks = hasher.hash_tokens(prompt)
    cluster = ClusterBlockIndex()
    cluster.apply_batch(
        "b", WireBatch(ts=0.0, events=(_stored([fold_hash(h) for h in blocks], None, prompt),))
    )
    router = ApproxPrefixRouter(ApproxPrefixConfig(), index=cluster)
    replicas = [ReplicaLoad(name="a"), ReplicaLoad(name="b"), ReplicaLoad(name="c")]
    req = RouteRequest(request_id=1, blocks=blocks, num_tokens=len(prompt))
    assert router.prefix_blocks("b", blocks) == 4 and router.prefix_blocks("a", blocks) == 0
    (first,) = router.route(req, 0.0, replicas)
    assert first.replica == "b"
    # nothing is assumed about "b": the index alone says what is cached
    other = RouteRequest(request_id=2, blocks=hasher.hash_tokens([7] * 16), num_tokens=16)
    router.route(other, 1.0, replicas)
    assert all(router.prefix_blocks(r.name, other.blocks) == 0 for r in replicas)
    # without an index the router keeps assuming, as before
    assuming = ApproxPrefixRouter(ApproxPrefixConfig())
    (d,) = assuming.route(other, 0.0, replicas)
    assert assuming.prefix_blocks(d.replica, other.blocks) == 4


def test_the_public_surface_is_what_all_says() -> None:
    import prefixflight.serve.kv_events as mod

    exported = list(mod.__all__)
    assert exported == sorted(exported, key=lambda s: (not s.isupper(), s))
    for name in exported:
        assert hasattr(mod, name), name


def test_a_scheduler_publishing_deepest_first_goes_out_parents_first() -> None:
    """The scheduler publishes a request's blocks deepest first (so a parent is evicted after
    its children); on the wire every parent still comes before its children, merged into one
    ``BlockStored`` per chain as vLLM sends, and a token-rebuilding index follows it."""
    from prefixflight.core import Scheduler, SchedulerConfig, StepResult

    events: list[KVEvent] = []
    config = SchedulerConfig(num_pages=16, block_size=BS, max_batch_tokens=64, max_running=4)
    sched = Scheduler(config, cache=PrefixCache(LRU(16), BS, event_sink=events.append))
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    sched.add_request("r", prompt, max_new_tokens=1, now=0.0)
    plan = sched.schedule(0.0)
    sched.complete_step(StepResult(step=plan.step, sampled=(("r", 7),)), 0.0)
    assert len(events) == 3, events  # one BlockStored per block, deepest first
    wire = wire_events(events)
    stored = [e for e in wire if isinstance(e, WireBlockStored)]
    assert len(stored) == 1, stored
    hashes = BlockHasher(block_size=BS).hash_tokens(prompt)
    assert list(stored[0].block_hashes) == [fold_hash(h) for h in hashes]
    assert stored[0].parent_block_hash is None
    assert list(stored[0].token_ids) == prompt[: 3 * BS]
    idx = ReplicaBlockIndex("r0", hasher=BlockHasher(block_size=BS, namespace="other"))
    idx.apply_batch(WireBatch(ts=0.0, events=wire))
    assert idx.stats.unresolved == 0
    assert len(idx.keys()) == 3


@pytest.mark.parametrize("rebuild", [False, True], ids=["publisher-hashes", "rebuilt-keys"])
def test_an_index_holds_at_most_max_blocks_forgetting_the_first_stored(rebuild: bool) -> None:
    hasher = BlockHasher(block_size=BS) if rebuild else None
    idx = ReplicaBlockIndex("r", hasher=hasher, max_blocks=3)
    for h in range(1, 6):  # five unrelated one-block stores
        idx.apply(_stored([h], None, [h] * BS))
    assert len(idx) == 3 and idx.stats.evicted == 2 and idx.stats.stored == 5
    first = fold_hash(hasher.hash_tokens([1] * BS)[0]) if hasher else 1
    last = fold_hash(hasher.hash_tokens([5] * BS)[0]) if hasher else 5
    held = idx.keys()
    assert first not in held and last in held
    big = ReplicaBlockIndex("r", hasher=hasher, max_blocks=10)
    big.apply(_stored(list(range(100, 150)), None, [7] * (50 * BS)))  # one event, 50 blocks
    assert len(big) == 10 and big.stats.evicted == 40
    with pytest.raises(UsageError, match="max_blocks must be an int >= 1, got 0"):
        ReplicaBlockIndex("r", max_blocks=0)
