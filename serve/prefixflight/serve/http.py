"""An OpenAI-compatible HTTP server over an `AsyncEngine` (FastAPI + uvicorn).

This module owns the HTTP surface: the routes and their OpenAI schemas, server-sent events,
OpenAI-style errors, admission control (a bounded number of requests in progress: 429 past
it, 503 when the engine is down), client disconnects (they abort the request, which frees
its pages), and ``/metrics``. The engine owns scheduling, caching and single flight; a
`Codec` owns text. ``prefixflight serve`` builds all three and calls `serve`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``. docs/serve.md
lists the parameters and every difference from OpenAI's API and vLLM's server.

Everything runs on the event loop that serves HTTP, which is also the loop of the engine
(the engine starts on the first request and is closed when the server shuts down).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from prefixflight.core import ConfigError, FinishReason, PrefixflightError, UsageError

from ._metrics import ServeMetrics
from ._protocol import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
    unsupported_field,
)
from ._text import Codec, HFCodec, TextStream

if TYPE_CHECKING:
    from prefixflight.backends.torch import AsyncEngine, Generation

__all__ = ["Codec", "HFCodec", "ServerConfig", "build_app", "serve"]

T = TypeVar("T")


def _check_name(_i: object, _a: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"model_name must be a non-empty str, got {value!r}")


def _at_least(name: str, minimum: int) -> Callable[[object, object, int], None]:
    def check(_i: object, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ServerConfig:
    """What the HTTP layer adds to the engine.

    - ``model_name``: the ``model`` clients name, and the ``model_name`` metrics label.
    - ``max_waiting``: requests (choices) that may wait beyond the engine's running batch
      (``max_running``); a request that would exceed ``max_running + max_waiting`` in
      progress gets 429 at once instead of queueing without bound.
    - ``chat_max_tokens`` / ``completion_max_tokens``: ``max_tokens`` when a request leaves
      it out (OpenAI's completions default is 16).
    """

    model_name: str = attrs.field(validator=_check_name)
    max_waiting: int = attrs.field(default=64, validator=_at_least("max_waiting", 0))
    chat_max_tokens: int = attrs.field(default=256, validator=_at_least("chat_max_tokens", 1))
    completion_max_tokens: int = attrs.field(
        default=16, validator=_at_least("completion_max_tokens", 1)
    )


class _ApiError(Exception):
    """Becomes an OpenAI-style JSON error response."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param: str | None = extra.get("param")
        self.headers: dict[str, str] | None = extra.get("headers")


def _error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error_response(err: _ApiError) -> JSONResponse:
    return JSONResponse(
        _error_body(err.status, err.message, err.kind, err.param),
        status_code=err.status,
        headers=err.headers,
    )


@final
class _Choice:
    """One answer in progress: its engine stream, its text, its timing."""

    __slots__ = ("gen", "index", "last_token_at", "prompt", "settled", "text")

    def __init__(self, index: int, prompt: int, gen: Generation, text: TextStream) -> None:
        self.index = index
        self.prompt = prompt  # which prompt of the request
        self.gen = gen
        self.text = text
        self.last_token_at: float | None = None
        self.settled = False

    @property
    def finish_reason(self) -> str:
        report = self.gen.report
        if self.text.stopped or (report is not None and report.finish_reason is FinishReason.STOP):
            return "stop"
        return "length"


@final
class _Server:
    """The app's state: engine, codec, metrics and the admission count."""

    def __init__(self, engine: AsyncEngine, codec: Codec, config: ServerConfig) -> None:
        self.engine = engine
        self.codec = codec
        self.config = config
        self.metrics = ServeMetrics(engine, config.model_name)
        self.in_progress = 0
        self.created = int(time.time())

    @property
    def capacity(self) -> int:
        return self.engine.config.max_running + self.config.max_waiting

    # -- request building -------------------------------------------------------------------
    def check_model(self, body: _Sampling | TokenizeRequest | DetokenizeRequest) -> None:
        name = self.config.model_name
        if body.model is not None and body.model != name:
            raise _ApiError(
                404,
                f"The model {body.model!r} does not exist (this server serves {name!r}).",
                param="model",
            )

    def sampling(self, body: _Sampling, default_max: int) -> Any:
        from prefixflight.backends.torch import SamplingParams

        if (field := unsupported_field(body)) is not None:
            raise _ApiError(400, f"{field!r} is not supported by this server", param=field)
        max_tokens = default_max
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        elif body.max_tokens is not None:
            max_tokens = body.max_tokens
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                ignore_eos=bool(body.ignore_eos),
            )
        except ConfigError as exc:
            raise _ApiError(400, str(exc)) from None

    @staticmethod
    def stops(body: _Sampling) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    @staticmethod
    def namespace(body: _Sampling) -> str:
        """The hashing namespace: tenants named by ``cache_salt`` or ``user`` never share
        cached blocks or flights; requests naming neither share the default namespace."""
        if body.cache_salt is None and body.user is None:
            return ""
        return json.dumps([body.cache_salt, body.user])

    def submit(
        self, prompts: Sequence[Sequence[int]], body: _Sampling, default_max: int
    ) -> list[_Choice]:
        """Admit and start every choice of a request, or raise with nothing started."""
        sampling = self.sampling(body, default_max)
        stops = self.stops(body)
        n = body.n or 1
        need = len(prompts) * n
        engine = self.engine
        if engine.closed:
            self.metrics.rejected("unavailable")
            raise _ApiError(503, "the engine is not running", "service_unavailable")
        if self.in_progress + need > self.capacity:
            self.metrics.rejected("overloaded")
            raise _ApiError(
                429,
                f"the server is overloaded: {self.in_progress} requests in progress, this one "
                f"needs {need} more, the limit is {self.capacity} ({engine.config.max_running} "
                f"running + {self.config.max_waiting} waiting); retry later",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        namespace = self.namespace(body)
        choices: list[_Choice] = []
        try:
            for p, ids in enumerate(prompts):
                gens = engine.generate_n(ids, sampling, n, namespace=namespace)
                for gen in gens:
                    choices.append(_Choice(len(choices), p, gen, TextStream(self.codec, stops)))
        except PrefixflightError as exc:
            for c in choices:
                c.gen.cancel()
                self.settle(c)
            raise _ApiError(400, str(exc)) from None
        self.in_progress += len(choices)
        return choices

    def settle(self, choice: _Choice) -> None:
        """Count a choice that ended (once): metrics, and its admission slot back."""
        report = choice.gen.report
        if choice.settled or report is None:
            return
        choice.settled = True
        self.in_progress -= 1
        self.metrics.finished(report)

    # -- running choices -------------------------------------------------------------------
    async def _pump(
        self,
        choice: _Choice,
        arrived: float,
        out: asyncio.Queue[tuple[int, str, str | None] | BaseException],
    ) -> None:
        metrics = self.metrics
        delta = ""
        try:
            async for tok in choice.gen:
                now = time.perf_counter()
                if choice.last_token_at is None:
                    metrics.first_token(now - arrived)
                else:
                    metrics.inter_token(now - choice.last_token_at)
                choice.last_token_at = now
                delta = choice.text.add(tok)
                if choice.text.stopped:
                    await choice.gen.aclose()  # a stop string ended it: abort the rest
                    break
                if delta:
                    out.put_nowait((choice.index, delta, None))
            rest = delta if choice.text.stopped else choice.text.flush()
            self.settle(choice)
            out.put_nowait((choice.index, rest, choice.finish_reason))
        except Exception as exc:  # the engine failed or was closed
            out.put_nowait(exc)

    async def events(
        self, choices: list[_Choice], arrived: float
    ) -> AsyncGenerator[tuple[int, str, str | None], None]:
        """``(choice, text delta, finish reason or None)`` as the choices produce them.
        Closing this iterator early (a disconnect) aborts every unfinished choice."""
        queue: asyncio.Queue[tuple[int, str, str | None] | BaseException] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(c, arrived, queue)) for c in choices]
        try:
            left = len(choices)
            while left:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[2] is not None:
                    left -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                await c.gen.aclose()
                self.settle(c)

    async def stream(
        self,
        prompts: Sequence[Sequence[int]],
        choices: list[_Choice],
        arrived: float,
        head: Mapping[str, Any],
        include_usage: bool,
        choice: Callable[[int, str, str | None], dict[str, Any]],
        opening: Sequence[dict[str, Any]] = (),
    ) -> AsyncIterator[bytes]:
        """An OpenAI event stream: a chunk for each of ``opening``'s choices, then one for
        each event (``choice`` shapes it; ``"usage": null`` when usage was asked for), then
        the usage chunk, or an error chunk if the engine fails, and ``[DONE]``."""

        def chunk(body: dict[str, Any]) -> bytes:
            out: dict[str, Any] = {**head, "choices": [body]}
            if include_usage:
                out["usage"] = None
            return _sse(out)

        events = self.events(choices, arrived)
        try:
            for body in opening:
                yield chunk(body)
            async for index, text, reason in events:
                yield chunk(choice(index, text, reason))
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage(prompts, choices)})
        except Exception as exc:
            yield _sse(_stream_error(exc))
        finally:
            await events.aclose()
        yield _sse("[DONE]")

    def usage(self, prompts: Sequence[Sequence[int]], choices: list[_Choice]) -> dict[str, Any]:
        """OpenAI's usage: each prompt counted once; ``cached_tokens`` is what each prompt
        reused from before this request (for ``n > 1``: its least-cached choice, since the
        other choices reuse that choice's own prefill)."""
        completion = sum(len(c.gen.tokens) for c in choices)
        cached = 0
        for p in range(len(prompts)):
            reports = [c.gen.report for c in choices if c.prompt == p]
            cached += min((r.cached_tokens for r in reports if r is not None), default=0)
        prompt = sum(len(p) for p in prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@final
class _EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, when the client disconnects
    (whatever ASGI version the server speaks), so the engine aborts the request."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        super().__init__(
            source, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (aborting its requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise _ApiError(499, "the client closed the request", "client_closed_request")
    return task.result()


def _prompt_ids(prompt: str | list[Any], codec: Codec) -> list[list[int]]:
    """A completion's prompts: text, token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        return [codec.encode(prompt)]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [[int(t) for t in prompt]]
    return [codec.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompt]


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise _ApiError(
                        400,
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        param="messages",
                    )
                parts.append(part.text)
            text = "".join(parts)
        out.append({"role": m.role, "content": text})
    return out


def build_app(engine: AsyncEngine, codec: Codec, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine is closed when the app shuts down."""
    server = _Server(engine, codec, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="prefixflight", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(_ApiError)
    async def api_error(_r: Request, exc: _ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "")
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more errors)"
        return _error_response(_ApiError(400, message or "invalid request", param=loc or None))

    @app.exception_handler(HTTPException)
    async def http_error(_r: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(_ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def crashed(_r: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            _ApiError(500, f"internal server error ({type(exc).__name__})", "server_error")
        )

    @app.get("/health")
    async def health() -> Response:
        if engine.closed:
            raise _ApiError(503, "the engine is not running", "service_unavailable")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "prefixflight",
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        server.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise _ApiError(400, "give exactly one of 'prompt' and 'messages'")
        try:
            if body.prompt is not None:
                tokens = codec.encode(body.prompt)
            else:
                assert body.messages is not None
                tokens = codec.chat(_message_dicts(body.messages))
        except UsageError as exc:
            raise _ApiError(400, str(exc)) from None
        return {"count": len(tokens), "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        server.check_model(body)
        vocab = engine.runner.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise _ApiError(400, f"token id {bad[0]} is not in [0, {vocab})", param="tokens")
        return {"prompt": codec.decode(body.tokens)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        server.check_model(body)
        prompts = _prompt_ids(body.prompt, codec)
        if not prompts or any(not p for p in prompts):
            raise _ApiError(400, "prompt must not be empty", param="prompt")
        choices = server.submit(prompts, body, config.completion_max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
        }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:

            def text_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
                return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

            return _EventStream(
                server.stream(prompts, choices, arrived, head, include_usage, text_choice)
            )

        texts = await _unless_disconnected(request, _collect(server, choices, arrived))
        return JSONResponse(
            {
                **head,
                "choices": [
                    {
                        "index": c.index,
                        "text": texts[c.index],
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
                "usage": server.usage(prompts, choices),
            }
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        server.check_model(body)
        try:
            prompt = codec.chat(_message_dicts(body.messages))
        except UsageError as exc:
            raise _ApiError(400, str(exc), param="messages") from None
        choices = server.submit([prompt], body, config.chat_max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": config.model_name,
        }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:

            def delta(index: int, change: dict[str, str], reason: str | None) -> dict[str, Any]:
                return {"index": index, "delta": change, "logprobs": None, "finish_reason": reason}

            def delta_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
                return delta(index, {"content": text} if text else {}, reason)

            roles = [delta(c.index, {"role": "assistant", "content": ""}, None) for c in choices]
            return _EventStream(
                server.stream(
                    [prompt], choices, arrived, head, include_usage, delta_choice, roles
                )
            )

        texts = await _unless_disconnected(request, _collect(server, choices, arrived))
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": texts[c.index]},
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in choices
                ],
                "usage": server.usage([prompt], choices),
            }
        )

    return app


def _stream_error(exc: Exception) -> dict[str, Any]:
    from prefixflight.backends.torch import EngineClosedError

    if isinstance(exc, EngineClosedError):
        return _error_body(503, str(exc), "service_unavailable")
    return _error_body(500, f"the engine failed ({type(exc).__name__}: {exc})", "server_error")


async def _collect(server: _Server, choices: list[_Choice], arrived: float) -> list[str]:
    from prefixflight.backends.torch import EngineClosedError

    texts = [""] * len(choices)
    events = server.events(choices, arrived)
    try:
        async for index, text, _reason in events:
            texts[index] += text
    except EngineClosedError as exc:
        raise _ApiError(503, str(exc), "service_unavailable") from None
    except PrefixflightError as exc:
        raise _ApiError(500, f"the engine failed ({exc})", "server_error") from None
    except Exception as exc:
        raise _ApiError(
            500, f"the engine failed ({type(exc).__name__}: {exc})", "server_error"
        ) from None
    finally:
        await events.aclose()
    return texts


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    access_log: bool = False,
) -> None:
    """Serve ``app`` on an already bound socket until interrupted; Ctrl-C (SIGINT) shuts
    down gracefully (the engine is closed) and returns normally."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped for once it has shut down
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve(sockets=[sock]))
