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
    BlockHash,
    BlockHasher,
    ConfigError,
    PrefixCache,
    ReplicaLoad,
    RouteRequest,
    UsageError,
)
from prefixflight.core.cache import AllBlocksCleared, BlockRemoved, BlockStored
from prefixflight.core.routing import ApproxPrefixRouter
from prefixflight.serve.kv_events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    WireBlockStored,
    decode_batch,
    fold_hash,
    kv_topic,
)
from prefixflight.serve.kv_events._endpoints import offset_endpoint

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
    assert sub.wait_for_seq(replica, pub.next_seq, 10.0), f"{replica} never caught up"


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


@pytest.mark.parametrize(
    ("encoding", "hash_encoding"), [("array", "int"), ("map", "bytes"), ("map", "int")]
)
def test_a_late_subscriber_recovers_through_the_replay_socket(
    encoding: str, hash_encoding: str
) -> None:
    hasher = BlockHasher(block_size=BS)
    prompts = [[i] * (2 * BS) for i in range(5)]
    with _publisher(
        topic=kv_topic("p", "m"), encoding=encoding, hash_encoding=hash_encoding
    ) as pub:
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
            assert pub.drain(10.0)  # every warm-up batch numbered: prompts start at base
            base = pub.next_seq
            lost_before = sub.feeds["r"].lost  # slow-joiner losses, without replay
            sub.drop = {base + 1, base + 2}
            prompts = [[i] * BS for i in range(1, 6)]
            for p in prompts:
                cache.publish(hasher.hash_tokens(p), token_ids=p)
                pub.flush()
            assert pub.drain(10.0)
            target = pub.next_seq
            _wait(lambda: sub.feeds["r"].next_seq >= target, lambda: sub.poll(0.05), "the end")
            keys = sub.index.replica("r").keys()
            dropped = {fold_hash(hasher.hash_tokens(p)[0]) for p in prompts[1:3]}
            if replay:
                assert dropped <= keys and sub.feeds["r"].lost == 0
            else:
                assert not dropped & keys and sub.feeds["r"].lost - lost_before == 2
        finally:
            sub.close()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"endpoint": "nowhere"}, "'nowhere'"),
        ({"replay_endpoint": 5}, "5"),
        ({"medium": "TPU"}, "'TPU'"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"hash_encoding": "hex"}, "'hex'"),
        ({"encoding": "json"}, "'json'"),
        ({"max_delay_s": 0}, "max_delay_s"),
        ({"data_parallel_rank": -1}, "-1"),
        ({"endpoint": "tcp://127.0.0.1:*", "data_parallel_rank": 1}, "data_parallel_rank 1"),
    ],
)
def test_bad_publisher_settings_are_named(kwargs: dict[str, object], named: str) -> None:
    args: dict[str, object] = {"endpoint": LOOPBACK, **kwargs}
    with pytest.raises(ConfigError, match=named.replace("*", r"\*")):
        KVEventPublisher(**args)  # type: ignore[arg-type]


def test_endpoints_are_offset_by_data_parallel_rank_as_vllm_does() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_a_data_parallel_rank_publishes_on_its_own_endpoint(tmp_path: object) -> None:
    base = f"ipc://{tmp_path}/kv"
    with KVEventPublisher(base, data_parallel_rank=3, replay_endpoint=f"{base}-replay") as pub:
        assert pub.endpoint.endswith("/kv_dp3") and str(pub.replay_endpoint).endswith("_dp3")
        with KVEventSubscriber({"r": _address(pub)}) as sub:
            pub(AllBlocksCleared())
            _sync(sub, pub, "r")
            assert sub.index.replica("r").stats.cleared == 1


def test_events_go_out_without_flush_by_time_and_by_size() -> None:
    hasher = BlockHasher(block_size=BS)
    toks = list(range(2 * BS))
    for settings_, name in (({"max_delay_s": 0.02}, "time"), ({"max_batch_events": 2}, "size")):
        kw: dict[str, object] = {"max_delay_s": 3600.0, **settings_}
        with _publisher(**kw) as pub, KVEventSubscriber({"r": _address(pub)}) as sub:
            PrefixCache(LRU(8), block_size=BS, event_sink=pub).publish(
                hasher.hash_tokens(toks), token_ids=toks
            )
            assert sub.wait_for_seq("r", 1, 10.0), name  # no flush, no drain
            assert len(sub.index.replica("r")) == 2, name
            # the sender thread counts a batch once it is sent, which may be after the
            # subscriber applied it
            assert pub.drain(10.0) and pub.next_seq == 1, name


def test_a_closed_publisher_refuses_events_and_closes_once() -> None:
    pub = KVEventPublisher(LOOPBACK)
    with pytest.raises(UsageError, match="expected a KV event, got 'BlockStored'"):
        pub("BlockStored")  # type: ignore[arg-type]
    pub.close()
    pub.close()
    with pytest.raises(UsageError, match="closed"):
        pub(AllBlocksCleared())
    assert pub.next_seq == 0  # the rejected event never went out


def test_a_batch_that_cannot_be_encoded_is_recorded_and_leaves_no_gap() -> None:
    with _publisher() as pub, KVEventSubscriber({"r": _address(pub)}) as sub:
        pub(BlockRemoved(block_hashes=("not a hash",)))
        assert pub.drain(10.0)
        assert pub.errors == 1 and "not a hash" in str(pub.last_error)
        assert pub.next_seq == 0
        pub(BlockStored(block_hashes=(7,), parent_block_hash=None, block_size=BS))
        _sync(sub, pub, "r")
        assert sub.index.replica("r").keys() == {7} and sub.feeds["r"].lost == 0


def test_one_subscriber_follows_several_replicas_and_a_router_reads_them() -> None:
    hasher = BlockHasher(block_size=BS)
    prompts = {"a": [1] * (3 * BS), "b": [2] * (3 * BS)}
    with _publisher(topic=kv_topic("a", "m")) as pa, _publisher(topic=kv_topic("b", "m")) as pb:
        pubs = {"a": pa, "b": pb}
        for name, pub in pubs.items():
            cache = PrefixCache(LRU(16), block_size=BS, event_sink=pub)
            cache.publish(hasher.hash_tokens(prompts[name]), token_ids=prompts[name])
        with KVEventSubscriber({n: _address(p) for n, p in pubs.items()}) as sub:
            for name, pub in pubs.items():
                _sync(sub, pub, name)
            router = ApproxPrefixRouter(index=sub.index)
            loads = [ReplicaLoad(name="a"), ReplicaLoad(name="b")]
            for i, name in enumerate(["b", "a", "b"]):
                blocks = hasher.hash_tokens(prompts[name])
                req = RouteRequest(request_id=i, blocks=blocks, num_tokens=3 * BS)
                (decision,) = router.route(req, float(i), loads)
                assert decision.replica == name
            assert sub.pod_and_model("b") == ("b", "m")
            with pytest.raises(UsageError, match="'c'"):
                sub.catch_up("c")


def test_a_started_subscriber_polls_only_in_its_own_thread() -> None:
    with _publisher() as pub, KVEventSubscriber({"r": _address(pub)}) as sub:
        sub.start()
        with pytest.raises(UsageError, match="own thread"):
            sub.poll(0.0)
        with pytest.raises(UsageError, match="already started"):
            sub.start()
        pub(AllBlocksCleared())
        _sync(sub, pub, "r")  # the subscriber's own thread applies it, catching up if need be
        assert sub.index.replica("r").stats.cleared == 1


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
                assert rebuilt.index.replica("r").keys() == {fold_hash(seen[b]) for b in resident}
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
