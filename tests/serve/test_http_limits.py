"""The limits in front of the routes: body size (413), a body that stops arriving (408),
connections that never send a whole request (closed), a stream nobody reads (aborted), a
client that leaves just as a chunk goes out (aborted), and text work that never blocks the
event loop. Real sockets against a real uvicorn server, except where a race needs an exact
order of events: there the ASGI server is a few lines of the test.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from .conftest import CharCodec  # noqa: E402
from .test_http import WAIT, long_completion, metrics, page_state, until, value  # noqa: E402

pytestmark = pytest.mark.torch


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (reads to EOF)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed(start_server: Any) -> None:
    small = start_server(max_body_bytes=1000)
    url = small.base_url + "/v1/completions"
    big = b'{"prompt": "' + b"x" * 2000 + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == 413 and "limit is 1000" in r.json()["error"]["message"]

    def chunks() -> Any:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 100):
            yield big[i : i + 100]

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.headers["content-type"] == "application/json"
    ok = httpx.post(url, json={"prompt": "x" * 100, "max_tokens": 1}, timeout=WAIT)
    assert ok.status_code == 200, ok.text


def test_connections_that_send_no_whole_request_are_closed(start_server: Any) -> None:
    quick = start_server(client_timeout=0.5, keep_alive_timeout=1)
    addr = ("127.0.0.1", quick.port)
    silent = [socket.create_connection(addr) for _ in range(10)]
    partial = [socket.create_connection(addr) for _ in range(10)]
    for s in partial:  # headers that never end (one byte at a time would be no different)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    try:
        assert all(closed_by_server(s, within=10) for s in silent + partial)
    finally:
        for s in silent + partial:
            s.close()
    assert httpx.get(quick.base_url + "/health").status_code == 200


def test_request_headers_over_16_kib_are_a_400_and_the_connection_closes(
    start_server: Any,
) -> None:
    server = start_server()
    addr = ("127.0.0.1", server.port)
    for size, want in ((15_000, b"HTTP/1.1 200"), (17_000, b"HTTP/1.1 400"), (8_000_000, b"")):
        with socket.create_connection(addr) as s:
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
            try:
                s.sendall(head)
            except (BrokenPipeError, ConnectionResetError):  # closed while 8 MB were sent
                assert not want
                continue
            s.settimeout(WAIT)
            answer = s.recv(65536)
            assert answer.startswith(want), (size, answer[:80])
            if want == b"HTTP/1.1 400":
                assert b"over the limit of 16384 bytes" in answer
                assert closed_by_server(s, within=WAIT)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_a_body_that_stops_arriving_is_a_408(start_server: Any) -> None:
    quick = start_server(client_timeout=0.5)
    with socket.create_connection(("127.0.0.1", quick.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        s.settimeout(10)
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert page_state(quick) == (0, 0, False)


def test_a_stream_nobody_reads_is_aborted(start_server: Any) -> None:
    quick = start_server(client_timeout=0.5, send_buffer=4096)
    before = value(metrics(quick), "vllm:request_success_total", finished_reason="abort")
    body = long_completion(8, stream=True) | {"max_tokens": 1900, "n": 8}  # ~1.6 MB of events
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        s.connect(("127.0.0.1", quick.port))
        payload = httpx.Request("POST", quick.base_url + "/v1/completions", json=body)
        raw = payload.read()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        until(
            lambda: (
                value(metrics(quick), "vllm:request_success_total", finished_reason="abort")
                == before + 8
            ),
            "the unread stream's choices to be aborted",
        )
    until(lambda: page_state(quick) == (0, 0, False), "its pages to be free")


def test_a_client_that_leaves_as_a_chunk_goes_out_still_closes_the_stream() -> None:
    """The disconnect is seen while the send of a chunk completes: the stream must stop and
    close its source (which aborts the request), not wait for the next token."""
    from prefixflight.serve._routes import EventStream

    closed = asyncio.Event()
    left = asyncio.Event()

    async def source() -> Any:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the next token, which the held engine never makes
        finally:
            closed.set()  # aclose: the server aborts the request here

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message.get("body"):
            left.set()  # the client goes away as this chunk is written
            await asyncio.sleep(0)  # the write completes one turn of the loop later

    async def serve() -> None:
        stream = EventStream(source(), write_timeout=WAIT)
        await asyncio.wait_for(stream({"type": "http"}, receive, send), WAIT)

    asyncio.run(serve())
    assert closed.is_set()


class SlowCodec(CharCodec):
    """`CharCodec`, except that encoding the text ``"SLOW"`` waits until the test says."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        if text == "SLOW":
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the codec"
        return super().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return super().decode(ids)


def test_tokenizing_a_prompt_never_blocks_the_event_loop(start_server: Any) -> None:
    codec = SlowCodec()
    srv = start_server(codec=codec)
    result: list[Any] = []

    def send() -> None:
        body = {"prompt": "SLOW", "max_tokens": 1}
        result.append(httpx.post(srv.base_url + "/v1/completions", json=body, timeout=WAIT))

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert codec.entered.wait(WAIT)
        started = time.monotonic()
        health = httpx.get(srv.base_url + "/health", timeout=5)  # while the prompt tokenizes
        assert health.status_code == 200 and time.monotonic() - started < 5
        assert health.json() == {"status": "ok"}
    finally:
        codec.release.set()
        sender.join(WAIT)
    assert result and result[0].status_code == 200, result
