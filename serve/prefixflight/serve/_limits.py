"""What the server refuses before a route runs, and how it stops.

- `ApiKeys`: ``Authorization: Bearer KEY`` on every route but the probes; a request
  without a valid key gets 401 before its body is read (vLLM's server checks in a
  middleware too). The key's tenant goes to the routes in ``request.state.tenant``.
- `BodyLimits`: a request body larger than the limit gets 413 (at once when its
  ``Content-Length`` says so, else when the bytes read pass the limit), and a body that
  stops arriving gets 408 after the client timeout. Starlette's own
  ``RequestBodyLimitMiddleware`` answers 413 in plain text; this server's errors are JSON.
- `HeaderDeadline`: uvicorn's httptools protocol with a deadline for a request's headers (and
  a 16 KiB limit on them): a connection that sends no complete request within the client
  timeout is closed (uvicorn times out idle keep-alive connections only after a first
  response; a client that connects and sends nothing, or headers a byte at a time, held its
  connection forever).
- `GracefulServer`: uvicorn's server, whose shutdown first stops accepting, then lets the
  requests in progress finish for up to the shutdown timeout, then fails the rest (their
  streams end with an error event and ``[DONE]``) before uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, final

import uvicorn
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["PUBLIC_PATHS", "ApiKeys", "BodyLimits", "GracefulServer", "HeaderDeadline"]

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
"""Routes that need no API key: the probes a load balancer and a scraper call, and the
schema."""


async def _send_error(send: Send, status: int, message: str, kind: str, **headers: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        separators=(",", ":"),
    ).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@final
class ApiKeys:
    """401 unless ``Authorization: Bearer KEY`` names a known key; its tenant (or None) is
    ``request.state.tenant``.

    Keys are looked up by their SHA-256 digest, so how long a lookup takes says nothing
    about how close a guess was to a real key."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, str | None]) -> None:
        self.app = app
        self._tenants = {_digest(k): t for k, t in keys.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, key = header.partition(" ")
        found = key and scheme.lower() == "bearer"
        digest = _digest(key.strip()) if found else b""
        if digest not in self._tenants:
            await _send_error(
                send,
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                "authentication_error",
                **{"WWW-Authenticate": "Bearer"},
            )
            return
        scope.setdefault("state", {})["tenant"] = self._tenants[digest]
        await self.app(scope, receive, send)


@final
class BodyLimits:
    """413 past ``max_bytes`` of request body, 408 when the body stalls for ``timeout``."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(
                send,
                413,
                f"the request body is {int(declared)} bytes; the limit is {limit}",
                "invalid_request_error",
                Connection="close",
            )
            return
        read = 0
        complete = False
        timeout = self.timeout

        async def limited() -> Message:
            nonlocal read, complete
            if complete:  # the body is in: later calls wait for a disconnect, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except asyncio.TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body stopped arriving (nothing for {timeout:g} s)",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise HTTPException(
                        413,
                        f"the request body is over the limit of {limit} bytes",
                        headers={"Connection": "close"},
                    )
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited, send)


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol (C-accelerated parsing), closing a connection whose
    request headers are not complete within `header_timeout` seconds of its start or of the
    previous response."""

    header_timeout: ClassVar[float] = 30.0
    max_head_bytes: ClassVar[int] = 16 * 1024
    """The most bytes of a request line and headers (h11's limit, which uvicorn's h11
    protocol enforced; httptools has none): a longer head is a 400 and the connection
    closes, so an incomplete head holds at most this plus one read."""

    _header_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # read since the head began (an upper bound: a read may hold a body too)
    _parsed = 0  # of the request line and headers, as parsed

    @classmethod
    def with_timeout(cls, seconds: float) -> type[HeaderDeadline]:
        return type("HeaderDeadline", (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_headers() and self._head_bytes > self.max_head_bytes:
            self._refuse_head()  # an incomplete head over the limit: stop buffering it

    def on_message_begin(self) -> None:
        self._parsed = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self.transport.is_closing():  # one answer per connection
            super().send_400_response(msg)

    def _count(self, n: int) -> None:
        """A complete head that arrived in one read is counted as it is parsed."""
        self._parsed += n
        if self._parsed > self.max_head_bytes:
            self._refuse_head()
            raise ValueError("request headers over the limit")  # stops the parser

    def _refuse_head(self) -> None:
        self.send_400_response(f"Request headers over the limit of {self.max_head_bytes} bytes.")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting_headers():
            self._head_bytes = 0
            self._arm()  # the next request's headers

    def _awaiting_headers(self) -> bool:
        """No request whose headers are complete is in progress (a pipelined one may be)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown drains: stop accepting, ``await drain()`` (the app
    finishes or fails what is in progress, bounded), then uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(config)
        self._drain = drain

    @classmethod
    def for_app(
        cls,
        app: Any,
        drain: Callable[[], Awaitable[Any]],
        *,
        client_timeout: float,
        keep_alive_timeout: float,
        log_level: str,
        access_log: bool,
    ) -> GracefulServer:
        """``app`` on uvicorn's httptools protocol with a deadline of ``client_timeout`` for request
        headers, the keep-alive timeout, and a shutdown that drains (bounded by uvicorn's
        graceful timeout, ``client_timeout`` too)."""
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=access_log,
            http=HeaderDeadline.with_timeout(client_timeout),
            timeout_keep_alive=max(1, round(keep_alive_timeout)),
            timeout_graceful_shutdown=max(1, round(client_timeout)),
            lifespan="on",
        )
        return cls(config, drain)

    def serve_on(self, sock: socket.socket) -> None:
        """Serve on an already bound socket until the server stops, on uvloop where it is
        installed (its event loop costs less CPU per request than asyncio's)."""
        try:
            import uvloop
        except ImportError:  # an optional speed-up (not on Windows)
            asyncio.run(self.serve(sockets=[sock]))
        else:
            uvloop.run(self.serve(sockets=[sock]))

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        if not self.force_exit:
            await self._drain()
        await super().shutdown(sockets=sockets)
