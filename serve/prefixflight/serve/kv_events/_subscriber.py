"""`KVEventSubscriber`: follow KV-event publishers (ours or vLLM's) into a block index.

Each replica followed gets a SUB socket (connected to a publisher that binds, or bound for a
publisher that connects, as vLLM does to ``tcp://HOST:PORT``) and, with a replay endpoint,
a DEALER socket that asks for missed batches. The pure parts are in `_wire` (decoding) and
`_index` (the indexes and the seq bookkeeping); this module owns the sockets and the thread.

Whatever a socket delivers, the thread goes on: a message that cannot be decoded, validated
or applied is skipped and counted per replica and kind (`error_counts`); messages are
bounded in size, queues in messages, replay answers in frames, bytes and time, and indexes
in blocks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Final, Literal, TypeAlias

import attrs
import zmq

from prefixflight.core import BlockHasher, ConfigError, UsageError

from ._endpoints import resolved
from ._index import DEFAULT_MAX_BLOCKS, ClusterBlockIndex, ReplicaFeed
from ._wire import (
    END_SEQ,
    KVEventFormatError,
    WireBatch,
    decode_batch,
    parse_live_frames,
    parse_replay_frames,
    parse_topic,
)

__all__ = ["ErrorKind", "KVEventSubscriber", "PublisherAddress", "ReplicaStatus"]

_SEQ_BYTES: Final = 8
_MAX_REPLAY_ROUNDS: Final = 64  # a publisher may answer a replay in parts: ask this often
MAX_SEQ: Final = (1 << 63) - 1  # vLLM numbers batches with int64s
# a (re)connection, reported before its messages; a disconnection (ZMQ does not reconnect
# after a protocol error, such as a message over MAXMSGSIZE: the subscriber does)
_MONITORED: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

ErrorKind: TypeAlias = Literal[
    "frame", "decode", "seq", "topic", "apply", "replay_timeout", "replay_bound", "internal"
]
"""What went wrong with a message (`KVEventSubscriber.error_counts`):

- ``frame``: not ``[topic, 8-byte seq, payload]`` (a live message) or a replay reply;
- ``decode``: a payload that is not a KV-event batch (msgpack, schema, nesting);
- ``seq``: a seq out of range (live: 0 to 2**63-1; replay: those or -1), or a live seq that
  went back on a connection that was not re-established (a replayed old message);
- ``topic``: a topic other than the one the replica publishes under (its configured
  ``PublisherAddress.topic``, else the first one it used);
- ``apply``: a batch the index refused (a token id outside int64, ...);
- ``replay_timeout``: a replay answer that stopped without its end marker;
- ``replay_bound``: a replay answer past ``replay_max_frames``, ``replay_max_bytes`` or the
  replay's time budget (the rest is dropped with its socket);
