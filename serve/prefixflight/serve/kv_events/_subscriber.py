"""`KVEventSubscriber`: follow KV-event publishers (ours or vLLM's) into a block index.

Each replica followed gets a SUB socket (connected to a publisher that binds, or bound for a
publisher that connects, as vLLM does to ``tcp://HOST:PORT``) and, with a replay endpoint,
a DEALER socket that asks for missed batches. The pure parts are in `_wire` (decoding) and
`_index` (the indexes and the seq bookkeeping); this module owns the sockets and the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Final

import attrs
import zmq

from prefixflight.core import BlockHasher, ConfigError, UsageError

from ._endpoints import resolved
from ._index import ClusterBlockIndex, ReplicaFeed
from ._wire import (
    END_SEQ,
    KVEventFormatError,
    decode_batch,
    parse_live_frames,
    parse_replay_frames,
    parse_topic,
)

__all__ = ["KVEventSubscriber", "PublisherAddress"]

_SEQ_BYTES: Final = 8
_MAX_REPLAY_ROUNDS: Final = 64  # a publisher may answer a replay in parts: ask this often

@attrs.frozen
class PublisherAddress:
    """Where one replica publishes: its PUB endpoint and, optionally, its replay endpoint.

    ``bind=False`` (the default): the publisher binds ``endpoint`` and the subscriber
    connects to it (vLLM with ``tcp://*:5557`` or ``ipc://...``, `KVEventPublisher` on
    ``tcp://127.0.0.1:*``). ``bind=True``: the publisher connects (vLLM with
    ``tcp://HOST:PORT``), so the subscriber binds ``endpoint``; ``tcp://127.0.0.1:*`` or
    ``:0`` binds a free port, read back with `KVEventSubscriber.endpoint`. The replay
    endpoint is always the publisher's to bind, and the subscriber connects to it.
    """

    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False


def _address(
    name: object, addr: object, *, error: type[UsageError] = ConfigError
) -> PublisherAddress:
    if not isinstance(name, str) or not name:
        raise error(f"replica ids must be non-empty strs, got {name!r}")
    a = PublisherAddress(addr) if isinstance(addr, str) else addr
    if not isinstance(a, PublisherAddress):
        raise error(f"expected a PublisherAddress or an endpoint, got {addr!r}")
    if not isinstance(a.endpoint, str) or "://" not in a.endpoint:
        raise error(f"{name}: endpoint must be a ZMQ address, got {a.endpoint!r}")
    replay = a.replay_endpoint
    if replay is not None and (not isinstance(replay, str) or "://" not in replay):
        raise error(f"{name}: replay_endpoint must be a ZMQ address, got {replay!r}")
    if not isinstance(a.bind, bool):
        raise error(f"{name}: bind must be a bool, got {a.bind!r}")
    return a


class KVEventSubscriber:
    """Follows KV-event publishers (ours or vLLM's) and keeps a per-replica block index.

    ``publishers`` maps a replica id to its `PublisherAddress` (or just the PUB endpoint).
    Each replica gets its own SUB socket (connected, or bound with ``bind=True`` for a
    publisher that connects), filtered by ``topic`` (a prefix; ``""`` takes every topic),
    and a DEALER socket for its replay endpoint. A batch whose seq skips ahead triggers a
    replay request from the first missing seq; batches the replay cannot provide (it keeps
    only ``buffer_steps``) are counted as lost in `feeds`. ``hasher``: rebuild block keys
    from the events' token ids (for a publisher whose hash seed is unknown; see
    `ReplicaBlockIndex`).

    Drive it from one thread: `poll` (bounded waits) or `start` (a background thread that
    polls until `close`). The index is read with plain membership tests, which are safe from
    another thread. `add_publisher` / `remove_publisher` change the replicas followed at run
    time (``publishers`` may start empty).
    """

    def __init__(
        self,
        publishers: Mapping[str, PublisherAddress | str],
        *,
        topic: str = "",
        hasher: BlockHasher | None = None,
        index: ClusterBlockIndex | None = None,
        replay_timeout_s: float = 2.0,
        on_error: Callable[[str, Exception], None] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        addresses = {name: _address(name, addr) for name, addr in publishers.items()}
        if index is not None and hasher is not None:
            raise ConfigError("give either index= or hasher=, not both")
        self._index = ClusterBlockIndex(hasher=hasher) if index is None else index
        self._addresses: dict[str, PublisherAddress] = {}
        self._endpoints: dict[str, str] = {}
        self._topic = topic.encode("utf-8")
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._on_error = on_error
        self._ctx = zmq.Context.instance() if context is None else context
        self._feeds: dict[str, ReplicaFeed] = {}
        self._subs: dict[str, zmq.Socket[bytes]] = {}
        self._by_socket: dict[zmq.Socket[bytes], str] = {}
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._poller = zmq.Poller()
        self._errors = 0
        self._closed = False
        self._stop = threading.Event()
        self._applied = threading.Condition()
        self._thread: threading.Thread | None = None
        self._topics: dict[str, str] = {}
        self._changes: queue.SimpleQueue[tuple[str, PublisherAddress | None]] = (
            queue.SimpleQueue()
        )
        for name, a in addresses.items():
            self._follow(name, a)

    # -- views --------------------------------------------------------------------------------
    @property
    def index(self) -> ClusterBlockIndex:
        return self._index

    @property
    def feeds(self) -> Mapping[str, ReplicaFeed]:
        return dict(self._feeds)

    @property
    def publishers(self) -> Mapping[str, PublisherAddress]:
        """The replicas followed now (changes made by `add_publisher` / `remove_publisher`
        after `start` show once the subscriber's thread has applied them)."""
        return dict(self._addresses)

    @property
    def errors(self) -> int:
        """Messages that could not be decoded (skipped)."""
        return self._errors

    def endpoint(self, replica: str) -> str:
        """Where ``replica``'s SUB socket is bound or connected, a wildcard port resolved
        (give a bound one to the publisher that connects)."""
        if replica not in self._endpoints:
            raise UsageError(f"unknown replica {replica!r}; known: {sorted(self._endpoints)}")
        return self._endpoints[replica]

    def topic_of(self, replica: str) -> str | None:
        """The last topic ``replica`` published under (``kv@<pod>@<model>`` for llm-d)."""
        return self._topics.get(replica)

    def pod_and_model(self, replica: str) -> tuple[str, str] | None:
        t = self._topics.get(replica)
        return None if t is None else parse_topic(t)

    # -- the publishers followed ---------------------------------------------------------------
    def add_publisher(self, replica: str, address: PublisherAddress | str) -> None:
        """Follow ``replica``'s publisher too (from any thread): its index starts empty and is
        filled through its replay socket, then live. Adding a replica already followed at the
        same address does nothing; at another address (a restarted publisher), its index
        starts over. After `start`, the subscriber's thread applies the change at its next
        poll."""
        if not isinstance(replica, str) or not replica:
            raise UsageError(f"replica ids must be non-empty strs, got {replica!r}")
        a = _address(replica, address, error=UsageError)
        self._change(replica, a)

    def remove_publisher(self, replica: str) -> None:
        """Stop following ``replica`` (from any thread; unknown names are ignored): its
        sockets close and its index is dropped."""
        if not isinstance(replica, str) or not replica:
            raise UsageError(f"replica ids must be non-empty strs, got {replica!r}")
        self._change(replica, None)

    def _change(self, replica: str, address: PublisherAddress | None) -> None:
        if self._closed:
            raise UsageError("the subscriber is closed")
        if self._thread is None:
            self._apply_change(replica, address)
        else:
            self._changes.put((replica, address))

    def _apply_changes(self) -> int:
        applied = 0
        while True:
            try:
                replica, address = self._changes.get_nowait()
            except queue.Empty:
                return applied
            applied += self._apply_change(replica, address)

    def _apply_change(self, replica: str, address: PublisherAddress | None) -> int:
        if address is not None and self._addresses.get(replica) == address:
            return 0
        self._unfollow(replica)
        if address is None:
            return 0
        self._follow(replica, address)
        return self._replay(replica, 0)  # what it published before we connected

    def _follow(self, name: str, address: PublisherAddress) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            if address.bind:
                sub.bind(address.endpoint)
            else:
                sub.connect(address.endpoint)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            how = "bind" if address.bind else "connect to"
            raise ConfigError(f"{name}: cannot {how} {address.endpoint!r}: {exc}") from None
        self._endpoints[name] = resolved(sub, address.endpoint)
        self._addresses[name] = address
        self._feeds[name] = ReplicaFeed(self._index.replica(name))
        self._subs[name] = sub
        self._by_socket[sub] = name
        self._poller.register(sub, zmq.POLLIN)

    def _unfollow(self, name: str) -> None:
        if self._addresses.pop(name, None) is None:
            return
        self._feeds.pop(name, None)
        self._endpoints.pop(name, None)
        self._topics.pop(name, None)
        self._index.drop(name)
        sub = self._subs.pop(name)
        self._poller.unregister(sub)
        del self._by_socket[sub]
        sub.close(linger=0)
        dealer = self._dealers.pop(name, None)
        if dealer is not None:
            dealer.close(linger=0)

    # -- driving ------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what has arrived, waiting up to ``timeout_s`` for the first message; return
        how many batches were applied (replayed ones included)."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise UsageError("the subscriber polls in its own thread since start()")
        if self._closed:
            raise UsageError("the subscriber is closed")
        applied = self._apply_changes()
        if not self._subs:  # zmq returns at once from an empty poll: wait here instead
            self._stop.wait(max(0.0, timeout_s))
            return applied + self._apply_changes()
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        for sock in ready:
            name = self._by_socket[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                applied += self._on_live(name, frames)
        return applied

    def catch_up(self, replica: str | None = None) -> int:
        """Ask replay sockets for everything after what was applied (for a subscriber that
        joined late or went quiet); return how many batches were applied."""
        if replica is not None and replica not in self._feeds:
            raise UsageError(f"unknown replica {replica!r}; known: {sorted(self._feeds)}")
        names = list(self._feeds) if replica is None else [replica]
        return sum(self._replay(n, self._feeds[n].next_seq) for n in names)

    def wait_for_seq(self, replica: str, seq: int, timeout_s: float = 5.0) -> bool:
        """Wait until batches up to ``seq - 1`` of ``replica`` are applied (or lost):
        ``feeds[replica].next_seq >= seq``; ``False`` on timeout.

        Without `start`, this polls (and asks the replay socket when nothing arrives, since
        a message missed at the tail is announced by nothing else); after `start`, it waits
        for the background thread.
        """
        feed = self._feeds.get(replica)
        if feed is None:
            raise UsageError(f"unknown replica {replica!r}; known: {sorted(self._feeds)}")
        deadline = time.monotonic() + timeout_s
        if self._thread is None:
            while feed.next_seq < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self.poll(min(left, 0.05)) == 0:
                    self.catch_up(replica)
            return True
        with self._applied:
            while feed.next_seq < seq:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._applied.wait(left)
        return True

    def start(self, *, catch_up_every_s: float = 1.0) -> None:
        """Poll in a background thread until `close`: catch up first, then again whenever
        nothing arrived for ``catch_up_every_s`` (a batch missed at the tail of a stream is
        announced by nothing else)."""
        if self._thread is not None:
            raise UsageError("the subscriber is already started")
        if self._closed:
            raise UsageError("the subscriber is closed")
        self._thread = threading.Thread(
            target=self._loop, args=(catch_up_every_s,), name="kv-events-subscriber", daemon=True
        )
        self._thread.start()

    def _loop(self, every: float) -> None:
        self._notify(self.catch_up())
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            applied = self.poll(min(0.05, every))
            now = time.monotonic()
            if applied == 0 and now - quiet_since >= every:
                applied = self.catch_up()
                quiet_since = now
            elif applied:
                quiet_since = now
            self._notify(applied)

    def _notify(self, applied: int) -> None:
        if applied:
            with self._applied:
                self._applied.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for sock in (*self._subs.values(), *self._dealers.values()):
            sock.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _fail(self, name: str, exc: Exception) -> None:
        self._errors += 1
        if self._on_error is not None:
            self._on_error(name, exc)

    def _on_live(self, name: str, frames: list[bytes]) -> int:
        try:
            topic, seq, payload = parse_live_frames(frames)
            batch = decode_batch(payload)
        except KVEventFormatError as exc:
            self._fail(name, exc)
            return 0
        self._topics[name] = topic
        feed = self._feeds[name]
        applied = 0
        start = feed.observe_live(seq)
        if start is not None:
            applied += self._replay(name, start)
        if feed.accept(seq, batch):
            applied += 1
        return applied

    def _dealer(self, name: str) -> zmq.Socket[bytes] | None:
        endpoint = self._addresses[name].replay_endpoint
        if endpoint is None:
            return None
        sock = self._dealers.get(name)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.connect(endpoint)
            self._dealers[name] = sock
        return sock

    def _replay(self, name: str, start: int) -> int:
        """Request batches from ``start`` and apply them until seq -1 arrives; ask again
        from where an answer stopped while answers bring new batches (a publisher may bound
        its answers, as `KVEventPublisher` does)."""
        applied = 0
        for _ in range(_MAX_REPLAY_ROUNDS):
            got = self._replay_once(name, start)
            applied += got
            feed = self._feeds.get(name)
            if got == 0 or feed is None:
                break
            start = feed.next_seq
        return applied

    def _replay_once(self, name: str, start: int) -> int:
        sock = self._dealer(name)
        if sock is None:
            return 0
        feed = self._feeds[name]
        sock.send_multipart((b"", start.to_bytes(_SEQ_BYTES, "big")))
        applied = 0
        while True:
            if not sock.poll(self._replay_timeout_ms):
                # no end marker: drop the socket so a late answer cannot mix with the next one
                sock.close(linger=0)
                del self._dealers[name]
                self._fail(name, TimeoutError(f"replay from {start} timed out"))
                return applied
            frames = sock.recv_multipart()
            try:
                topic, seq, payload = parse_replay_frames(frames)
            except KVEventFormatError as exc:
                self._fail(name, exc)
                continue
            if topic is not None:
                self._topics[name] = topic
            if seq == END_SEQ:
                return applied
            try:
                batch = decode_batch(payload)
            except KVEventFormatError as exc:
                self._fail(name, exc)
                continue
            if feed.accept(seq, batch):
                applied += 1
