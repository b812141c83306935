"""A `KVEventSubscriber` (started: its own thread, as the router runs it) against a hostile
peer: our own PUB and ROUTER sockets on 127.0.0.1, standing where a backend's publisher
would, sending what no publisher should. Each case checks that the message is skipped and
counted by kind, that the thread goes on, and that the next good batch, from the same peer
and from a real `KVEventPublisher` followed alongside it, is still applied. Hypothesis
generates hostile frames for the fuzzing case. Every wait polls a real condition with a
deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixflight.core import BlockHasher
from prefixflight.core.cache import BlockStored
from prefixflight.serve.kv_events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    WireBatch,
    WireBlockStored,
    encode_batch,
    fold_hash,
)

zmq = pytest.importorskip("zmq")
BS = 4
TOPIC = b"kv@evil@m"
WAIT = 20.0


def until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling a real condition, bounded above


def stored(first: int, blocks: int = 1) -> bytes:
    """A valid batch storing ``blocks`` chained blocks with hashes from ``first``."""
    event = WireBlockStored(
        block_hashes=tuple(range(first, first + blocks)),
        parent_block_hash=None,
        token_ids=tuple(t % 50 for t in range(blocks * BS)),
        block_size=BS,
    )
    return encode_batch(WireBatch(1.0, (event,)))


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


class Peer:
    """A hostile publisher: a PUB socket (and a ROUTER for replays) bound on loopback."""

    def __init__(self, *, replay: bool = False) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router: Any = None
        self.replay_endpoint: str | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.next = 0

    def send(self, *frames: bytes) -> None:
        self.pub.send_multipart(frames)

    def good(self, sub: KVEventSubscriber, name: str = "evil", *, first: int = 1) -> None:
        """Send valid batches with rising seqs until one is applied (a SUB joins late)."""
        base = sub.feeds[name].next_seq

        def step() -> bool:
            self.send(TOPIC, seq(self.next), stored(first))
            self.next += 1
            return sub.wait_for_seq(name, base + 1, 0.05) or sub.feeds[name].next_seq > base

        until(step, "a good batch to be applied")
        self.next = max(self.next, sub.feeds[name].next_seq)

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@contextmanager
def following(peer: Peer, **kw: Any) -> Iterator[tuple[KVEventSubscriber, KVEventPublisher]]:
    """A started subscriber following ``peer`` as "evil" and a real publisher as "good"."""
    good = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = KVEventSubscriber(
        {
            "evil": PublisherAddress(peer.endpoint, peer.replay_endpoint),
            "good": PublisherAddress(good.endpoint, good.replay_endpoint),
        },
        hasher=BlockHasher(block_size=BS),
        **kw,
    )
    sub.start(catch_up_every_s=60.0)
    try:
        yield sub, good
    finally:
        sub.close()
        good.close()
        peer.close()


def good_still_flows(sub: KVEventSubscriber, good: KVEventPublisher, token: int) -> None:
    """The real publisher's next batch reaches the index: residency is not frozen."""
    hasher = BlockHasher(block_size=BS)
    toks = (token,) * BS
    good(
        BlockStored(
            block_hashes=hasher.hash_tokens(toks),
            parent_block_hash=None,
            token_ids=toks,
            block_size=BS,
        )
    )
    good.flush()
    assert good.drain(10.0)
    assert sub.wait_for_seq("good", good.next_seq, WAIT), "the good publisher was not followed"
    assert fold_hash(hasher.hash_tokens(toks)[0]) in sub.index.replica("good")


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


HOSTILE: dict[str, tuple[list[bytes], str]] = {
    "token id >= 2**63": ([TOPIC, b"", stored(1)], "apply"),  # seq and payload filled below
    "invalid and truncated": (
        [TOPIC, b"", msgspec.msgpack.encode([1.0, [{"type": "X"}]])[:-2]],
        "decode",
    ),
    "trailing bytes": ([TOPIC, b"", stored(7) + b"\x00\x01"], "decode"),
    "10,000-deep nesting": ([TOPIC, b"", nested(10_000)], "decode"),
    "seq 2**64-1": ([TOPIC, seq(2**64 - 1), stored(9)], "seq"),
    "two frames": ([TOPIC, seq(0)], "frame"),
    "another topic": ([b"kv@good@m", b"", stored(11)], "topic"),
}


def _big_token() -> bytes:
    event = WireBlockStored(
        block_hashes=(5,), parent_block_hash=None, token_ids=(2**63, 0, 0, 0), block_size=BS
    )
    return encode_batch(WireBatch(1.0, (event,)))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_live_frame_is_counted_and_the_thread_goes_on(case: str) -> None:
    frames, kind = HOSTILE[case]
    frames = list(frames)
    if case == "token id >= 2**63":
        frames[2] = _big_token()
    peer = Peer()
    with following(peer) as (sub, good):
        peer.good(sub)
        if not frames[1]:
            frames[1] = seq(peer.next)
            peer.next += 1
        before = sub.error_counts().get(("evil", kind), 0)
        peer.send(*frames)
        until(lambda: sub.error_counts().get(("evil", kind), 0) > before, f"a {kind} error")
        assert sub.alive
        peer.good(sub, first=100)  # the same peer's next good batch is applied
        good_still_flows(sub, good, 3)
        status = sub.status()["evil"]
        assert status.errors[kind] >= 1 and status.last_batch_age_s is not None


