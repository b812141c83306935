"""KV events on vLLM's wire: publish a `PrefixCache`'s events over ZMQ, follow publishers.

`KVEventPublisher` is a `prefixflight.core.cache.EventSink`: give it to ``PrefixCache(event_sink=)``
(or to the engine) and it publishes the cache's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` as vLLM's ``ZmqEventPublisher`` does (vllm-project/vllm,
``vllm/distributed/kv_events.py`` at commit 0181ea31): multipart messages ``[topic, seq,
payload]`` on a PUB socket, ``seq`` an 8-byte big-endian count from 0, ``payload`` a msgpack
``EventBatch``; a ROUTER socket replays buffered batches from a requested seq, then sends
seq -1. The engine thread only appends to a deque; a background thread encodes and sends,
so the engine never waits on the network.

`KVEventSubscriber` follows one or more publishers (ours or vLLM's), each named by a replica
id, recovers missed batches through their replay sockets, and keeps a `ClusterBlockIndex`
that ``ApproxPrefixRouter(index=...)`` reads. The wire format is in `_kv_wire`, the indexes
in `_kv_index` (both pure); this module owns the sockets and the threads.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Final, Literal

import attrs
import zmq

from prefixflight.core import BlockHash, BlockHasher, ConfigError, UsageError
from prefixflight.core._validate import assert_never
from prefixflight.core.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

from ._kv_index import ClusterBlockIndex, IndexStats, ReplicaBlockIndex, ReplicaFeed
from ._kv_wire import (
    END_SEQ,
    HashEncoding,
    KVEventFormatError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEncoding,
    WireEvent,
    WireHash,
    decode_batch,
    encode_batch,
    fold_hash,
    kv_topic,
    parse_live_frames,
    parse_replay_frames,
    parse_topic,
    to_wire_hash,
)

__all__ = [
    "END_SEQ",
    "ClusterBlockIndex",
    "HashEncoding",
    "IndexStats",
    "KVEventFormatError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "PublisherAddress",
    "ReplicaBlockIndex",
    "ReplicaFeed",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEncoding",
    "WireEvent",
    "WireHash",
    "decode_batch",
    "encode_batch",
    "fold_hash",
    "kv_topic",
    "offset_endpoint",
    "parse_live_frames",
    "parse_replay_frames",
    "parse_topic",
    "to_wire_hash",
    "wire_events",
]

_SEQ_BYTES: Final = 8
_END: Final = END_SEQ.to_bytes(_SEQ_BYTES, "big", signed=True)
_STOP: Final = object()
_KV_EVENT_TUPLE: Final = (BlockStored, BlockRemoved, AllBlocksCleared)
_KV_EVENTS: Final = frozenset(_KV_EVENT_TUPLE)


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``, as vLLM derives it: a TCP
    port goes up by the rank, an inproc/ipc name gets ``_dp<rank>``; rank 0 keeps it."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ConfigError(
        f"cannot offset endpoint {endpoint!r} by data_parallel_rank {data_parallel_rank}: "
        "give a tcp://host:PORT, ipc:// or inproc:// endpoint"
    )


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcards and local transports, connect to anything else."""
    return (
        "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    )


def _folder(hash_encoding: HashEncoding) -> Callable[[BlockHash], WireHash]:
    """`to_wire_hash` for one encoding, with the common case (a sha256 digest) inlined."""
    if hash_encoding == "bytes":
        return lambda b: b if type(b) is bytes else fold_hash(b)
    return lambda b: int.from_bytes(b[-8:], "big") if type(b) is bytes and b else fold_hash(b)


def wire_events(
    events: Iterable[KVEvent],
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    hash_encoding: HashEncoding = "int",
) -> list[WireEvent]:
    """The core's events as vLLM's, in order; consecutive stores that chain merge into one
    ``BlockStored``, as vLLM sends one per request and step. Parents always come before their
    children: a store whose block is the parent of the run before it (an engine publishing a
    request's blocks deepest first, as the scheduler does) is put in front of that run."""
    if hash_encoding not in ("int", "bytes"):
        raise UsageError(f"hash_encoding must be 'int' or 'bytes', got {hash_encoding!r}")
    fold = _folder(hash_encoding)
    out: list[WireEvent] = []
    # the open run of chained stores: its core hashes and tokens in chain order (as deques of
    # per-event pieces, so a parent can be put in front), the parent of its first block, the
    # block size and whether it carries tokens
    pieces: deque[tuple[tuple[BlockHash, ...], tuple[int, ...]]] = deque()
    parent: BlockHash | None = None
    block_size = 0
    with_tokens = False

    def close_run() -> None:
        if not pieces:
            return
        hashes = [fold(h) for bh, _ in pieces for h in bh]
        tokens = [t for _, toks in pieces for t in toks]
        out.append(
            WireBlockStored(
                block_hashes=hashes,
                parent_block_hash=None if parent is None else fold(parent),
                token_ids=tokens,
                block_size=block_size,
                medium=medium,
                lora_name=lora_name,
            )
        )
        pieces.clear()

    for ev in events:
        match ev:
            case BlockStored():
                bh = ev.block_hashes
                same = bool(pieces) and ev.block_size == block_size
                same = same and bool(ev.token_ids) == with_tokens and bool(bh)
                if same and ev.parent_block_hash == pieces[-1][0][-1]:
                    pieces.append((bh, ev.token_ids))  # the run's child
                elif same and parent is not None and bh[-1] == parent:
                    pieces.appendleft((bh, ev.token_ids))  # the run's parent
                    parent = ev.parent_block_hash
                else:
                    close_run()
                    if bh:
                        pieces.append((bh, ev.token_ids))
                    parent = ev.parent_block_hash
                    block_size = ev.block_size
                    with_tokens = bool(ev.token_ids)
            case BlockRemoved():
                close_run()
                out.append(
                    WireBlockRemoved(block_hashes=list(map(fold, ev.block_hashes)), medium=medium)
                )
            case AllBlocksCleared():
                close_run()
                out.append(WireAllBlocksCleared())
            case _:
                assert_never(ev)
    close_run()
    return out


class KVEventPublisher:
    """Publishes a cache's KV events as vLLM does (see the module docstring).

    ``endpoint``: the PUB address; bound when it holds ``*`` or ``::`` or is ipc/inproc
    (``tcp://127.0.0.1:*`` binds a free port: read `endpoint` back), connected otherwise, as
    vLLM decides. ``replay_endpoint``: the ROUTER address (always bound), or ``None`` for no
    replay. ``topic`` defaults to ``kv@<hostname>@prefixflight``; give
    ``kv_topic(pod, model)`` so llm-d's indexer files the events under the right pod and
    model. ``buffer_steps``: batches kept for replay.

    Batching: the events since the last `flush` form one ``EventBatch`` (call `flush` once
    per engine step, as vLLM publishes once per scheduler step); pending events also go out
    after ``max_delay_s`` or once ``max_batch_events`` accumulate, so a host that never
    flushes still publishes. Calling the publisher only appends to a deque (no lock); a
    background thread encodes, numbers, sends and answers replay requests. When its queue
    (``max_queue_batches``) is full, events stay pending and join the next batch: none is
    dropped and the caller never blocks.

    Hashes: `BlockHasher`'s 32-byte sha256 digests go out as vLLM's default int form (their
    last 8 bytes, big-endian) with ``hash_encoding="int"``, or whole with ``"bytes"``; its
    crc32x2 ints go out unchanged. ``encoding``: ``"array"`` (positional, vLLM's format before
    vLLM PR #42892, read by every llm-d release) or ``"map"`` (named events, after it).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str | None = None,
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        medium: Literal["GPU", "CPU"] = "GPU",
        lora_name: str | None = None,
        hash_encoding: HashEncoding = "int",
        encoding: WireEncoding = "array",
        max_delay_s: float = 0.05,
        max_batch_events: int = 4096,
        max_queue_batches: int = 100_000,
        hwm: int = 100_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigError(f"endpoint must be a ZMQ address like tcp://*:5557, got {endpoint!r}")
        if replay_endpoint is not None and (
            not isinstance(replay_endpoint, str) or "://" not in replay_endpoint
        ):
            raise ConfigError(f"replay_endpoint must be a ZMQ address, got {replay_endpoint!r}")
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int):
            raise ConfigError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        if data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("max_batch_events", max_batch_events),
            ("max_queue_batches", max_queue_batches),
            ("hwm", hwm),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if medium not in ("GPU", "CPU"):
            raise ConfigError(f"medium must be 'GPU' or 'CPU', got {medium!r}")
        if hash_encoding not in ("int", "bytes"):
            raise ConfigError(f"hash_encoding must be 'int' or 'bytes', got {hash_encoding!r}")
        if encoding not in ("array", "map"):
            raise ConfigError(f"encoding must be 'array' or 'map', got {encoding!r}")
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, (int, float)):
            raise ConfigError(f"max_delay_s must be a number > 0, got {max_delay_s!r}")
        if not max_delay_s > 0:
            raise ConfigError(f"max_delay_s must be a number > 0, got {max_delay_s!r}")
        if topic is None:
            topic = kv_topic(socket.gethostname().replace("@", "_") or "localhost", "prefixflight")
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a str, got {topic!r}")
        self._topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._medium = medium
        self._lora_name = lora_name
        self._hash_encoding: HashEncoding = hash_encoding
        self._encoding: WireEncoding = encoding
        self._max_delay = float(max_delay_s)
        self._max_batch = max_batch_events
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | object] = queue.Queue(
            maxsize=max_queue_batches
        )
        self._lock = threading.Lock()  # one flusher at a time; the sink itself takes no lock
        self._pending: deque[KVEvent] = deque()  # appends and poplefts are atomic
        self._pending_seen: float | None = None  # when the thread first saw pending events
        self._closed = False
        self._sent = threading.Condition()
        self._next_seq = 0  # next number to send; guarded by _sent
        self._queued = 0  # batches handed to the thread; guarded by _sent
        self._deferred = 0
        self._errors = 0  # guarded by _sent
        self._error: Exception | None = None

        ctx = zmq.Context.instance() if context is None else context
        pub_ep = offset_endpoint(endpoint, data_parallel_rank)
        replay_ep = None
        if replay_endpoint is not None:
            replay_ep = offset_endpoint(replay_endpoint, data_parallel_rank)
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            if _binds(pub_ep):
                self._pub.bind(pub_ep)
            else:
                self._pub.connect(pub_ep)
            self._endpoint = _last_endpoint(self._pub, pub_ep)
            self._replay_endpoint: str | None = None
            if replay_ep is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_ep)
                self._replay_endpoint = _last_endpoint(self._replay, replay_ep)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise ConfigError(f"cannot open KV-event sockets on {pub_ep!r}: {exc}") from None
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-publisher[{topic}]", daemon=True
        )
        self._thread.start()

    # -- views --------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The PUB address in use (a wildcard port resolved)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER address in use, or ``None`` without replay."""
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def next_seq(self) -> int:
        """The number the next batch sent will carry (batches ``0 .. next_seq-1`` are out)."""
        with self._sent:
            return self._next_seq

    @property
    def errors(self) -> int:
        """Batches that could not be encoded or sent (dropped before numbering), and replay
        requests that failed."""
        with self._sent:
            return self._errors

    @property
    def last_error(self) -> Exception | None:
        with self._sent:
            return self._error

    @property
    def deferred(self) -> int:
        """How many times a full queue kept events pending for the next batch."""
        return self._deferred

    # -- the sink -----------------------------------------------------------------------------
    def __call__(self, event: KVEvent) -> None:
        """Queue ``event`` for the next batch (the `EventSink` protocol); never blocks on I/O."""
        if self._closed:
            raise UsageError("the KV-event publisher is closed")
        if type(event) not in _KV_EVENTS and not isinstance(event, _KV_EVENT_TUPLE):
            raise UsageError(f"expected a KV event, got {event!r}")
        pending = self._pending
        pending.append(event)
        if len(pending) >= self._max_batch:
            self.flush()

    def flush(self) -> None:
        """Close the current batch: its events go out as one ``EventBatch`` (none if empty)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        pending = self._pending
        n = len(pending)
        if not n:
            return
        events = [pending.popleft() for _ in range(n)]  # later appends wait for the next batch
        with self._sent:
            self._queued += 1
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            with self._sent:
                self._queued -= 1
            pending.extendleft(reversed(events))  # keep them, in order: they join the next batch
            self._deferred += 1

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Flush, then wait until every batch so far is sent; ``False`` on timeout."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        with self._sent:
            while self._next_seq < self._queued:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._sent.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is pending, stop the thread, close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._pub.close(linger=int(timeout_s * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        tick = min(0.01, self._max_delay)
        while True:
            try:
                item = self._queue.get(timeout=tick)
            except queue.Empty:
                item = None
            if item is _STOP:
                while not self._queue.empty():  # anything flushed before close()
                    rest = self._queue.get_nowait()
                    if isinstance(rest, tuple):
                        self._send_or_record(*rest)
                return
            if isinstance(item, tuple):
                self._send_or_record(*item)
            try:
                self._serve_replay()
            except zmq.ZMQError as exc:
                self._record(exc)
            # the time bound: events pending for max_delay_s (as seen from here) go out
            if not self._pending:
                self._pending_seen = None
            elif self._pending_seen is None:
                self._pending_seen = time.monotonic()
            elif time.monotonic() - self._pending_seen >= self._max_delay:
                self._pending_seen = None
                self.flush()

    def _record(self, exc: Exception) -> None:
        with self._sent:
            self._errors += 1
            self._error = exc

    def _send_or_record(self, ts: float, events: list[KVEvent]) -> None:
        """Send one batch; a batch that cannot be encoded or sent is dropped *before* it is
        numbered (subscribers see no gap) and recorded in `errors` / `last_error`."""
        try:
            self._send(ts, events)
        except (UsageError, zmq.ZMQError, TypeError, ValueError, OverflowError) as exc:
            self._record(exc)
            with self._sent:
                self._queued -= 1
                self._sent.notify_all()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        batch = WireBatch(
            ts=ts,
            events=tuple(
                wire_events(
                    events,
                    medium=self._medium,
                    lora_name=self._lora_name,
                    hash_encoding=self._hash_encoding,
                )
            ),
            data_parallel_rank=self._rank,
        )
        payload = encode_batch(batch, encoding=self._encoding)
        with self._sent:
            seq = self._next_seq
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(_SEQ_BYTES, "big"), payload))
        self._buffer.append((seq, payload))
        with self._sent:
            self._next_seq = seq + 1
            self._sent.notify_all()

    def _serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != _SEQ_BYTES:
                continue  # not a replay request (vLLM logs and drops these too)
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in tuple(self._buffer):
                if seq >= start:
                    sock.send_multipart(
                        (client, b"", self._topic_bytes, seq.to_bytes(_SEQ_BYTES, "big"), payload)
                    )
            sock.send_multipart((client, b"", b"", _END, b""))


def _last_endpoint(sock: zmq.Socket[bytes], fallback: str) -> str:
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(last, bytes) and last:
        return last.decode("utf-8")
    return fallback


@attrs.frozen
class PublisherAddress:
    """Where one replica publishes: its PUB endpoint and, optionally, its replay endpoint."""

    endpoint: str
    replay_endpoint: str | None = None


def _address(
    name: object, addr: object, *, error: type[UsageError] = ConfigError
) -> PublisherAddress:
    if not isinstance(name, str) or not name:
        raise error(f"replica ids must be non-empty strs, got {name!r}")
    a = PublisherAddress(addr) if isinstance(addr, str) else addr
    if not isinstance(a, PublisherAddress):
        raise error(f"expected a PublisherAddress or an endpoint, got {addr!r}")
    return a


class KVEventSubscriber:
    """Follows KV-event publishers (ours or vLLM's) and keeps a per-replica block index.

    ``publishers`` maps a replica id to its `PublisherAddress` (or just the PUB endpoint).
    Each replica gets its own SUB socket (connected; the publisher binds), filtered by
    ``topic`` (a prefix; ``""`` takes every topic), and a DEALER socket for its replay
    endpoint. A batch whose seq skips ahead triggers a replay request from the first missing
    seq; batches the replay cannot provide (it keeps only ``buffer_steps``) are counted as
    lost in `feeds`. ``hasher``: rebuild block keys from the events' token ids (for a
    publisher whose hash seed is unknown; see `ReplicaBlockIndex`).

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
        self._addresses[name] = address
        self._feeds[name] = ReplicaFeed(self._index.replica(name))
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(address.endpoint)
        self._subs[name] = sub
        self._by_socket[sub] = name
        self._poller.register(sub, zmq.POLLIN)

    def _unfollow(self, name: str) -> None:
        if self._addresses.pop(name, None) is None:
            return
        self._feeds.pop(name, None)
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
        """Request batches from ``start`` and apply them until seq -1 arrives."""
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
