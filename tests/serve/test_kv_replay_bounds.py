"""The replay socket's work is bounded: per request, per second, and never ahead of the live
stream, so a replay flood cannot stop live events (a flood of 900k requests in 20 s once
stopped them for its whole duration). Real sockets on 127.0.0.1; the flood runs in a process of
its own, as an attacker on the host would."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from prefixflight.core.cache import AllBlocksCleared, BlockStored
from prefixflight.serve.kv_events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    decode_batch,
)
from prefixflight.serve.kv_events._wire import parse_replay_frames

zmq = pytest.importorskip("zmq")
LOOPBACK = "tcp://127.0.0.1:*"
SEQ0 = (0).to_bytes(8, "big")


@contextmanager
def _publisher(**kw: object) -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, **kw)  # type: ignore[arg-type]
    try:
        yield pub
    finally:
        pub.close()


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=(i + 1,), parent_block_hash=None, block_size=64, token_ids=tuple(range(64))
    )


def _fill(pub: KVEventPublisher, batches: int) -> None:
    for i in range(batches):
        pub(_stored(i))
        pub.flush()
    assert pub.drain(30.0) and pub.next_seq == batches


def test_one_replay_answer_is_bounded_and_a_late_subscriber_still_gets_everything() -> None:
    with _publisher(replay_max_batches=10) as pub:
        _fill(pub, 35)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart((b"", (3).to_bytes(8, "big")))
            seqs = []
            while True:
                assert dealer.poll(10_000), "no answer"
                _, seq, _ = parse_replay_frames(dealer.recv_multipart())
                if seq == -1:
                    break
                seqs.append(seq)
            assert seqs == list(range(3, 13))  # ten, from the seq asked for
        finally:
            dealer.close(linger=0)
        with KVEventSubscriber({"r": PublisherAddress(pub.endpoint, pub.replay_endpoint)}) as sub:
            assert sub.catch_up() == 35  # four answers, asked for one after the other
            assert sub.feeds["r"].lost == 0 and len(sub.index.replica("r")) == 35


_FLOOD = """
import sys, time, zmq
endpoint, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(8)]
for s in socks:
    s.connect(endpoint)
zero = (0).to_bytes(8, "big")
sent, end = 0, time.monotonic() + seconds
print("flooding", flush=True)
while time.monotonic() < end:
    for s in socks:
        try:
            s.send_multipart((b"", zero), zmq.NOBLOCK)  # never reads an answer
            sent += 1
        except zmq.Again:
            pass
print(sent, flush=True)
"""


def test_live_events_keep_flowing_under_a_replay_flood() -> None:
    rate = 5000.0
    with _publisher(replay_batches_per_s=rate, replay_max_batches=1000) as pub:
        _fill(pub, 2000)  # every request from seq 0 asks for all of them
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        flood = subprocess.Popen(
            [sys.executable, "-c", _FLOOD, str(pub.replay_endpoint), "60"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline() == "flooding\n"
            deadline = time.monotonic() + 30
            while pub.replayed == 0:  # the flood has reached the publisher
                assert time.monotonic() < deadline, "the flood never arrived"
                assert flood.poll() is None
                pub(AllBlocksCleared())  # warms the live subscription up meanwhile
                pub.flush()
                if sub.poll(10):
                    sub.recv_multipart()
            while sub.poll(0):
                sub.recv_multipart()
            started, replayed_before = time.monotonic(), pub.replayed
            delays: list[float] = []
            i = -1
            while time.monotonic() - started < 2.0:  # two seconds of live batches, each
                i += 1  # arriving before the next is published
                pub(_stored(10_000 + i))
                pub.flush()
                sent = time.monotonic()
                while True:
                    assert sub.poll(2000), f"live batch {i} did not arrive within 2 s"
                    frames = sub.recv_multipart()
                    (event,) = decode_batch(frames[2]).events
                    if getattr(event, "block_hashes", None) == (10_001 + i,):
                        break
                delays.append(time.monotonic() - sent)
            elapsed = time.monotonic() - started
            replayed = pub.replayed - replayed_before
            assert flood.poll() is None, "the flood stopped before the measurement did"
        finally:
            flood.kill()
            flood.wait(10)
            assert flood.stdout is not None
            flood.stdout.close()
            sub.close(linger=0)
    print(f"flood: {replayed} batches replayed in {elapsed:.2f} s; live delays max "
          f"{max(delays) * 1000:.1f} ms")  # fmt: skip
    assert max(delays) < 1.0, delays
    assert replayed > 0, "the flood was not being answered during the measurement"
    # the per-second bound (one request's answer of slack on either side)
    assert replayed <= rate * elapsed + 2 * 1000, (replayed, elapsed)