def test_an_old_seq_on_the_same_connection_does_not_empty_the_index() -> None:
    peer = Peer()
    with following(peer) as (sub, _good):
        peer.good(sub)
        peer.good(sub, first=40)
        held = len(sub.index.replica("evil"))
        assert held >= 1
        peer.send(TOPIC, seq(0), stored(1))  # an old message, replayed on the live socket
        until(lambda: sub.error_counts().get(("evil", "seq"), 0) >= 1, "a seq error")
        assert len(sub.index.replica("evil")) == held and sub.feeds["evil"].restarts == 0


def test_a_restarted_publisher_starting_over_is_followed() -> None:
    """A lower seq on a new connection is a restart: the index starts over."""
    peer = Peer()
    with following(peer) as (sub, _good):
        for first in (1, 2, 3):
            peer.good(sub, first=first)
        endpoint = peer.endpoint
        peer.pub.close(linger=0)
        peer.pub = zmq.Context.instance().socket(zmq.PUB)
        until(lambda: _rebind(peer.pub, endpoint), "the port to be free again")
        until(lambda: _restarted(peer, sub), "the restart to be seen")
        peer.next = 1
        peer.good(sub, first=50)
        assert sub.feeds["evil"].restarts == 1 and len(sub.index.replica("evil")) == 1


def _rebind(sock: Any, endpoint: str) -> bool:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        return False
    return True


def _restarted(peer: Peer, sub: KVEventSubscriber) -> bool:
    peer.send(TOPIC, seq(0), stored(1))  # the restarted publisher's first batch, until seen
    return sub.feeds["evil"].restarts == 1


def test_the_topic_is_the_one_configured() -> None:
    peer = Peer()
    sub = KVEventSubscriber({"evil": PublisherAddress(peer.endpoint, topic="kv@pod-a@m")})
    sub.start(catch_up_every_s=60.0)
    try:
        until(lambda: _sent(peer, sub), "a topic error")
        assert sub.feeds["evil"].next_seq == 0 and len(sub.index.replica("evil")) == 0
    finally:
        sub.close()
        peer.close()


def _sent(peer: Peer, sub: KVEventSubscriber) -> bool:
    peer.send(TOPIC, seq(peer.next), stored(1))
    peer.next += 1
    return sub.error_counts().get(("evil", "topic"), 0) > 0


# -- replay answers ---------------------------------------------------------------------------
END = [b"", seq(2**64 - 1), b""]  # a replay's end marker (seq -1)


class Responder:
    """Answers each replay request on ``peer``'s ROUTER with ``answer(start)`` (frames after
    the identity), until stopped; ``forever``: repeat the answer without end. Until
    `hostile` is set, a request gets an empty answer (the end marker) instead: the
    subscriber's first catch-ups are answered as a publisher would."""

    def __init__(
        self, peer: Peer, answer: Callable[[int], list[list[bytes]]], *, forever: bool = False
    ) -> None:
        self.peer, self.answer, self.forever = peer, answer, forever
        self.stop = threading.Event()
        self.hostile = threading.Event()
        self.requests = 0  # hostile answers given
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        router = self.peer.router
        deadline = time.monotonic() + 60
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not router.poll(20):
                continue
            identity, _empty, start = router.recv_multipart()
            if not self.hostile.is_set():
                router.send_multipart([identity, b"", *END])
                continue
            self.requests += 1
            replies = self.answer(int.from_bytes(start, "big"))
            while not self.stop.is_set() and time.monotonic() < deadline:
                for reply in replies:
                    router.send_multipart([identity, b"", *reply])
                if not self.forever or router.poll(0):
                    break

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_a_replay_seq_out_of_range_is_counted() -> None:
    peer = Peer(replay=True)
    with following(peer, replay_timeout_s=0.5) as (sub, good):
        responder = Responder(
            peer,
            lambda s: [
                [TOPIC, (-5).to_bytes(8, "big", signed=True), stored(3)],
                END,
            ],
        )
        try:
            peer.good(sub)
            responder.hostile.set()
            peer.send(TOPIC, seq(peer.next + 5), stored(60))  # a gap: the replay is asked for
            until(lambda: sub.error_counts().get(("evil", "seq"), 0) >= 1, "a seq error")
            assert sub.alive
            good_still_flows(sub, good, 4)
        finally:
            responder.close()


