"""The server's state and the life of a request: checked, admitted, run, streamed, settled.

`Server` owns the engine, the codec (and the one thread text is encoded and decoded in,
so a long prompt never blocks the event loop), the metrics and `Admission`, the one place
that counts choices in progress. A request is checked whole first (every prompt, its
sampling, its size against the context, the pool and the admission limit), then admitted
(its choices counted in at once), then submitted; each choice is counted out exactly once,
when it ends. Nothing is reserved for a request that is then rejected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

import attrs

from prefixflight.core import ConfigError, FinishReason, PrefixflightError, UsageError

from ._metrics import ServeMetrics
from ._protocol import (
    ChatMessage,
    ChatRequest,
    FinishReasonName,
    PromptTokensDetails,
    Usage,
    _Sampling,
    unsupported_field,
)
from ._text import Codec, TextStream

if TYPE_CHECKING:
    from prefixflight.backends.torch import AsyncEngine, Generation, SamplingParams

__all__ = ["Admission", "ApiError", "Server", "ServerConfig"]

T = TypeVar("T")
MIB = 1 << 20


def _check_name(_i: object, _a: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"model_name must be a non-empty str, got {value!r}")


def _at_least(name: str, minimum: int) -> Callable[[object, object, int], None]:
    def check(_i: object, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")

    return check


def _seconds(name: str, *, positive: bool) -> Callable[[object, object, float], None]:
    def check(_i: object, _a: object, value: float) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not (value > 0 if positive else value >= 0) or value == float("inf"):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {value!r}")

    return check


def _check_keys(_i: object, _a: object, value: Mapping[str, str | None]) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"api_keys must be a mapping of key -> tenant, got {value!r}")
    for key, tenant in value.items():
        if not isinstance(key, str) or not key or key != key.strip() or not key.isprintable():
            raise ConfigError(f"an API key must be a non-empty printable str, got {key!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigError(f"the tenant of an API key must be a non-empty str, got {tenant!r}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """What the HTTP layer adds to the engine.

    - ``model_name``: the ``model`` clients name, and the ``model_name`` metrics label.
    - ``max_waiting``: requests (choices) that may wait beyond the engine's running batch
      (``max_running``); a request that would exceed ``max_running + max_waiting`` in
      progress gets 429 at once instead of queueing without bound (400 if it alone is
      larger: it could never be admitted).
    - ``chat_max_tokens`` / ``completion_max_tokens``: ``max_tokens`` when a request leaves
      it out (OpenAI's completions default is 16), cut to what the context has left.
    - ``max_body_bytes``: the largest request body (413 past it); 32 MiB, vLLM's
      OpenAI frontend's limit.
    - ``api_keys``: key -> tenant (None: the key only authenticates). Empty: no key
      needed. Otherwise every route but ``/health``, ``/metrics`` and ``/openapi.json``
      needs ``Authorization: Bearer KEY`` (401 without); a tenant is the hashing
      namespace of its requests, so tenants never share cached blocks or flights, and a
      client's ``cache_salt`` or ``user`` only divides its own tenant's namespace.
    - ``client_timeout``: seconds a client may stay silent while it sends its request
      headers or body (then 408 or the connection is closed) or leave a stream unread
      (then the request is aborted); ``keep_alive_timeout``: idle seconds between requests.
    - ``shutdown_timeout``: on SIGINT/SIGTERM, seconds the requests in progress may take to
      finish before they are failed (their streams end with an error event).
    """

    model_name: str = attrs.field(validator=_check_name)
    max_waiting: int = attrs.field(default=64, validator=_at_least("max_waiting", 0))
    chat_max_tokens: int = attrs.field(default=256, validator=_at_least("chat_max_tokens", 1))
    completion_max_tokens: int = attrs.field(
        default=16, validator=_at_least("completion_max_tokens", 1)
    )
    max_body_bytes: int = attrs.field(default=32 * MIB, validator=_at_least("max_body_bytes", 1))
    api_keys: Mapping[str, str | None] = attrs.field(factory=dict, validator=_check_keys)
    client_timeout: float = attrs.field(
        default=30.0, validator=_seconds("client_timeout", positive=True)
    )
    keep_alive_timeout: float = attrs.field(
        default=5.0, validator=_seconds("keep_alive_timeout", positive=True)
    )
    shutdown_timeout: float = attrs.field(
        default=5.0, validator=_seconds("shutdown_timeout", positive=False)
    )


class ApiError(Exception):
    """Becomes an OpenAI-style JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = dict(headers) if headers else None


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable")


@final
class Admission:
    """The choices in progress, counted in when a request is admitted and out, once each,
    when they end: the one count behind 429 and the drain on shutdown."""

    __slots__ = ("_idle", "capacity", "count")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, need: int, limits: str) -> None:
        """Count ``need`` choices in, or raise 429 (400 if ``need`` alone is over)."""
        if need > self.capacity:
            raise ApiError(
                400,
                f"the request needs {need} choices (prompts x n) at once, more than the "
                f"server ever runs ({self.capacity}: {limits})",
                param="n",
            )
        if self.count + need > self.capacity:
            raise ApiError(
                429,
                f"the server is overloaded: {self.count} requests in progress, this one "
                f"needs {need} more, the limit is {self.capacity} ({limits}); retry later",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.count += need
        self._idle.clear()

    def release(self, n: int = 1) -> None:
        assert 0 < n <= self.count, (n, self.count)
        self.count -= n
        if not self.count:
            self._idle.set()

    async def idle(self) -> None:
        await self._idle.wait()


@final
class Choice:
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
    def finish_reason(self) -> FinishReasonName:
        report = self.gen.report
        if self.text.stopped or (report is not None and report.finish_reason is FinishReason.STOP):
            return "stop"
        return "length"


Event = tuple[int, str, str | None]


@final
class Server:
    """The app's state: engine, codec, metrics, admission."""

    def __init__(self, engine: AsyncEngine, codec: Codec, config: ServerConfig) -> None:
        self.engine = engine
        self.codec = codec
        self.config = config
        self.admission = Admission(engine.config.max_running + config.max_waiting)
        self.metrics = ServeMetrics(engine, config.model_name, lambda: self.admission.count)
        self.created = int(time.time())
        self.draining = False
        self._text_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixflight-text"
        )

    # -- text, off the event loop ----------------------------------------------------------
    async def in_text_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the codec's thread (one: tokenizers are not all thread-safe)."""
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, fn, *args)

    async def encode(self, text: str) -> list[int]:
        return await self.in_text_thread(self.codec.encode, text)

    async def chat(self, messages: list[ChatMessage]) -> list[int]:
        dicts = message_dicts(messages)
        try:
            return await self.in_text_thread(self.codec.chat, dicts)
        except UsageError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template refusing these messages (jinja raises)
            raise ApiError(
                400,
                f"the chat template cannot render these messages ({type(exc).__name__}: {exc})",
                param="messages",
            ) from None

    def close_text_thread(self) -> None:
        self._text_thread.shutdown(wait=False, cancel_futures=True)

    # -- checks ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        name = self.config.model_name
        if model is not None and model != name:
            raise ApiError(
                404,
                f"The model {model!r} does not exist (this server serves {name!r}).",
                "not_found_error",
                param="model",
            )

    def check_accepting(self) -> None:
        if self.draining:
            self.metrics.rejected("unavailable")
            raise unavailable("the server is shutting down")
        if self.engine.closed:
            self.metrics.rejected("unavailable")
            raise unavailable("the engine is not running")

    def check_tokens(self, ids: Sequence[int], param: str) -> None:
        vocab = self.engine.runner.vocab_size
        for t in ids:
            if t >= vocab:
                raise ApiError(400, f"{param}: token id {t} is not in [0, {vocab})", param=param)

    def sampling(self, body: _Sampling, max_tokens: int) -> SamplingParams:
        from prefixflight.backends.torch import SamplingParams

        top_k = body.top_k or 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(top_k, 0),
                seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                min_tokens=body.min_tokens or 0,
            )
        except ConfigError as exc:
            param = "min_tokens" if "min_tokens" in str(exc) else None
            raise ApiError(400, str(exc), param=param) from None

    def max_tokens(self, body: _Sampling, default: int, prompt_len: int) -> int:
        """The request's ``max_tokens``, or the default cut to what the context has left."""
        asked = body.max_tokens
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            asked = body.max_completion_tokens
        if asked is not None:
            return asked
        context = self.engine.max_model_len
        if context is None:
            return default
        if prompt_len >= context:
            raise ApiError(
                400,
                f"this model's maximum context length is {context} tokens, but the prompt "
                f"has {prompt_len}",
                param="messages" if isinstance(body, ChatRequest) else "prompt",
            )
        return min(default, context - prompt_len)

    # -- admission ------------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        body: _Sampling,
        default_max: int,
        tenant: str | None = None,
    ) -> list[Choice]:
        """Check every prompt, admit every choice, start them; or raise with nothing taken."""
        if (field := unsupported_field(body)) is not None:
            raise ApiError(400, f"{field!r} is not supported by this server", param=field)
        self.check_accepting()
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        engine = self.engine
        n = body.n or 1
        plans: list[tuple[Sequence[int], SamplingParams]] = []
        for i, ids in enumerate(prompts):
            where = param if len(prompts) == 1 else f"{param}[{i}]"
            self.check_tokens(ids, where)
            sampling = self.sampling(body, self.max_tokens(body, default_max, len(ids)))
            try:
                engine.validate(ids, sampling)
            except UsageError as exc:
                raise ApiError(400, f"{where}: {exc}", param=param) from None
            plans.append((ids, sampling))
        try:
            self.admission.admit(len(prompts) * n, self.limits)
        except ApiError as exc:
            if exc.status == 429:
                self.metrics.rejected("overloaded")
            raise
        stops = self.stops(body)
        namespace = self.namespace(body, tenant)
        choices: list[Choice] = []
        try:
            for p, (ids, sampling) in enumerate(plans):
                for gen in engine.generate_n(ids, sampling, n, namespace=namespace):
                    text = TextStream(self.codec, stops, min_tokens=sampling.min_tokens)
                    choices.append(Choice(len(choices), p, gen, text))
        except PrefixflightError as exc:  # the engine closed meanwhile
            for c in choices:
                c.settled = True
                c.gen.cancel()
            self.admission.release(len(prompts) * n)
            raise unavailable(str(exc)) from None
        return choices

    @property
    def limits(self) -> str:
        running = self.engine.config.max_running
        return f"{running} running + {self.config.max_waiting} waiting"

    @staticmethod
    def stops(body: _Sampling) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    @staticmethod
    def namespace(body: _Sampling, tenant: str | None = None) -> str:
        """The hashing namespace. Requests naming no tenant, ``cache_salt`` or ``user`` share
        the default namespace; otherwise each (tenant, cache_salt, user) is its own, and
        the tenant (from the API key) comes first, so no client field can reach another
        tenant's namespace."""
        if tenant is None:
            if body.cache_salt is None and body.user is None:
                return ""
            return json.dumps([body.cache_salt, body.user])
        return json.dumps([tenant, body.cache_salt, body.user])

    def settle(self, choice: Choice) -> None:
        """Count a choice that ended (once): metrics, and its admission slot back."""
        report = choice.gen.report
        if choice.settled or report is None:
            return
        choice.settled = True
        self.admission.release()
        self.metrics.finished(report)

    # -- running choices -------------------------------------------------------------------
    async def _pump(
        self, choice: Choice, arrived: float, out: asyncio.Queue[Event | BaseException]
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
        except Exception as exc:  # the step failed, or the engine was closed
            out.put_nowait(exc)

    async def events(self, choices: list[Choice], arrived: float) -> AsyncGenerator[Event, None]:
        """``(choice, text delta, finish reason or None)`` as the choices produce them.
        Closing this iterator early (a disconnect) aborts every unfinished choice."""
        queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
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
        choices: list[Choice],
        arrived: float,
        head: Mapping[str, Any],
        include_usage: bool,
        choice: Callable[[int, str, str | None], dict[str, Any]],
        opening: Sequence[dict[str, Any]] = (),
    ) -> AsyncIterator[bytes]:
        """An OpenAI event stream: a chunk for each of ``opening``'s choices, then one for
        each event (``choice`` shapes it; ``"usage": null`` when usage was asked for), then
        the usage chunk, or an error chunk if the request failed, and ``[DONE]``."""

        def chunk(body: dict[str, Any]) -> bytes:
            out: dict[str, Any] = {**head, "choices": [body]}
            if include_usage:
                out["usage"] = None
            return sse(out)

        events = self.events(choices, arrived)
        try:
            for body in opening:
                yield chunk(body)
            async for index, text, reason in events:
                yield chunk(choice(index, text, reason))
            if include_usage:
                usage = self.usage(prompts, choices).model_dump()
                yield sse({**head, "choices": [], "usage": usage})
        except Exception as exc:
            yield sse(self.failure(exc).body)
        finally:
            await events.aclose()
        yield sse("[DONE]")

    async def collect(self, choices: list[Choice], arrived: float) -> list[str]:
        """Every choice's whole text (a non-streamed answer)."""
        texts = [""] * len(choices)
        events = self.events(choices, arrived)
        try:
            async for index, text, _reason in events:
                texts[index] += text
        except Exception as exc:
            raise self.failure(exc).error from None
        finally:
            await events.aclose()
        return texts

    def failure(self, exc: Exception) -> _Failure:
        """What a request that failed in the engine gets."""
        from prefixflight.backends.torch import EngineClosedError

        if isinstance(exc, EngineClosedError):
            if self.draining:
                return _Failure(unavailable("the server shut down before the request finished"))
            return _Failure(unavailable(str(exc)))
        why = str(exc) if isinstance(exc, PrefixflightError) else f"{type(exc).__name__}: {exc}"
        return _Failure(ApiError(500, f"the request failed in the engine: {why}", "server_error"))

    def usage(self, prompts: Sequence[Sequence[int]], choices: list[Choice]) -> Usage:
        """OpenAI's usage: each prompt counted once; ``cached_tokens`` is what each prompt
        reused from before this request (for ``n > 1``: its least-cached choice, since the
        other choices reuse that choice's own prefill)."""
        completion = sum(len(c.gen.tokens) for c in choices)
        cached = 0
        for p in range(len(prompts)):
            reports = [c.gen.report for c in choices if c.prompt == p]
            cached += min((r.cached_tokens for r in reports if r is not None), default=0)
        prompt = sum(len(p) for p in prompts)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    # -- shutdown -------------------------------------------------------------------------
    async def drain(self) -> None:
        """Refuse new requests; give those in progress ``shutdown_timeout`` seconds; then
        close the engine, which fails the rest (their streams end with an error event)."""
        self.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.admission.idle(), self.config.shutdown_timeout)
        await self.engine.close()


@final
class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: ApiError) -> None:
        self.error = error

    @property
    def body(self) -> dict[str, Any]:
        e = self.error
        return error_body(e.status, e.message, e.kind, e.param)


def sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
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
                    raise ApiError(
                        400,
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        param="messages",
                    )
                parts.append(part.text)
            text = "".join(parts)
        out.append({"role": m.role, "content": text})
    return out
