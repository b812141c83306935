"""KV events over real ZMQ sockets on 127.0.0.1: publish, follow, replay, and a property test.

Publishers bind ``tcp://127.0.0.1:*`` (a free port chosen by the OS, read back from the
socket). Every wait polls a real condition with a deadline; nothing sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from prefixflight.core import (
    LRU,
    S3FIFO,
    AllBlocksCleared,
    BlockHash,
    BlockHasher,
    PrefixCache,
)
from prefixflight.serve.kv_events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    WireBlockStored,
    decode_batch,
    fold_hash,
    kv_topic,
)

BS = 4
LOOPBACK = "tcp://127.0.0.1:*"


@contextmanager
def _publisher(**kw: object) -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, **kw)  # type: ignore[arg-type]
    try:
        yield pub
    finally:
        pub.close()


def _address(pub: KVEventPublisher, *, replay: bool = True) -> PublisherAddress:
    return PublisherAddress(pub.endpoint, pub.replay_endpoint if replay else None)


def _wait(
    cond: Callable[[], bool], step: Callable[[], object], what: str, timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        step()


def _sync(sub: KVEventSubscriber, pub: KVEventPublisher, replica: str) -> None:
    """Wait until ``sub`` applied every batch ``pub`` has sent."""
    assert pub.drain(10.0)
    target = pub.next_seq
    feed = sub.feeds[replica]

    def step() -> None:
        if sub.poll(0.05) == 0:
            sub.catch_up(replica)  # a late joiner learns what it missed only by asking

    _wait(lambda: feed.next_seq >= target, step, f"{replica} to reach seq {target}")


def test_frames_are_topic_seq_and_a_vllm_batch() -> None:
    import zmq

    hasher = BlockHasher(block_size=BS, namespace="m")
    topic = kv_topic("pod-a", "smollm2")
    with _publisher(topic=topic) as pub:
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.endpoint)
        try:
            cache = PrefixCache(LRU(8), block_size=BS, event_sink=pub)
            toks = list(range(8))
            frames: list[bytes] = []

            def step() -> None:  # publish until the slow-joining SUB sees one
                nonlocal frames
                cache.clear()
                cache.publish(hasher.hash_tokens(toks), token_ids=toks)
                pub.flush()
                if sub.poll(50):
                    frames = sub.recv_multipart()

            _wait(lambda: bool(frames), step, "a live message")
        finally:
            sub.close(linger=0)
    t, seq, payload = frames
    assert t == topic.encode()
    assert len(seq) == 8 and int.from_bytes(seq, "big") < pub.next_seq
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, dp rank]
    events = decode_batch(payload).events
    stored = [e for e in events if isinstance(e, WireBlockStored)]
    # one BlockStored per request: the chain of two blocks, parent first
    assert [list(e.block_hashes) for e in stored] == [
        [fold_hash(h) for h in hasher.hash_tokens(toks)]
    ]
    assert stored[0].token_ids == tuple(toks) and stored[0].medium == "GPU"


def test_a_late_subscriber_recovers_through_the_replay_socket() -> None:
    hasher = BlockHasher(block_size=BS)
    prompts = [[i] * (2 * BS) for i in range(5)]
    with _publisher(topic=kv_topic("p", "m")) as pub:
        cache = PrefixCache(LRU(64), block_size=BS, event_sink=pub)
        for p in prompts:  # five batches before anyone listens
            cache.publish(hasher.hash_tokens(p), token_ids=p)
            pub.flush()
        assert pub.drain(10.0) and pub.next_seq == 5
        with KVEventSubscriber({"r": _address(pub)}) as sub:
            late = [9] * (2 * BS)
            cache.publish(hasher.hash_tokens(late), token_ids=late)
            _sync(sub, pub, "r")
            idx = sub.index.replica("r")
            want = {fold_hash(h) for p in [*prompts, late] for h in hasher.hash_tokens(p)}
            assert idx.keys() == want
            assert sub.feeds["r"].lost == 0 and sub.errors == 0
            assert sub.pod_and_model("r") == ("p", "m")


class _Dropping(KVEventSubscriber):
    """Loses the live messages whose seq is in ``drop`` (once each), as a congested network
    or a full receive queue would."""

    def __init__(self, publishers: dict[str, PublisherAddress], *, drop: set[int]) -> None:
        super().__init__(publishers)
        self.drop = drop

    def _on_live(self, name: str, frames: list[bytes]) -> int:
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.drop.discard(seq)
            return 0
        return super()._on_live(name, frames)


@pytest.mark.parametrize("replay", [True, False])
def test_a_seq_gap_is_filled_by_replay(replay: bool) -> None:
    hasher = BlockHasher(block_size=BS)
    with _publisher() as pub:
        cache = PrefixCache(LRU(64), block_size=BS, event_sink=pub)
        sub = _Dropping({"r": _address(pub, replay=replay)}, drop=set())
        try:
            # make sure the subscription is live before the batches that matter
            def warm_up() -> None:
                pub(AllBlocksCleared())
                pub.flush()
                sub.poll(0.05)

            _wait(lambda: sub.feeds["r"].next_seq > 0, warm_up, "the first live batch")
            base = pub.next_seq
            lost_before = sub.feeds["r"].lost  # slow-joiner losses, without replay
            sub.drop = {base + 1, base + 2}
            prompts = [[i] * BS for i in range(1, 6)]
            for p in prompts:
                cache.publish(hasher.hash_tokens(p), token_ids=p)
                pub.flush()
            assert pub.drain(10.0)
            target = pub.next_seq
            _wait(
                lambda: sub.feeds["r"].next_seq >= target, lambda: sub.poll(0.05), "the end"
            )
            keys = sub.index.replica("r").keys()
            dropped = {fold_hash(hasher.hash_tokens(p)[0]) for p in prompts[1:3]}
            if replay:
                assert dropped <= keys and sub.feeds["r"].lost == 0
            else:
                assert not dropped & keys and sub.feeds["r"].lost - lost_before == 2
        finally:
            sub.close()


# -- the property: an index following a publisher equals the publisher's resident set -------

SHARED = list(range(1000, 1000 + 2 * BS))


def _prompt(family: int, blocks: int) -> list[int]:
    return [*SHARED, *(family * 100 + i for i in range(4 * BS))][: blocks * BS]


_op = st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("evict"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("check"), st.just(0), st.just(0)),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    policy=st.sampled_from(["lru", "s3fifo"]),
    capacity=st.integers(2, 16),
    ops=st.lists(_op, min_size=150, max_size=300),
)
def test_an_index_following_a_publisher_equals_its_resident_set(
    policy: str, capacity: int, ops: list[tuple[str, int, int]]
) -> None:
    engine = BlockHasher(block_size=BS, namespace="engine-seed")
    router = BlockHasher(block_size=BS, namespace="router")  # rebuilds keys from tokens
    pol = LRU(capacity) if policy == "lru" else S3FIFO(capacity)
    seen: dict[BlockHash, BlockHash] = {}  # engine key -> router key
    with _publisher() as pub:
        cache = PrefixCache(pol, block_size=BS, event_sink=pub)
        addr = {"r": _address(pub)}
        with KVEventSubscriber(addr) as plain, KVEventSubscriber(addr, hasher=router) as rebuilt:

            def check() -> None:
                _sync(plain, pub, "r")
                _sync(rebuilt, pub, "r")
                resident = [b for b in seen if b in cache]
                assert plain.index.replica("r").keys() == {fold_hash(b) for b in resident}
                assert rebuilt.index.replica("r").keys() == {
                    fold_hash(seen[b]) for b in resident
                }
                for sub in (plain, rebuilt):
                    assert sub.feeds["r"].lost == 0 and sub.errors == 0

            for op, a, b in ops:
                if op == "publish":
                    toks = _prompt(a, b)
                    keys = engine.hash_tokens(toks)
                    seen.update(zip(keys, router.hash_tokens(toks), strict=True))
                    cache.publish(keys, token_ids=toks)
                elif op == "evict":
                    cache.evict_many(a)
                elif op == "remove":
                    resident = sorted((k for k in seen if k in cache), key=repr)
                    if resident:
                        cache.remove(resident[a % len(resident)])
                elif op == "clear":
                    cache.clear()
                else:
                    check()
                pub.flush()  # one batch per engine step
            note(f"{len(ops)} ops, {pub.next_seq} batches")
            check()
