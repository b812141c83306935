"""`KVEventPublisher`: a prefix cache's KV events on vLLM's ZMQ wire, as vLLM publishes them.

Multipart messages ``[topic, seq, payload]`` on a PUB socket, ``seq`` an 8-byte big-endian
count from 0, ``payload`` a msgpack ``KVEventBatch``; a ROUTER socket replays buffered
batches from a requested seq, then sends seq -1 (vLLM's ``ZmqEventPublisher``,
``vllm/distributed/kv_events.py``, 0.32). The engine thread only appends to a deque; a
background thread encodes and sends, so the engine never waits on the network.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections import deque
from types import TracebackType
from typing import Final, Literal

import zmq

from prefixflight.core import ConfigError, UsageError
from prefixflight.core.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixflight.core.validate import check_int

from ._endpoints import binds, offset_endpoint, resolved
from ._wire import END_SEQ, HashEncoding, WireEncoding, _encode, _wire_events, kv_topic

__all__ = ["KVEventPublisher"]

_SEQ_BYTES: Final = 8
_END: Final = END_SEQ.to_bytes(_SEQ_BYTES, "big", signed=True)
_STOP: Final = object()
_KV_EVENT_TUPLE: Final = (BlockStored, BlockRemoved, AllBlocksCleared)
_KV_EVENTS: Final = frozenset(_KV_EVENT_TUPLE)


class KVEventPublisher:
    """Publishes a cache's KV events as vLLM does (see the module docstring).

    ``endpoint``: the PUB address, bound or connected by vLLM's rule: bound when it holds
    ``*`` or ``::`` or is ``ipc://`` / ``inproc://`` (and, here, when its TCP port is 0),
    connected otherwise, so ``tcp://127.0.0.1:5557`` connects to a subscriber that binds
    there. ``tcp://127.0.0.1:*`` binds a free loopback port: read `endpoint` back.
    ``replay_endpoint``: the ROUTER address (always bound), or ``None`` for no replay.
    ``topic`` defaults to ``kv@<hostname>@prefixflight``; give ``kv_topic(pod, model)`` so
    llm-d's indexer files the events under the right pod and model. ``buffer_steps``:
    batches kept for replay.

    Batching: the events since the last `flush` form one ``KVEventBatch`` (call `flush` once
    per engine step, as vLLM publishes once per scheduler step); pending events also go out
    after ``max_delay_s`` or once ``max_batch_events`` accumulate, so a host that never
    flushes still publishes. Calling the publisher only appends to a deque (no lock); a
    background thread encodes, numbers, sends and answers replay requests. When its queue
    (``max_queue_batches``) is full, events stay pending and join the next batch: none is
    dropped and the caller never blocks.

    Wire: ``encoding="map"`` (vLLM 0.32's form, the default) or ``"array"`` (positional,
    vLLM before PR #42892 and older llm-d). `BlockHasher`'s 32-byte sha256 digests go out as
    vLLM's default int form (their last 8 bytes, big-endian) with ``hash_encoding="int"``,
    or whole with ``"bytes"``; its crc32x2 ints go out unchanged. ``token_ids=False`` sends
    every ``BlockStored`` without its tokens: the events then reveal which blocks are cached,
    never what they hold.

    Replay: the live stream always goes first. One replay request gets at most
    ``replay_max_batches`` batches (a subscriber asks again from where the answer stopped),
    and replay requests are answered at ``replay_batches_per_s`` batches per second at most
    (each request counts one more); requests beyond that wait in the socket, where ZMQ's
    receive limit drops a flood.
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
        encoding: WireEncoding = "map",
        token_ids: bool = True,
        max_delay_s: float = 0.05,
        max_batch_events: int = 4096,
        max_queue_batches: int = 100_000,
        hwm: int = 100_000,
        replay_max_batches: int = 1000,
        replay_batches_per_s: float = 10_000.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigError(f"endpoint must be a ZMQ address like tcp://*:5557, got {endpoint!r}")
        if replay_endpoint is not None and (
            not isinstance(replay_endpoint, str) or "://" not in replay_endpoint
        ):
            raise ConfigError(f"replay_endpoint must be a ZMQ address, got {replay_endpoint!r}")
        check_int("data_parallel_rank", data_parallel_rank, minimum=0)
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("max_batch_events", max_batch_events),
            ("max_queue_batches", max_queue_batches),
            ("hwm", hwm),
            ("replay_max_batches", replay_max_batches),
        ):
            check_int(name, value, minimum=1)
        if medium not in ("GPU", "CPU"):
            raise ConfigError(f"medium must be 'GPU' or 'CPU', got {medium!r}")
        if hash_encoding not in ("int", "bytes"):
            raise ConfigError(f"hash_encoding must be 'int' or 'bytes', got {hash_encoding!r}")
        if encoding not in ("map", "array"):
            raise ConfigError(f"encoding must be 'map' or 'array', got {encoding!r}")
        if not isinstance(token_ids, bool):
            raise ConfigError(f"token_ids must be a bool, got {token_ids!r}")
        for name, number in (
            ("max_delay_s", max_delay_s),
            ("replay_batches_per_s", replay_batches_per_s),
        ):
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise ConfigError(f"{name} must be a number > 0, got {number!r}")
            if not number > 0:
                raise ConfigError(f"{name} must be a number > 0, got {number!r}")
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
        self._token_ids = token_ids
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
        # the replay budget, a token bucket in batches (the thread's own)
        self._replay_max = replay_max_batches
        self._replay_rate = float(replay_batches_per_s)
        self._replay_tokens = float(replay_max_batches)
        self._replay_refilled = time.monotonic()
        self._replayed = 0  # batches sent in replay answers; guarded by _sent

        ctx = zmq.Context.instance() if context is None else context
        pub_ep = offset_endpoint(endpoint, data_parallel_rank)
        replay_ep = None
        if replay_endpoint is not None:
            replay_ep = offset_endpoint(replay_endpoint, data_parallel_rank)
        self._binds = binds(pub_ep)
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            if self._binds:
                self._pub.bind(pub_ep)
            else:
                self._pub.connect(pub_ep)
            self._endpoint = resolved(self._pub, pub_ep)
            self._replay_endpoint: str | None = None
            if replay_ep is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_ep)
                self._replay_endpoint = resolved(self._replay, replay_ep)
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
    def binds(self) -> bool:
        """Whether the PUB socket is bound (subscribers connect to `endpoint`) or connected
        (a subscriber must bind `endpoint`)."""
        return self._binds

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER address in use, or ``None`` without replay."""
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def encoding(self) -> WireEncoding:
        return self._encoding

    @property
    def token_ids(self) -> bool:
        """Whether ``BlockStored`` events carry their token ids."""
        return self._token_ids

    @property
    def next_seq(self) -> int:
        """The number the next batch sent will carry (batches ``0 .. next_seq-1`` are out)."""
        with self._sent:
            return self._next_seq

    @property
    def replayed(self) -> int:
        """Batches sent in answers to replay requests so far."""
        with self._sent:
            return self._replayed

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
        """Close the current batch: its events go out as one ``KVEventBatch`` (none if
        empty)."""
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
                items = [self._queue.get(timeout=tick)]
            except queue.Empty:
                items = []
            while True:  # the live stream first: everything flushed so far
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _STOP:
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
        structs = _wire_events(
            events,
            self._encoding,
            self._medium,
            self._lora_name,
            self._hash_encoding,
            self._token_ids,
        )
        payload = _encode(ts, structs, self._rank)
        with self._sent:
            seq = self._next_seq
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(_SEQ_BYTES, "big"), payload))
        self._buffer.append((seq, payload))
        with self._sent:
            self._next_seq = seq + 1
            self._sent.notify_all()

    def _serve_replay(self) -> None:
        """Answer waiting replay requests while the budget lasts (see the class docstring)."""
        sock = self._replay
        if sock is None:
            return
        now = time.monotonic()
        self._replay_tokens = min(
            float(self._replay_max),
            self._replay_tokens + (now - self._replay_refilled) * self._replay_rate,
        )
        self._replay_refilled = now
        while self._replay_tokens > 0 and sock.poll(0):
            frames = sock.recv_multipart()
            self._replay_tokens -= 1
            if len(frames) != 3 or len(frames[2]) != _SEQ_BYTES:
                continue  # not a replay request (vLLM logs and drops these too)
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            # this thread is the buffer's only writer, and its seqs are consecutive
            buffer = self._buffer
            first = max(0, start - buffer[0][0]) if buffer else 0
            sent = 0
            for seq, payload in itertools.islice(buffer, first, first + self._replay_max):
                sock.send_multipart(
                    (client, b"", self._topic_bytes, seq.to_bytes(_SEQ_BYTES, "big"), payload)
                )
                sent += 1
            sock.send_multipart((client, b"", b"", _END, b""))
            self._replay_tokens -= sent
            with self._sent:
                self._replayed += sent