@pytest.mark.parametrize("bound", ["frames", "time"])
def test_a_replay_that_never_ends_is_cut_off(bound: str) -> None:
    """A replay endpoint answering an old batch over and over: the answer is cut at its
    frame bound or at the replay's time budget, and live batches are applied again."""
    peer = Peer(replay=True)
    kw: dict[str, Any] = {
        "replay_timeout_s": 5.0,
        "replay_budget_s": 60.0,
        "replay_max_frames": 200,
    }
    if bound == "time":
        kw = {"replay_timeout_s": 5.0, "replay_budget_s": 1.0, "replay_max_frames": 10**9}
    with following(peer, **kw) as (sub, good):
        responder = Responder(peer, lambda s: [[TOPIC, seq(0), stored(1)]], forever=True)
        try:
            peer.good(sub)
            responder.hostile.set()
            started = time.monotonic()
            peer.send(TOPIC, seq(peer.next + 3), stored(70))  # a gap: the replay is asked for
            until(
                lambda: sub.error_counts().get(("evil", "replay_bound"), 0) >= 1,
                "the replay to be cut off",
            )
            assert time.monotonic() - started < 10
            # another gap at once: that replay endpoint is not asked again for a while
            gap = sub.feeds["evil"].next_seq + 3
            peer.send(TOPIC, seq(gap), stored(80))
            assert sub.wait_for_seq("evil", gap + 1, 2.0), "a live batch waited on a replay"
            assert responder.requests == 1
            assert sub.error_counts()[("evil", "replay_bound")] == 1
            responder.stop.set()
            good_still_flows(sub, good, 5)
            assert sub.alive
        finally:
            responder.close()


# -- bounds -----------------------------------------------------------------------------------
def test_a_message_over_the_size_limit_is_dropped_and_the_index_is_bounded() -> None:
    peer = Peer()
    with following(peer, max_message_bytes=64 << 10, max_blocks=500) as (sub, good):
        peer.good(sub)
        peer.send(TOPIC, seq(peer.next), b"\x00" * (128 << 10))  # dropped by ZMQ, unread
        peer.next += 1
        peer.good(sub, first=10_000)  # reconnected; the next batches arrive
        before = sub.feeds["evil"].next_seq
        peer.send(TOPIC, seq(peer.next), stored(20_000, blocks=2000))  # 2000 blocks: 500 kept
        peer.next += 1
        until(lambda: sub.feeds["evil"].next_seq > before, "the big batch")
        index = sub.index.replica("evil")
        assert len(index) == 500 and index.stats.evicted >= 1500
        good_still_flows(sub, good, 6)


# -- fuzzing ----------------------------------------------------------------------------------
_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
    optional={
        "block_hashes": st.lists(
            st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=9), max_size=4
        ),
        "parent_block_hash": st.none() | st.integers(0, 2**64 - 1),
        "token_ids": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=12),
        "block_size": st.integers(-1, 5),
        "medium": st.none() | st.text(max_size=4),
        "extra_keys": _msgpack_values,
    },
)
_payloads = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda v: msgspec.msgpack.encode(v), _msgpack_values),
    st.builds(
        lambda ts, evs: msgspec.msgpack.encode([ts, evs, 0]),
        st.floats(),
        st.lists(_event_like, max_size=3),
    ),
    st.builds(lambda d: nested(d), st.integers(1, 20_000)),
)


@st.composite
def _hostile(draw: st.DrawFn) -> list[bytes]:
    payload = draw(_payloads)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(payload)))
        payload = payload[:cut] + draw(st.binary(max_size=4))  # truncated, or trailing bytes
    seq_field = (
        draw(st.sampled_from([b"", b"\x00" * 9]))
        if draw(st.integers(0, 9)) == 0
        else seq(draw(st.integers(0, 2**62) | st.integers(2**63, 2**64 - 1)))
    )
    topic = draw(st.sampled_from([TOPIC, b"kv@other@m", b""]))
    extra = draw(st.lists(st.binary(max_size=4), max_size=1))
    return [topic, seq_field, payload, *extra]


def test_fuzz_hostile_frames_never_stop_the_subscriber() -> None:
    peer = Peer()
    with following(peer, max_blocks=10_000) as (sub, good):
        peer.good(sub)

        @settings(
            max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(frames=_hostile())
        def check(frames: list[bytes]) -> None:
            peer.send(*frames)
            last = sub.feeds["evil"].last_live
            peer.next = max(peer.next, 0 if last is None else last + 1)
            target = sub.feeds["evil"].next_seq
            peer.send(TOPIC, seq(peer.next), stored(1))  # the sentinel, after the frames
            peer.next += 1
            until(
                lambda: sub.feeds["evil"].next_seq > target,
                f"the sentinel (seq {peer.next - 1}, {sub.status()['evil']})",
                10,
            )
            assert sub.alive

        check()
        good_still_flows(sub, good, 7)
        assert sub.alive and sub.error_counts()
