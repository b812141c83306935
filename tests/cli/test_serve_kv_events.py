"""``prefixflight serve``'s KV-event flags: vLLM's bind-or-connect rule, said out loud at start,
loopback by default, the encoding and token-id switches (their mistakes are with the other flag
mistakes in test_serve_cmd.py).

The publisher is built by the command's own `kv_publisher` (no model loads); subscribers are
plain ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import msgspec
import pytest

from prefixflight.cli._main import build_parser
from prefixflight.cli._serve_cmd import kv_events_banner, kv_publisher
from prefixflight.core import LRU, BlockHasher, PrefixCache

zmq = pytest.importorskip("zmq")


def _publish_one(pub: object) -> None:
    hasher = BlockHasher(block_size=4)
    toks = list(range(8))
    PrefixCache(LRU(8), block_size=4, event_sink=pub).publish(  # type: ignore[arg-type]
        hasher.hash_tokens(toks), token_ids=toks
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--kv-events", "--kv-events-replay"],  # alone: tcp://127.0.0.1:*
        ["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"],
    ],
)
def test_free_loopback_ports_are_bound_and_printed(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["serve", *flags])
    pub = kv_publisher(args, "m")
    try:
        err = capsys.readouterr().err.splitlines()
        assert pub.binds
        live = re.fullmatch(
            r"prefixflight serve: KV events \(map encoding, token ids on\) bound at "
            r"(tcp://127\.0\.0\.1:\d+): subscribers connect there",
            err[0],
        )
        replay = re.fullmatch(r"prefixflight serve: KV-event replay bound at (\S+)", err[1])
        assert live and replay and len(err) == 2, err  # loopback: no warning
        assert live[1] == pub.endpoint and replay[1] == pub.replay_endpoint
        assert not pub.endpoint.endswith(":*") and pub.replay_endpoint.startswith("tcp://127.")
    finally:
        pub.close()


def test_a_host_port_endpoint_connects_to_a_subscriber_that_binds_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    args = build_parser().parse_args(
        ["serve", "--kv-events", endpoint, "--kv-events-token-ids", "off"]
    )
    pub = kv_publisher(args, "m")
    try:
        (line,) = capsys.readouterr().err.splitlines()
        assert not pub.binds and pub.endpoint == endpoint
        assert line.startswith(
            f"prefixflight serve: KV events (map encoding, token ids off) connect to {endpoint} "
            "(vLLM's rule for a host:port endpoint): a subscriber must bind there"
        )
        frames: list[bytes] = []
        deadline = time.monotonic() + 10
        while not frames and time.monotonic() < deadline:  # until the connection is up
            _publish_one(pub)
            pub.flush()
            if sub.poll(100):
                frames = sub.recv_multipart()
        assert frames, "the bound subscriber received nothing"
        (stored, *_) = msgspec.msgpack.decode(frames[2])[1]
        assert stored["type"] == "BlockStored" and stored["token_ids"] == []  # tokens off
        assert len(stored["block_hashes"]) == 2
    finally:
        pub.close()
        sub.close(linger=0)


def test_the_banner_warns_when_bound_sockets_leave_the_host_with_token_ids() -> None:
    def banner(endpoint: str, binds: bool, replay: str | None, token_ids: str) -> list[str]:
        pub = SimpleNamespace(endpoint=endpoint, binds=binds, replay_endpoint=replay)
        return kv_events_banner(pub, "map", token_ids)

    (*_, warning) = banner("tcp://*:5557", True, "tcp://0.0.0.0:5558", "on")
    assert warning.startswith("warning: tcp://*:5557 and tcp://0.0.0.0:5558 can be reached")
    assert "every tenant's token ids" in warning
    assert len(banner("tcp://*:5557", True, None, "off")) == 1  # no token ids, no warning
    assert len(banner("ipc:///run/kv", True, "tcp://[::1]:5558", "on")) == 2  # local only
    # a connected endpoint sends to the peer it names: nothing is exposed here
    (line,) = banner("tcp://10.0.0.5:5557", False, None, "on")
    assert "connect to tcp://10.0.0.5:5557" in line
