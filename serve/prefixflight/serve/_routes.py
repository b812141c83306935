"""The routes: one `APIRouter`, its state reached through dependencies.

Each route declares what it answers (`responses`): its 200 model (and ``text/event-stream``
where it streams) and every error status it can give, so the OpenAPI schema FastAPI builds
from them is the server's real contract; `openapi_schema` adds what depends on the app's
configuration (401 where keys are required) and removes FastAPI's 422, which this server
never sends (validation errors are 400, as in vLLM).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ._limits import PUBLIC_PATHS
from ._protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ._server import ApiError, Choice, Server, unavailable

__all__ = ["openapi_schema", "router"]


def get_server(request: Request) -> Server:
    server: Server = request.app.state.server
    return server


def get_tenant(request: Request) -> str | None:
    """The tenant of the request's API key (`ApiKeys` put it there), if any."""
    tenant: str | None = getattr(request.state, "tenant", None)
    return tenant


def arrival() -> float:
    return time.perf_counter()


ServerDep = Annotated[Server, Depends(get_server)]
TenantDep = Annotated[str | None, Depends(get_tenant)]
Arrived = Annotated[float, Depends(arrival)]

_WHY = {
    400: "Invalid request: the message names the field or parameter",
    404: "Unknown model",
    408: "The request body stopped arriving (client timeout)",
    413: "The request body is larger than the server's limit",
    429: "Overloaded: too many choices in progress; retry after Retry-After seconds",
    500: "The request failed in the engine (its step failed); the server serves on",
    503: "The engine is not running, or the server is shutting down",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _WHY[status]}
        if status == 429:
            out[status]["headers"] = {
                "Retry-After": {"schema": {"type": "string"}, "required": True}
            }
    return out


def _event(chunk: type) -> dict[str, Any]:
    """One server-sent event, as tools that read ``text/event-stream`` schemas (schemathesis)
    see it: an object whose ``data`` is ``[DONE]`` or a chunk's or an error's JSON."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in (chunk, ErrorResponse)]
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": refs},
                    },
                ],
                "description": f"`[DONE]`, or `{chunk.__name__}` or `ErrorResponse` JSON",
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


def _generated(model: type, chunk: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"`{model.__name__}`; with `stream: true`, server-sent events: "
            f"`data: <{chunk.__name__} JSON>` per chunk (or one `data: <ErrorResponse JSON>` "
            "if the request fails after the 200), then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": _event(chunk)}},
        }
    }


_BODY_ERRORS = (400, 404, 408, 413)
_GENERATION_ERRORS = (*_BODY_ERRORS, 429, 500, 503)

router = APIRouter()


@router.get(
    "/health",
    response_model=Health,
    responses=_errors(503),
    summary="200 while the engine runs and the server accepts requests",
)
async def health(server: ServerDep) -> Health:
    if server.draining:
        raise unavailable("the server is shutting down")
    if server.engine.closed:
        raise unavailable("the engine is not running")
    return Health(status="ok")


@router.get("/v1/models", response_model=ModelList)
async def models(server: ServerDep) -> ModelList:
    card = ModelCard(
        id=server.config.model_name, object="model", created=server.created, owned_by="prefixflight"
    )
    return ModelList(object="list", data=[card])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text format (docs/serve.md lists the metrics)"}},
)
async def metrics(server: ServerDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_errors(*_BODY_ERRORS))
async def tokenize(body: TokenizeRequest, server: ServerDep) -> TokenizeResponse:
    """vLLM's: the token ids of a ``prompt``, or of chat ``messages`` rendered by the
    tokenizer's chat template (with the generation prompt)."""
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'")
    if body.prompt is not None:
        tokens = await server.encode(body.prompt)
    else:
        assert body.messages is not None
        tokens = await server.chat(body.messages)
    return TokenizeResponse(count=len(tokens), tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(*_BODY_ERRORS))
async def detokenize(body: DetokenizeRequest, server: ServerDep) -> DetokenizeResponse:
    """vLLM's: the text of token ids."""
    server.check_model(body.model)
    server.check_tokens(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await server.in_text_thread(server.codec.decode, body.tokens))


