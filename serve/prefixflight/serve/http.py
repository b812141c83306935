"""An OpenAI-compatible HTTP server over an `AsyncEngine` (FastAPI + uvicorn).

This module assembles the app: the routes (`prefixflight.serve._routes`, one `APIRouter`
whose request and response models are also its OpenAPI schema, ``GET /openapi.json``), the
limits in front of them (API keys, body size and time: `prefixflight.serve._limits`),
OpenAI-style errors for everything, and `serve`, which runs the app on uvicorn with header,
idle and write timeouts and a graceful shutdown on SIGINT/SIGTERM. The request's life
(checks, admission, streaming, disconnects) is `prefixflight.serve._server`. The engine owns
scheduling, caching and single flight; a `Codec` owns text. ``prefixflight serve`` builds
all three and calls `serve`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``,
``GET /openapi.json``. docs/serve.md lists the parameters, limits, and every difference from
OpenAI's API and vLLM's server.

The engine runs on the event loop that serves HTTP (it starts on the first request and is
closed when the server shuts down); text is encoded and decoded in a thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ._limits import ApiKeys, BodyLimits, GracefulServer
from ._routes import message_of, openapi_schema, router
from ._server import ApiError, Server, ServerConfig, error_body
from ._text import CharCodec, Codec, HFCodec

if TYPE_CHECKING:
    from prefixflight.backends.torch import AsyncEngine

__all__ = [
    "CharCodec",
    "Codec",
    "HFCodec",
    "ServerConfig",
    "build_app",
    "serve",
    "uvicorn_server",
]

_log = logging.getLogger("prefixflight.serve")


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.kind, err.param),
        status_code=err.status,
        headers=err.headers,
    )


def build_app(engine: AsyncEngine, codec: Codec, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine is closed when the app shuts down."""
    server = Server(engine, codec, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await engine.close()
            server.close_text_thread()

    app = FastAPI(
        title="prefixflight",
        summary="An OpenAI-compatible server over prefixflight's engine",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server
    app.include_router(router)
    app.add_middleware(BodyLimits, max_bytes=config.max_body_bytes, timeout=config.client_timeout)
    if config.api_keys:
        app.add_middleware(ApiKeys, keys=config.api_keys)  # outermost: before any body is read

    @app.exception_handler(ApiError)
    async def api_error(_r: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = message_of(exc.errors())
        return _error_response(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_r: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = ApiError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        return _error_response(error)

    @app.exception_handler(Exception)
    async def crashed(_r: Request, exc: Exception) -> JSONResponse:
        _log.error("unexpected error in a request", exc_info=exc)
        return _error_response(
            ApiError(500, f"internal server error ({type(exc).__name__})", "server_error")
        )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version="1", summary=app.summary, routes=app.routes
            )
            app.openapi_schema = openapi_schema(schema, keys_required=bool(config.api_keys))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class _Stop(Exception):
    """SIGTERM, after the graceful shutdown: leave `serve` normally."""


@contextlib.contextmanager
def _sigterm_returns() -> Iterator[None]:
    """uvicorn re-raises the signal it shut down for once it is done: SIGINT is a
    KeyboardInterrupt, SIGTERM (whose default kills the process) is made a `_Stop`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_sig: int, _frame: Any) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with contextlib.suppress(KeyboardInterrupt, _Stop):
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def uvicorn_server(app: FastAPI, *, log_level: str = "warning", access_log: bool = False) -> Any:
    """The uvicorn server `serve` runs ``app`` (from `build_app`) on: uvicorn's httptools
    protocol with a deadline for request headers, the app's keep-alive timeout, and a shutdown
    that drains (`Server.drain`). Run it with ``await server.serve(sockets=[sock])``."""
    state: Server = app.state.server
    return GracefulServer.for_app(
        app,
        state.drain,
        client_timeout=state.config.client_timeout,
        keep_alive_timeout=state.config.keep_alive_timeout,
        log_level=log_level,
        access_log=access_log,
    )


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    access_log: bool = False,
) -> None:
    """Serve ``app`` (from `build_app`) on an already bound socket until SIGINT or SIGTERM,
    then shut down gracefully and return normally: stop accepting, give the requests in
    progress ``shutdown_timeout`` seconds, fail the rest (streams end with an error event
    and ``[DONE]``), close the engine. A second Ctrl-C stops at once."""
    server = uvicorn_server(app, log_level=log_level, access_log=access_log)
    with _sigterm_returns():
        server.serve_on(sock)