- ``internal``: anything else the thread hit (it goes on).
"""


@attrs.frozen
class PublisherAddress:
    """Where one replica publishes: its PUB endpoint and, optionally, its replay endpoint.

    ``bind=False`` (the default): the publisher binds ``endpoint`` and the subscriber
    connects to it (vLLM with ``tcp://*:5557`` or ``ipc://...``, `KVEventPublisher` on
    ``tcp://127.0.0.1:*``). ``bind=True``: the publisher connects (vLLM with
    ``tcp://HOST:PORT``), so the subscriber binds ``endpoint``; ``tcp://127.0.0.1:*`` or
    ``:0`` binds a free port, read back with `KVEventSubscriber.endpoint`. The replay
    endpoint is always the publisher's to bind, and the subscriber connects to it.

    ``topic``: the only topic accepted from this publisher (``None``: the first topic it
    uses is kept, and messages under any other are refused as ``topic`` errors).
    """

    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False
    topic: str | None = None


@attrs.frozen(kw_only=True)
class ReplicaStatus:
    """One followed replica as the subscriber sees it (`KVEventSubscriber.status`):
    ``next_seq`` (the next batch to apply), ``last_live_seq`` (the last live batch seen),
    ``lag`` (live batches seen and not applied: ``last_live_seq + 1 - next_seq``, at least
    0), ``last_batch_age_s`` (since the last batch was applied, ``None`` before one),
    ``blocks`` (resident in its index), ``lost``, ``restarts``, ``reconnections`` (its SUB
    socket connected again after its connection dropped), ``topic`` (the one accepted,
    ``None`` before the first) and ``errors`` (per `ErrorKind`)."""

    next_seq: int
    last_live_seq: int | None
    lag: int
    last_batch_age_s: float | None
    blocks: int
    lost: int
    restarts: int
    reconnections: int
    topic: str | None
    errors: Mapping[str, int]


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
    if a.topic is not None and not isinstance(a.topic, str):
        raise error(f"{name}: topic must be a str or None, got {a.topic!r}")
    return a


def _at_least(name: str, value: object, least: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least:
        raise ConfigError(f"{name} must be a number >= {least}, got {value!r}")


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

    Bounds (see the module docstring): ``max_message_bytes`` (a larger message closes its
    connection, as ZMQ's ``MAXMSGSIZE`` does, and the subscriber connects again), ``queue_messages``
    (each SUB socket's receive high-water mark: past it new live messages are dropped, and
    later replayed), ``replay_max_frames`` / ``replay_max_bytes`` per replay answer,
    ``replay_budget_s`` for one whole replay (all its rounds), ``replay_timeout_s`` for each
    reply, ``max_blocks`` per replica index (oldest forgotten first). A replay cut short (no
    end marker in time, or past a bound) is not asked of that replica again for
    ``replay_backoff_s``, so one replay endpoint cannot hold the thread that serves every
    replica.

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
        replay_budget_s: float = 5.0,
        replay_backoff_s: float = 10.0,
        replay_max_frames: int = 20_000,
        replay_max_bytes: int = 64 << 20,
        max_message_bytes: int = 2 << 20,
        queue_messages: int = 100,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        on_error: Callable[[str, Exception], None] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        addresses = {name: _address(name, addr) for name, addr in publishers.items()}
        if index is not None and hasher is not None:
            raise ConfigError("give either index= or hasher=, not both")
        for flag, value, least in (
            ("replay_timeout_s", replay_timeout_s, 0.001),
            ("replay_budget_s", replay_budget_s, 0.001),
            ("replay_backoff_s", replay_backoff_s, 0),
            ("replay_max_frames", replay_max_frames, 1),
            ("replay_max_bytes", replay_max_bytes, 1),
            ("max_message_bytes", max_message_bytes, 1),
            ("queue_messages", queue_messages, 1),
        ):
            _at_least(flag, value, least)
        self._index = (
            ClusterBlockIndex(hasher=hasher, max_blocks=max_blocks) if index is None else index
        )
        self._replay_budget_s = float(replay_budget_s)
        self._replay_backoff_s = float(replay_backoff_s)
        self._no_replay_until: dict[str, float] = {}
        self._replay_max_frames = int(replay_max_frames)
        self._replay_max_bytes = int(replay_max_bytes)
        self._max_message_bytes = int(max_message_bytes)
        self._queue_messages = int(queue_messages)
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
        self._monitors: dict[str, zmq.Socket[bytes]] = {}
        self._by_monitor: dict[zmq.Socket[bytes], str] = {}
        self._reconnections: dict[str, int] = {}  # SUB sockets opened again
        self._reconnected: dict[str, bool] = {}  # a connection came up since the last live
        self._last_batch: dict[str, float] = {}
        self._error_counts: Counter[tuple[str, str]] = Counter()
        self._errors = 0
        self._heartbeat = time.monotonic()
        self._closed = False
        self._stop = threading.Event()
        self._applied = threading.Condition()
        self._thread: threading.Thread | None = None
        self._topics: dict[str, str] = {}
        self._changes: queue.SimpleQueue[tuple[str, PublisherAddress | None]] = queue.SimpleQueue()
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
        """Messages (and replays) skipped for an error, all kinds together."""
        return self._errors

    def error_counts(self) -> dict[tuple[str, str], int]:
        """Errors per ``(replica, kind)`` (`ErrorKind`; replica ``""`` for ``internal``
        errors of no replica), since the start."""
        return dict(self._error_counts)

    @property
    def alive(self) -> bool:
        """Whether the background thread runs (`start`) and went round its loop in the
        last 5 s (a replay's time budget included)."""
        thread = self._thread
        return (
            thread is not None
            and thread.is_alive()
            and not self._stop.is_set()
            and time.monotonic() - self._heartbeat < max(5.0, 2 * self._replay_budget_s)
        )

    def status(self) -> dict[str, ReplicaStatus]:
        """Each followed replica's `ReplicaStatus` (read from any thread)."""
        now = time.monotonic()
        counts = dict(self._error_counts)
        out: dict[str, ReplicaStatus] = {}
        for name, feed in dict(self._feeds).items():
            last = feed.last_live
            batch_at = self._last_batch.get(name)
            out[name] = ReplicaStatus(
                next_seq=feed.next_seq,
                last_live_seq=last,
                lag=0 if last is None else max(0, last + 1 - feed.next_seq),
                last_batch_age_s=None if batch_at is None else now - batch_at,
                blocks=len(feed.index),
                lost=feed.lost,
                restarts=feed.restarts,
                reconnections=self._reconnections.get(name, 0),
                topic=self._topics.get(name),
                errors={k: n for (r, k), n in counts.items() if r == name},
            )
        return out

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
            try:
                applied += self._apply_change(replica, address)
            except Exception as exc:  # an endpoint that cannot be bound: reported, not fatal
                self._fail(replica, "internal", exc)

    def _apply_change(self, replica: str, address: PublisherAddress | None) -> int:
        if address is not None and self._addresses.get(replica) == address:
            return 0
        self._unfollow(replica)
        if address is None:
            return 0
        self._follow(replica, address)
        return self._replay(replica, 0)  # what it published before we connected

    def _follow(self, name: str, address: PublisherAddress) -> None:
        self._open(name, address)
        self._addresses[name] = address
        self._feeds[name] = ReplicaFeed(self._index.replica(name))
        self._reconnected[name] = False
        if address.topic is not None:
            self._topics[name] = address.topic

    def _open(self, name: str, address: PublisherAddress) -> None:
        """``name``'s SUB socket and its connection monitor, bound or connected and polled."""
        sub = self._ctx.socket(zmq.SUB)
        # monitored before it connects: the first handshake is reported too
        monitor = sub.get_monitor_socket(_MONITORED)
        try:
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sub.setsockopt(zmq.RCVHWM, self._queue_messages)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            if address.bind:
                sub.bind(address.endpoint)
            else:
                sub.connect(address.endpoint)
        except zmq.ZMQError as exc:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            how = "bind" if address.bind else "connect to"
            raise ConfigError(f"{name}: cannot {how} {address.endpoint!r}: {exc}") from None
        self._endpoints[name] = resolved(sub, address.endpoint)
        self._subs[name] = sub
        self._by_socket[sub] = name
        self._monitors[name] = monitor
        self._by_monitor[monitor] = name
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _close(self, name: str) -> None:
        sub = self._subs.pop(name)
        monitor = self._monitors.pop(name)
        for sock in (sub, monitor):
            self._poller.unregister(sock)
        del self._by_socket[sub]
        del self._by_monitor[monitor]
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)

    def _reopen(self, name: str) -> None:
        """A new SUB socket for ``name`` (its index and seqs kept), connected again."""
        self._close(name)
        try:
            self._open(name, self._addresses[name])
        except ConfigError as exc:  # cannot happen for an address that connected before
            self._fail(name, "internal", exc)

    def _unfollow(self, name: str) -> None:
        if self._addresses.pop(name, None) is None:
            return
        self._feeds.pop(name, None)
        self._endpoints.pop(name, None)
        self._topics.pop(name, None)
        self._last_batch.pop(name, None)
        self._reconnections.pop(name, None)
        self._no_replay_until.pop(name, None)
        self._reconnected.pop(name, None)
        self._index.drop(name)
        if name in self._subs:
            self._close(name)
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
            watched = self._by_monitor.get(sock)
            if watched is not None:
                self._watch_connections(watched)
                continue
            name = self._by_socket.get(sock)
            for _ in range(self._queue_messages):  # then the other replicas get their turn
                # unfollowed or reopened while its messages were read: the rest waits
                sub = None if name is None else self._subs.get(name)
                if name is None or sub is None or sub is not sock:
                    break
                self._watch_connections(name)
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):
                    break
                applied += self._on_live(name, frames)
        return applied

    def _watch_connections(self, name: str) -> None:
        """Note a (re)connection of ``name``'s SUB socket reported by its monitor; after a
        disconnection of a socket that connects, connect again on a new socket."""
        monitor = self._monitors.get(name)
        while monitor is not None:
            try:
                event = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                if not self._addresses[name].bind:
                    self._reopen(name)
                    self._reconnections[name] = self._reconnections.get(name, 0) + 1
                    return
            else:
                self._reconnected[name] = True

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
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ + 1:
            raise UsageError(f"seq must be an int from 0 to 2**63, got {seq!r}")
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
        quiet_since = float("-inf")  # catch up first
        while not self._stop.is_set():
            self._heartbeat = time.monotonic()
            try:
                applied = self.poll(min(0.05, every))
                now = time.monotonic()
                if applied == 0 and now - quiet_since >= every:
                    applied = self.catch_up()
                    quiet_since = now
                elif applied:
                    quiet_since = now
            except Exception as exc:  # the thread serves every replica: it goes on
                self._fail("", "internal", exc)
                applied = 0
                self._stop.wait(0.05)
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
        for sub in self._subs.values():
            sub.disable_monitor()
        for sock in (*self._monitors.values(), *self._subs.values(), *self._dealers.values()):
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
    def _fail(self, name: str, kind: ErrorKind, exc: Exception) -> None:
        self._errors += 1
        self._error_counts[(name, kind)] += 1
        if self._on_error is not None:
            try:
                self._on_error(name, exc)
            except Exception:  # the callback's own mistake must not stop the thread
                self._error_counts[(name, "internal")] += 1

    def _topic_ok(self, name: str, topic: str) -> bool:
        """Whether ``topic`` is ``name``'s (the first one seen is kept, unless configured)."""
        kept = self._topics.get(name)
        if kept is None:
            self._topics[name] = topic
            return True
        if topic == kept:
            return True
        self._fail(name, "topic", KVEventFormatError(f"topic {topic!r} is not {kept!r}"))
        return False

    def _on_live(self, name: str, frames: list[bytes]) -> int:
        try:
            topic, seq, payload = parse_live_frames(frames)
        except KVEventFormatError as exc:
            self._fail(name, "frame", exc)
            return 0
        if seq > MAX_SEQ:
            self._fail(name, "seq", KVEventFormatError(f"live seq {seq} is past 2**63-1"))
            return 0
        if not self._topic_ok(name, topic):
            return 0
        try:
            batch = decode_batch(payload)
        except KVEventFormatError as exc:
            self._fail(name, "decode", exc)
            return 0
        feed = self._feeds[name]
        last = feed.last_live
        if last is not None and seq <= last:
            self._watch_connections(name)
            if not self._reconnected[name]:  # the same connection went back: an old message
                self._fail(name, "seq", KVEventFormatError(f"live seq {seq} after {last}"))
                return 0
        self._reconnected[name] = False
        applied = 0
        start = feed.observe_live(seq)
        if start is not None:
            applied += self._replay(name, start)
            if self._feeds.get(name) is not feed:
                return applied
        applied += self._accept(name, feed, seq, batch)
        return applied

    def _accept(self, name: str, feed: ReplicaFeed, seq: int, batch: WireBatch) -> int:
        try:
            accepted = feed.accept(seq, batch)
        except Exception as exc:  # the index refused it part-way: skipped, counted
            self._fail(name, "apply", exc)
            return 0
        if accepted:
            self._last_batch[name] = time.monotonic()
        return int(accepted)

    def _dealer(self, name: str) -> zmq.Socket[bytes] | None:
        endpoint = self._addresses[name].replay_endpoint
        if endpoint is None:
            return None
        sock = self._dealers.get(name)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sock.setsockopt(zmq.RCVHWM, self._queue_messages)
            sock.connect(endpoint)
            self._dealers[name] = sock
        return sock

    def _drop_dealer(self, name: str) -> None:
        """Close ``name``'s replay socket, so that what is left of an answer cannot mix with
        the next one; no replay is asked of ``name`` for ``replay_backoff_s``."""
        self._no_replay_until[name] = time.monotonic() + self._replay_backoff_s
        sock = self._dealers.pop(name, None)
        if sock is not None:
            sock.close(linger=0)

    def _replay(self, name: str, start: int) -> int:
        """Request batches from ``start`` and apply them until seq -1 arrives; ask again
        from where an answer stopped while answers bring new batches (a publisher may bound
        its answers, as `KVEventPublisher` does). The whole replay takes at most
        ``replay_budget_s``."""
        applied = 0
        now = time.monotonic()
        if now < self._no_replay_until.get(name, 0.0):
            return 0
        deadline = now + self._replay_budget_s
        for _ in range(_MAX_REPLAY_ROUNDS):
            if start > MAX_SEQ:
                break
            got = self._replay_once(name, start, deadline)
            applied += got
            feed = self._feeds.get(name)
            cut = time.monotonic() < self._no_replay_until.get(name, 0.0)
            if got == 0 or feed is None or cut or time.monotonic() >= deadline:
                break
            start = feed.next_seq
        return applied

    def _replay_once(self, name: str, start: int, deadline: float) -> int:
        sock = self._dealer(name)
        if sock is None:
            return 0
        feed = self._feeds[name]
        sock.send_multipart((b"", start.to_bytes(_SEQ_BYTES, "big")))
        applied = frames_in = bytes_in = 0
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self._drop_dealer(name)
                self._fail(name, "replay_bound", TimeoutError(
                    f"replay from {start}: {self._replay_budget_s} s budget spent"))  # fmt: skip
                return applied
            if not sock.poll(min(self._replay_timeout_ms, left_ms)):
                self._drop_dealer(name)
                if self._replay_timeout_ms < left_ms:
                    why = f"no reply in {self._replay_timeout_ms} ms"
                    self._fail(name, "replay_timeout", TimeoutError(f"replay from {start}: {why}"))
                else:
                    why = f"{self._replay_budget_s} s budget spent"
                    self._fail(name, "replay_bound", TimeoutError(f"replay from {start}: {why}"))
                return applied
            frames = sock.recv_multipart()
            frames_in += 1
            bytes_in += sum(len(f) for f in frames)
            if frames_in > self._replay_max_frames or bytes_in > self._replay_max_bytes:
                self._drop_dealer(name)
                self._fail(name, "replay_bound", KVEventFormatError(
                    f"replay from {start}: more than {self._replay_max_frames} replies or "
                    f"{self._replay_max_bytes} bytes"))  # fmt: skip
                return applied
            try:
                topic, seq, payload = parse_replay_frames(frames)
            except KVEventFormatError as exc:
                self._fail(name, "frame", exc)
                continue
            if seq == END_SEQ:
                return applied
            if not 0 <= seq <= MAX_SEQ:
                self._fail(name, "seq", KVEventFormatError(f"replayed seq {seq} out of range"))
                continue
            if topic is not None and not self._topic_ok(name, topic):
                continue
            try:
                batch = decode_batch(payload)
            except KVEventFormatError as exc:
                self._fail(name, "decode", exc)
                continue
            applied += self._accept(name, feed, seq, batch)