async def _prompt_ids(server: Server, prompt: str | list[Any]) -> list[list[int]]:
    """A completion's prompts: text, token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        prompts = [await server.encode(prompt)]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [await server.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompts


def _head(kind: str, model: str) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


@router.post(
    "/v1/completions",
    response_model=None,
    responses={**_generated(CompletionResponse, CompletionChunk), **_errors(*_GENERATION_ERRORS)},
)
async def completions(
    body: CompletionRequest,
    request: Request,
    server: ServerDep,
    tenant: TenantDep,
    arrived: Arrived,
) -> Response:
    """OpenAI's completions: ``prompt`` is text, token ids, or a list of either."""
    server.check_model(body.model)
    prompts = await _prompt_ids(server, body.prompt)
    choices = server.submit(prompts, body, server.config.completion_max_tokens, tenant)
    head = _head("text_completion", server.config.model_name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:

        def text_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

        return EventStream(
            server.stream(prompts, choices, arrived, head, include_usage, text_choice),
            server.config.client_timeout,
        )
    texts = await _unless_disconnected(request, server, choices, arrived)
    response = CompletionResponse(
        **head,
        choices=[
            CompletionChoice(
                index=c.index, text=texts[c.index], logprobs=None, finish_reason=c.finish_reason
            )
            for c in choices
        ],
        usage=server.usage(prompts, choices),
    )
    return JSONResponse(response.model_dump())


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={**_generated(ChatResponse, ChatChunk), **_errors(*_GENERATION_ERRORS)},
)
async def chat(
    body: ChatRequest,
    request: Request,
    server: ServerDep,
    tenant: TenantDep,
    arrived: Arrived,
) -> Response:
    """OpenAI's chat completions: ``messages`` rendered by the tokenizer's chat template."""
    server.check_model(body.model)
    prompt = await server.chat(body.messages)
    choices = server.submit([prompt], body, server.config.chat_max_tokens, tenant)
    head = _head("chat.completion.chunk", server.config.model_name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:

        def delta(index: int, change: dict[str, str], reason: str | None) -> dict[str, Any]:
            return {"index": index, "delta": change, "logprobs": None, "finish_reason": reason}

        def delta_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
            return delta(index, {"content": text} if text else {}, reason)

        roles = [delta(c.index, {"role": "assistant", "content": ""}, None) for c in choices]
        return EventStream(
            server.stream([prompt], choices, arrived, head, include_usage, delta_choice, roles),
            server.config.client_timeout,
        )
    texts = await _unless_disconnected(request, server, choices, arrived)
    response = ChatResponse(
        **{**head, "object": "chat.completion"},
        choices=[
            ChatChoice(
                index=c.index,
                message=AssistantMessage(role="assistant", content=texts[c.index]),
                logprobs=None,
                finish_reason=c.finish_reason,
            )
            for c in choices
        ],
        usage=server.usage([prompt], choices),
    )
    return JSONResponse(response.model_dump())


async def _unless_disconnected(
    request: Request, server: Server, choices: list[Choice], arrived: float
) -> list[str]:
    """The choices' texts; if the client goes away first, abort them."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(server.collect(choices, arrived))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the request", "client_closed_request")
    return task.result()


@final
class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source (aborting the request), when
    the client disconnects or leaves the stream unread for ``write_timeout`` seconds."""

    def __init__(self, source: AsyncIterator[bytes], write_timeout: float) -> None:
        super().__init__(
            source, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._source = source
        self._write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        loop = asyncio.get_running_loop()

        async def send_or_give_up(message: Message) -> None:
            # a reader that stalled: stop. (Not asyncio.wait_for: up to Python 3.11 it drops
            # a cancellation that lands as the send completes, and the stream would go on.)
            stalled = loop.call_later(self._write_timeout, streaming.cancel)
            try:
                await send(message)
            finally:
                stalled.cancel()

        streaming = asyncio.ensure_future(self.stream_response(send_or_give_up))
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


def openapi_schema(schema: dict[str, Any], *, keys_required: bool) -> dict[str, Any]:
    """FastAPI's schema of the router, made to say what this app does."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for chunk in (CompletionChunk, ChatChunk):  # named by the event streams' schemas
        js = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in js.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas[chunk.__name__] = js
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if keys_required and path not in PUBLIC_PATHS:
                op["security"] = [{"apiKey": []}]
                responses["401"] = {
                    "description": "No valid API key (send `Authorization: Bearer <key>`)",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                        }
                    },
                }
    if keys_required:
        components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return schema


def message_of(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A 400's message and ``param`` from pydantic's errors: the first error's field
    (list indices kept, pydantic's union-member tags left out) and what is wrong with it."""
    # the deepest error first: in a union, the member that matched the input's shape best
    first: Any = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        where = [x for x in first.get("loc", ()) if isinstance(x, int)]
        at = f" at character {where[0]}" if where else ""
        return f"the body is not valid JSON ({detail}{at})", None
    parts: list[str] = []
    for x in first.get("loc", ()):
        if x == "body" and not parts:
            continue
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif isinstance(x, str) and x.isidentifier() and x not in _TYPE_TAGS:  # not a tag
            parts.append(f".{x}" if parts else x)
    loc = "".join(parts)
    msg = str(first.get("msg", "invalid request"))
    message = f"{loc}: {msg}" if loc else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, (loc or None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
