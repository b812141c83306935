"""``prefixflight route``: an OpenAI-compatible HTTP router in front of OpenAI-compatible
engines (vLLM, SGLang, ``prefixflight serve``), with the burst prefix-affinity window.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` is keyed by its prompt, routed by a
policy (`RoutingState`: ``"burst"``, the core's `BurstRouter` window in front of a
residency-first fallback; ``"prefix"``, the fallback alone; ``"round_robin"``), and relayed
to the chosen backend unchanged: the body as sent, the answer as received (server-sent events
passed through chunk by chunk; a client that goes away closes the upstream request, which
aborts it there). ``GET /v1/models`` and ``POST /tokenize`` / ``/detokenize`` go to a live
backend; ``GET /health`` is 200 while one backend is up, with the backends' and the KV-event
subscriber's state (503 while none is); ``GET /metrics`` is the router's own.

Keys. With a tokenizer (``tokenizer=``: any `Codec`, e.g. ``HFCodec`` over the backends'
Hugging Face tokenizer) a text prompt is keyed by its token ids, as the engines see them; a
chat by its chat template's tokens; without one, by the text's UTF-8 bytes (the burst window
groups identical and prefix-sharing prompts all the same; residency lookups then need token-id
prompts). ``cache_salt`` names the tenant: its keys are its own. Behind API keys, the key's
tenant is written into the relayed ``cache_salt`` (`tenant_salt`), which vLLM and
``prefixflight serve`` hash into a prompt's blocks: tenants never share cached blocks on a
backend, whatever salt a client sends.

Residency comes from the backends' KV events (a `KVEventSubscriber` connecting to each
backend's publisher; vLLM binds ``tcp://*:PORT``): the subscriber rebuilds each stored block's
key from its token ids with the router's hasher (``BlockHasher(engine_block_size)``, which
must be the backends' KV block size), so the router finds a prompt's blocks whatever hash
seed the engine uses. Without KV events the fallback is llm-d's approximate prefix scorer,
which assumes a backend caches what it was sent.

Loads: the requests this router has in flight per backend (as running and as waiting: a
residency-first choice stays within 4 in-flight requests of the least loaded backend, and the
approximate scorer's queue score balances cold prompts). Every backend's ``/health`` is
probed each ``health_interval_s``: one that fails ``health_failures`` probes in a row, or
refuses a connection, is marked down (a request whose answer has not started goes to another
backend) until a probe succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Annotated, Any, Final, final

import aiohttp
import attrs
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException

from prefixflight.core import (
    BlockHasher,
    BurstConfig,
    ConfigError,
    PrefixIndex,
    ReplicaLoad,
    Routed,
)

from ._limits import ApiKeys, BodyLimits, GracefulServer
from ._routing import POLICIES, PolicyName, RoutingState
from ._server import ApiError as HttpError
from ._server import error_body
from ._text import Codec

__all__ = [
    "Backend",
    "RouteConfig",
    "RoutePrompt",
    "build_route_app",
    "route_prompt",
    "route_server",
    "serve",
    "tenant_salt",
]

MIB: Final = 1 << 20

_RELAYED_HEADERS: Final = ("content-type", "authorization", "accept")
_PROBE: Final = aiohttp.ClientTimeout(total=5.0)  # a /health probe of a backend marked down
_NOT_RELAYED: Final = frozenset(  # hop-by-hop, or set by this server itself
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "content-type",
        "date",
        "server",
    }
)


def _url(_i: object, _a: object, value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ConfigError(f"a backend URL must start with http:// or https://, got {value!r}")
    if value.endswith("/") or value.endswith("/v1"):
        raise ConfigError(f"give a backend's base URL, without /v1 or a trailing /: {value!r}")


def _endpoint(_i: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or "://" not in value):
        raise ConfigError(
            f"{attribute.name} must be a ZMQ address like tcp://127.0.0.1:5557, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class Backend:
    """One engine: its base URL (``http://host:port``, named by it in metrics and loads) and,
    optionally, where it publishes KV events (``kv_events``, a ZMQ endpoint to connect to)
    and serves their replays (``kv_replay``), and the topic it publishes them under
    (``kv_topic``: events under any other are refused; ``None``: the first topic it uses)."""

    url: str = attrs.field(validator=_url)
    kv_events: str | None = attrs.field(default=None, validator=_endpoint)
    kv_replay: str | None = attrs.field(default=None, validator=_endpoint)
    kv_topic: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.kv_replay is not None and self.kv_events is None:
            raise ConfigError(f"backend {self.url}: a replay endpoint needs a KV-event endpoint")
        if self.kv_topic is not None and (
            not isinstance(self.kv_topic, str) or self.kv_events is None
        ):
            raise ConfigError(
                f"backend {self.url}: kv_topic must be a str, with a KV-event endpoint; got "
                f"{self.kv_topic!r}"
            )


def _backends(value: Sequence[Backend]) -> tuple[Backend, ...]:
    out = tuple(value)
    if not out:
        raise ConfigError("at least one backend is needed")
    urls = [b.url for b in out]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"backend URLs must be unique, got {urls!r}")
    return out


def _keys(value: Mapping[str, str | None]) -> dict[str, str | None]:
    out = dict(value)
    for key, tenant in out.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"API keys must be non-empty strs, got {key!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigError(f"a key's tenant must be None or a non-empty str, got {tenant!r}")
    return out


def _positive(name: str) -> Any:
    def check(_i: object, _a: object, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name} must be a number > 0, got {value!r}")

    return check


def _non_negative(name: str) -> Any:
    def check(_i: object, _a: object, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")

    return check


def _at_least_one(name: str) -> Any:
    def check(_i: object, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class RouteConfig:
    """The router's settings.

    - ``policy``: ``"burst"`` (default), ``"prefix"`` or ``"round_robin"``.
    - ``burst``: the window (`BurstConfig`; route keys of its ``block_size``).
    - ``engine_block_size``: the backends' KV block size (residency keys).
    - ``max_in_flight``: requests relayed at once; past it, 429 with ``Retry-After``.
    - ``timeout_s``: the longest wait for the next bytes of a backend's answer (a stream's
      next chunk).
    - ``first_byte_timeout_s``: the longest wait for a backend's answer to start (its
      status and headers; a non-streaming answer starts when it is complete): 504 past it.
    - Active health checks (as sglang-router's and vllm-router's): every
      ``health_interval_s`` each backend's ``GET /health`` is probed, with
      ``health_timeout_s``; ``health_failures`` failures in a row mark it down (no new
      requests; requests still waiting for its answer to start go to another backend), and
      one success marks it up. A refused connection marks it down at once.
    - The limits of ``prefixflight serve`` (``prefixflight.serve._limits``, the same
      middlewares): ``api_keys`` (key -> tenant or None; empty: no keys), ``max_body_bytes``
      (413 past it), ``client_timeout`` (a client silent that long while it sends its
      headers or body is dropped, 408), ``keep_alive_timeout``, ``shutdown_timeout`` (on
      SIGINT/SIGTERM, how long relayed requests may take to finish).
    """

    backends: tuple[Backend, ...] = attrs.field(converter=_backends)
    policy: PolicyName = "burst"
    burst: BurstConfig = attrs.field(factory=BurstConfig)
    engine_block_size: int = attrs.field(default=16, validator=_at_least_one("engine_block_size"))
    max_in_flight: int = attrs.field(default=1024, validator=_at_least_one("max_in_flight"))
    api_keys: Mapping[str, str | None] = attrs.field(factory=dict, converter=_keys)
    max_body_bytes: int = attrs.field(default=32 * MIB, validator=_at_least_one("max_body_bytes"))
    client_timeout: float = attrs.field(default=30.0, validator=_positive("client_timeout"))
    keep_alive_timeout: float = attrs.field(default=5.0, validator=_positive("keep_alive_timeout"))
    shutdown_timeout: float = attrs.field(default=5.0, validator=_non_negative("shutdown_timeout"))
    timeout_s: float = attrs.field(default=600.0, validator=_positive("timeout_s"))
    first_byte_timeout_s: float = attrs.field(
        default=300.0, validator=_positive("first_byte_timeout_s")
    )
    health_interval_s: float = attrs.field(default=2.0, validator=_positive("health_interval_s"))
    health_timeout_s: float = attrs.field(default=2.0, validator=_positive("health_timeout_s"))
    health_failures: int = attrs.field(default=2, validator=_at_least_one("health_failures"))
    seed: int | None = 0

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


# -- keys -------------------------------------------------------------------------------------


@attrs.frozen
class RoutePrompt:
    """A request's prompt as the router keys it (a `Routable`): token ids when known, else
    text; the tenant ``namespace``."""

    prompt_ids: tuple[int, ...] | None
    text: str = ""
    namespace: str = ""

    def route_tokens(self) -> tuple[int, ...]:
        if self.prompt_ids:
            return self.prompt_ids
        return tuple(self.text.encode("utf-8"))


def _token_list(value: object) -> tuple[int, ...] | None:
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return tuple(value)
    return None


def _messages_text(messages: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], separators=(",", ":"))


def tenant_salt(body: Mapping[str, Any], tenant: str | None) -> str | None:
    """The ``cache_salt`` relayed for a request authenticated by an API key whose tenant is
    ``tenant`` (``None``: a key without one): ``"pf-"`` and the SHA-256 of ``[tenant, the
    client's cache_salt]`` as JSON, so a backend (vLLM, ``prefixflight serve``) keeps each
    tenant's cached blocks apart without a keys file of its own, and no client's salt can
    equal another tenant's. The digest's 67 characters pass vLLM's check of a salt (at most
    128 characters, no ``@``, ``/``, ``\\`` or NUL), whatever the tenant and the client's
    salt hold. A request with neither keeps no salt (the shared namespace). Raises
    `HttpError` (400) for a ``cache_salt`` that is not a non-empty string."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise HttpError(
            400, f"cache_salt must be a non-empty string, got {salt!r}", param="cache_salt"
        )
    _unicode(salt, "cache_salt")
    if tenant is None and salt is None:
        return None
    return "pf-" + hashlib.sha256(json.dumps([tenant, salt]).encode()).hexdigest()


def _unicode(text: object, param: str) -> None:
    """400 for a string that is not valid Unicode text (a lone surrogate, from JSON's
    ``"\\ud800"``), naming the character and where it is."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise HttpError(
            400,
            f"{param} is not valid Unicode: {bad!r} at index {exc.start} is a lone surrogate",
            param=param,
        ) from None


async def route_prompt(
    endpoint: str,
    body: Mapping[str, Any],
    codec: Codec | None,
    *,
    tenant: str | None = None,
    keyed: bool = False,
) -> RoutePrompt:
    """The `RoutePrompt` of a completions (``prompt``) or chat (``messages``) body; a batch
    prompt is keyed by its first entry. Raises `HttpError` (400) naming a malformed field;
    other fields are the backend's to check. Tokenizing runs in a worker thread. The
    namespace is the ``cache_salt``; behind API keys (``keyed``, or a ``tenant`` given), the
    salt `tenant_salt` relays, which the key's tenant prefixes."""
    if keyed or tenant is not None:
        namespace = tenant_salt(body, tenant) or ""
    else:
        namespace = "" if tenant_salt(body, None) is None else str(body["cache_salt"])
    if endpoint == "chat":
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise HttpError(400, "messages must be a non-empty list of objects", param="messages")
        if codec is None:
            return RoutePrompt(None, _messages_text(messages), namespace)
        plain = [
            {"role": str(m.get("role")), "content": _content(m.get("content"))} for m in messages
        ]
        chat_ids = await _off_loop(codec.chat, plain)
        return RoutePrompt(tuple(chat_ids), "", namespace)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: keyed by its first prompt
    ids = _token_list(prompt)
    if ids is not None:
        return RoutePrompt(ids, "", namespace)
    if not isinstance(prompt, str) or not prompt:
        raise HttpError(
            400, "prompt must be a non-empty string or list of token ids", param="prompt"
        )
    _unicode(prompt, "prompt")
    if codec is None:
        return RoutePrompt(None, prompt, namespace)
    return RoutePrompt(tuple(await _off_loop(codec.encode, prompt)), prompt, namespace)


def _content(content: object) -> str:
    """A chat message's text (parts of type text joined), for tokenizing its template."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


async def _off_loop(fn: Any, arg: Any) -> list[int]:
    try:
        out: list[int] = await asyncio.to_thread(fn, arg)
    except Exception as exc:  # a tokenizer refusing the input: the client's mistake
        raise HttpError(400, f"cannot tokenize the prompt: {exc}") from None
    return out


# -- the app ----------------------------------------------------------------------------------


@final
class _Metrics:
    def __init__(self, backends: Sequence[str], policy: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prefixflight_route_requests",
            "Requests relayed to a backend.",
            ["backend", "endpoint"],
            registry=r,
        )
        self.in_flight = Gauge(
            "prefixflight_route_in_flight",
            "Requests relayed and not finished.",
            ["backend"],
            registry=r,
        )
        self.up = Gauge(
            "prefixflight_route_backend_up",
            "1 while the backend is believed up.",
            ["backend"],
            registry=r,
        )
        self.errors = Counter(
            "prefixflight_route_upstream_errors",
            "Requests a backend could not answer (connect, timeout, first_byte_timeout, "
            "transport, stream), requests sent again because a kept connection had been "
            "dropped (stale_connection) or moved to another backend because theirs was marked "
            "down before it answered (moved), and failed health probes (health).",
            ["backend", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "prefixflight_route_rejected",
            "Requests refused by the router.",
            ["reason"],
            registry=r,
        )
        self.decision = Histogram(
            "prefixflight_route_decision_seconds",
            "From a request's arrival to its routing decision (the window included).",
            ["policy"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.kv_blocks = Gauge(
            "prefixflight_route_kv_blocks",
            "Blocks the KV-event index holds per backend.",
            ["backend"],
            registry=r,
        )
        self.kv_errors = Counter(
            "prefixflight_route_kv_errors",
            "KV-event messages skipped, per backend and kind (frame, decode, seq, topic, apply, "
            "replay_timeout, replay_bound, internal; docs/kv-events.md).",
            ["backend", "kind"],
            registry=r,
        )
        self.kv_up = Gauge(
            "prefixflight_route_kv_subscriber_up",
            "1 while the KV-event subscriber's thread runs (goes round its loop).",
            registry=r,
        )
        self.kv_lag = Gauge(
            "prefixflight_route_kv_seq_lag",
            "Live KV-event batches seen and not yet applied, per backend.",
            ["backend"],
            registry=r,
        )
        self.kv_age = Gauge(
            "prefixflight_route_kv_last_batch_age_seconds",
            "Seconds since a backend's last KV-event batch was applied (-1 before the first).",
            ["backend"],
            registry=r,
        )
        self.kv_evicted = Gauge(
            "prefixflight_route_kv_evicted_blocks",
            "Blocks the KV-event index forgot to stay within its cap, per backend.",
            ["backend"],
            registry=r,
        )
        self.kv_seen: dict[tuple[str, str], int] = {}  # error counts already added
        for b in backends:
            self.up.labels(b).set(0)
            self.in_flight.labels(b).set(0)


@final
class _Router:
    """The app's state: the routing policy, the in-flight counts, the upstream client."""

    def __init__(self, config: RouteConfig, codec: Codec | None, index: PrefixIndex | None) -> None:
        self.config = config
        self.codec = codec
        self.names = [b.url for b in config.backends]
        self.state = RoutingState(
            config.burst,
            policy=config.policy,
            engine_block_size=config.engine_block_size,
            residency=index,
            seed=config.seed,
        )
        self.in_flight = dict.fromkeys(self.names, 0)
        self.up = dict.fromkeys(self.names, False)  # until a health probe answers
        self.failures = dict.fromkeys(self.names, 0)  # failed probes in a row
        self.went_down = {n: asyncio.Event() for n in self.names}  # set while down
        self.total_in_flight = 0
        self.draining = False
        self.idle: asyncio.Event | None = None  # set when the last relayed request ends
        self.metrics = _Metrics(self.names, config.policy)
        self.metrics.decision.labels(config.policy)
        self.waiters: dict[str, asyncio.Future[str]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.client: aiohttp.ClientSession | None = None
        self.fresh_client: aiohttp.ClientSession | None = None  # no kept connections
        self.health_task: asyncio.Task[None] | None = None
        self.subscriber: Any = None

    # -- loads and decisions --------------------------------------------------------------
    def loads(self) -> list[ReplicaLoad]:
        """The live backends and the load this router knows: its requests in flight there,
        reported as ``running`` (the window's tie-break) and as ``waiting`` (the approximate
        scorer's queue score), since the router cannot tell the engine's batch from its
        queue."""
        return [
            ReplicaLoad(name=n, running=self.in_flight[n], waiting=self.in_flight[n])
            for n in self.names
            if self.up[n]
        ]

    async def choose(self, rid: str, prompt: RoutePrompt) -> str:
        loads = self.loads()
        if not loads:
            self.metrics.rejected.labels("no_backend").inc()
            raise HttpError(503, "no backend is up", "service_unavailable")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self.waiters[rid] = future
        started = loop.time()
        try:
            decisions = self.state.submit(rid, prompt, max(started, self.state.now), loads)
        except BaseException:
            del self.waiters[rid]
            raise
        self.resolve(decisions)
        self.arm()
        try:
            name = await future
        finally:
            self.waiters.pop(rid, None)
        self.state.consumed(rid)
        self.metrics.decision.labels(self.config.policy).observe(loop.time() - started)
        return name

    def resolve(self, decisions: Sequence[Routed]) -> None:
        for d in decisions:
            future = self.waiters.get(str(d.request_id))
            if future is None or future.done():  # its client left while it waited
                self.state.consumed(str(d.request_id))
            else:
                future.set_result(d.replica)

    def arm(self) -> None:
        deadline = self.state.deadline
        timer = self.timer
        if timer is not None and (deadline is None or timer.when() != deadline):
            timer.cancel()
            self.timer = timer = None
        if deadline is not None and timer is None:
            self.timer = asyncio.get_running_loop().call_at(deadline, self.on_deadline)

    def on_deadline(self) -> None:
        self.timer = None
        loop = asyncio.get_running_loop()
        loads = self.loads() or [ReplicaLoad(name=n) for n in self.names]
        now = max(loop.time(), self.state.deadline or 0.0, self.state.now)
        self.resolve(self.state.tick(now, loads))
        self.arm()

    def least_loaded(self, excluding: str | None = None) -> str | None:
        live = [(self.in_flight[n], n) for n in self.names if self.up[n] and n != excluding]
        return min(live)[1] if live else None

    def mark(self, name: str, up: bool) -> None:
        self.up[name] = up
        self.metrics.up.labels(name).set(1 if up else 0)
        if up:
            self.failures[name] = 0
            self.went_down[name].clear()
        else:
            self.went_down[name].set()

    def count(self, name: str, delta: int) -> None:
        self.in_flight[name] += delta
        self.total_in_flight += delta
        if not self.total_in_flight and self.idle is not None:
            self.idle.set()
        self.metrics.in_flight.labels(name).set(self.in_flight[name])

    # -- relaying -------------------------------------------------------------------------
    async def send(
        self, name: str, method: str, path: str, request: Request, body: bytes | None
    ) -> aiohttp.ClientResponse:
        """The backend's answer, its headers read and its body still to come.

        A request whose pooled keep-alive connection the backend had closed (it fails while
        writing, or the connection drops before any answer) is sent again once, on a new
        connection that is not kept (the backend never started it). A refused connection is
        not retried here (`relay` tries another backend)."""
        assert self.client is not None and self.fresh_client is not None
        headers = {k: v for k in _RELAYED_HEADERS if (v := request.headers.get(k)) is not None}
        url = name + path
        try:
            return await self.client.request(method, url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            self.metrics.errors.labels(name, "stale_connection").inc()
        return await self.fresh_client.request(method, url, data=body, headers=headers)

    async def relay(
        self, endpoint: str, path: str, request: Request, body: bytes, first: str
    ) -> Response:
        """Send to ``first`` and relay its answer. A request goes to another backend when
        ``first`` refuses the connection, or is marked down (a failed health check) before
        its answer starts; its answer must start within ``first_byte_timeout_s``."""
        name = first
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.first_byte_timeout_s
        for _attempt in range(2 * len(self.names)):
            self.count(name, +1)
            try:
                upstream = await self.started(name, path, request, body, deadline)
            except _Moved:
                self.count(name, -1)
                self.metrics.errors.labels(name, "moved").inc()
                other = self.least_loaded(excluding=name)
                if other is None:
                    break
                name = other
                continue
            except aiohttp.ClientConnectorError:
                self.count(name, -1)
                self.metrics.errors.labels(name, "connect").inc()
                self.mark(name, False)
                other = self.least_loaded(excluding=name)
                if other is None:
                    break
                name = other
                continue
            except _FirstByteTimeout:
                self.count(name, -1)
                self.metrics.errors.labels(name, "first_byte_timeout").inc()
                raise HttpError(
                    504,
                    f"backend {name} did not start its answer within "
                    f"{self.config.first_byte_timeout_s:g} s",
                    "timeout",
                ) from None
            except asyncio.TimeoutError:
                self.count(name, -1)
                self.metrics.errors.labels(name, "timeout").inc()
                raise HttpError(504, f"backend {name} did not answer in time", "timeout") from None
            except aiohttp.ClientError as exc:
                self.count(name, -1)
                self.metrics.errors.labels(name, "transport").inc()
                raise HttpError(502, f"backend {name} failed: {exc}", "bad_gateway") from None
            except BaseException:
                self.count(name, -1)
                raise
            self.metrics.requests.labels(name, endpoint).inc()
            return await self.answer(name, upstream)
        raise HttpError(503, "no backend is up", "service_unavailable")

    async def started(
        self, name: str, path: str, request: Request, body: bytes, deadline: float
    ) -> aiohttp.ClientResponse:
        """`send`, until the answer starts; raises `_Moved` if ``name`` is marked down
        first while another backend is up, `_FirstByteTimeout` past ``deadline``. (The send
        runs in this task, cancelled by a watcher: the answer is read as soon as it comes.)"""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        why: list[type[Exception]] = []

        def stop(reason: type[Exception]) -> None:
            if not why:
                why.append(reason)
                task.cancel()

        async def watch() -> None:
            await self.went_down[name].wait()
            if self.least_loaded(excluding=name) is not None:
                stop(_Moved)

        watcher = asyncio.ensure_future(watch())
        timer = loop.call_at(deadline, stop, _FirstByteTimeout)
        try:
            return await self.send(name, "POST", path, request, body)
        except asyncio.CancelledError:
            if not why:
                raise
            if hasattr(task, "uncancel"):
                task.uncancel()
            raise why[0]() from None
        finally:
            timer.cancel()
            watcher.cancel()

    async def answer(self, name: str, upstream: aiohttp.ClientResponse) -> Response:
        media = upstream.headers.get("content-type", "")
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
        if upstream.status == 200 and media.startswith("text/event-stream"):
            return _Relay(self, name, upstream, headers)
        try:
            content = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.metrics.errors.labels(name, "transport").inc()
            raise HttpError(502, f"backend {name} failed: {exc}", "bad_gateway") from None
        finally:
            upstream.release()
            self.count(name, -1)
        return Response(
            content, status_code=upstream.status, media_type=media or None, headers=headers
        )

    async def drain(self) -> None:
        """Refuse new requests (503); give those relayed ``shutdown_timeout`` seconds."""
        self.draining = True
        if self.total_in_flight:
            self.idle = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.idle.wait(), self.config.shutdown_timeout)

    # -- health ---------------------------------------------------------------------------
    async def watch_health(self) -> None:
        """Probe every backend each ``health_interval_s`` (the first round is the app's
        start-up's)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(n) for n in self.names))

    async def probe(self, name: str) -> None:
        """``GET /health`` of ``name`` on a connection of its own: 200 marks it up;
        ``health_failures`` failures in a row (another status, no answer within
        ``health_timeout_s``, a refused connection) mark it down."""
        assert self.fresh_client is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        ok = False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with self.fresh_client.get(name + "/health", timeout=timeout) as answer:
                ok = answer.status == 200
        if ok:
            if not self.up[name]:
                self.mark(name, True)
            self.failures[name] = 0
            return
        self.metrics.errors.labels(name, "health").inc()
        self.failures[name] += 1
        if self.up[name] and self.failures[name] >= self.config.health_failures:
            self.mark(name, False)

    def health(self) -> dict[str, Any]:
        """``/health``'s body: the backends' state and the KV-event subscriber's."""
        sub = self.subscriber
        out: dict[str, Any] = {
            "status": "ok",
            "backends": {
                n: {
                    "up": self.up[n],
                    "in_flight": self.in_flight[n],
                    "failed_probes": self.failures[n],
                }
                for n in self.names
            },
        }
        if sub is not None:
            alive = bool(sub.alive)
            replicas = {
                n: {
                    "next_seq": st.next_seq,
                    "lag": st.lag,
                    "last_batch_age_s": (
                        None if st.last_batch_age_s is None else round(st.last_batch_age_s, 3)
                    ),
                    "blocks": st.blocks,
                    "lost": st.lost,
                    "restarts": st.restarts,
                    "reconnections": st.reconnections,
                    "errors": dict(st.errors),
                }
                for n, st in sub.status().items()
            }
            out["kv_events"] = {"alive": alive, "backends": replicas}
            if not alive:
                out["status"] = "degraded"  # routing goes on without residency
        return out

    def scrape(self) -> bytes:
        sub = self.subscriber
        m = self.metrics
        if sub is not None:
            m.kv_up.set(1 if sub.alive else 0)
            for name, st in sub.status().items():
                m.kv_blocks.labels(name).set(st.blocks)
                m.kv_lag.labels(name).set(st.lag)
                age = st.last_batch_age_s
                m.kv_age.labels(name).set(-1 if age is None else age)
                m.kv_evicted.labels(name).set(sub.index.replica(name).stats.evicted)
            for key, n in sub.error_counts().items():
                added = n - m.kv_seen.get(key, 0)
                if added > 0:
                    m.kv_errors.labels(*key).inc(added)
                    m.kv_seen[key] = n
        return bytes(generate_latest(m.registry))


class _Moved(Exception):
    """The backend was marked down before its answer started: try another."""


class _FirstByteTimeout(Exception):
    """The backend's answer did not start within ``first_byte_timeout_s``."""


class _Relay(Response):
    """A backend's server-sent event stream relayed chunk by chunk. When the client goes
    away, or the stream ends or breaks, the upstream request is closed (a backend aborts a
    request whose connection closes) and the backend's in-flight count drops, once."""

    media_type: str | None = "text/event-stream"

    def __init__(
        self,
        router: _Router,
        name: str,
        upstream: aiohttp.ClientResponse,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(headers={**headers, "cache-control": "no-cache"})
        # a stream has no length (Response would declare an empty body)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._router = router
        self._name = name
        self._upstream = upstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        name, upstream = self._name, self._upstream
        whole = False  # the upstream answer was read to its end (its connection is reusable)

        async def pump() -> None:
            nonlocal whole
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in upstream.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                whole = True
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._router.metrics.errors.labels(name, "stream").inc()
                err = error_body(
                    502, f"backend {name} failed mid-stream: {type(exc).__name__}", "bad_gateway"
                )
                chunk = f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((pumping, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pumping, watching):
                task.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
            if whole:
                upstream.release()
            else:
                upstream.close()  # closes the connection: the backend aborts the request
            self._router.count(name, -1)


def _error_response(err: HttpError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.kind, err.param),
        status_code=err.status,
        headers=err.headers,
    )


# -- the routes: one APIRouter; the app's `_Router` reached through a dependency -----------
_routes = APIRouter()


def _router_of(request: Request) -> _Router:
    router: _Router = request.app.state.router
    return router


_RouterDep = Annotated[_Router, Depends(_router_of)]


@_routes.get("/health")
async def health(router: _RouterDep) -> Response:
    """200 with the backends' and the KV-event subscriber's state while a backend is up
    (``status``: ``"ok"``, or ``"degraded"`` while the subscriber's thread is not
    running); 503 when none is, or while shutting down."""
    if router.draining:
        raise HttpError(503, "the router is shutting down", "service_unavailable")
    if not any(router.up.values()):
        down = ", ".join(router.names)
        raise HttpError(
            503, f"no backend is up (none answered /health: {down})", "service_unavailable"
        )
    return JSONResponse(router.health())


@_routes.get("/metrics")
async def metrics(router: _RouterDep) -> Response:
    return Response(router.scrape(), media_type=CONTENT_TYPE_LATEST)


@_routes.get("/v1/models")
async def models(router: _RouterDep, request: Request) -> Response:
    return await _forward(router, "GET", "/v1/models", request, None)


@_routes.post("/tokenize")
async def tokenize(router: _RouterDep, request: Request) -> Response:
    return await _forward(router, "POST", "/tokenize", request, await request.body())


@_routes.post("/detokenize")
async def detokenize(router: _RouterDep, request: Request) -> Response:
    return await _forward(router, "POST", "/detokenize", request, await request.body())


@_routes.post("/v1/completions")
async def completions(router: _RouterDep, request: Request) -> Response:
    return await _generate(router, "completions", "/v1/completions", request)


@_routes.post("/v1/chat/completions")
async def chat(router: _RouterDep, request: Request) -> Response:
    return await _generate(router, "chat", "/v1/chat/completions", request)


async def _forward(
    router: _Router, method: str, path: str, request: Request, body: bytes | None
) -> Response:
    """A stateless call: to the least loaded live backend."""
    name = router.least_loaded()
    if name is None:
        raise HttpError(503, "no backend is up", "service_unavailable")
    if method == "POST":
        assert body is not None
        return await router.relay(path.strip("/"), path, request, body, name)
    router.count(name, +1)
    try:
        upstream = await router.send(name, method, path, request, None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        router.count(name, -1)
        raise HttpError(502, f"backend {name} failed: {exc}", "bad_gateway") from None
    return await router.answer(name, upstream)


async def _generate(router: _Router, endpoint: str, path: str, request: Request) -> Response:
    """A completion or chat request: checked, keyed, placed by the routing policy, relayed."""
    config = router.config
    if router.draining:
        raise HttpError(503, "the router is shutting down", "service_unavailable")
    body = await request.body()
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        raise HttpError(400, "the request body is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise HttpError(400, "the request body must be a JSON object")
    if router.total_in_flight >= config.max_in_flight:
        router.metrics.rejected.labels("overloaded").inc()
        raise HttpError(
            429,
            f"the router is overloaded: {router.total_in_flight} requests in flight, the "
            f"limit is {config.max_in_flight}; retry later",
            "rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    tenant = getattr(request.state, "tenant", None)  # set by ApiKeys with a keys file
    keyed = bool(config.api_keys)
    prompt = await route_prompt(endpoint, parsed, router.codec, tenant=tenant, keyed=keyed)
    if keyed:  # the backend keeps tenants apart by the salt (see tenant_salt)
        salt = tenant_salt(parsed, tenant)
        if salt is None:
            parsed.pop("cache_salt", None)
        else:
            parsed["cache_salt"] = salt
        body = json.dumps(parsed).encode()
    rid = uuid.uuid4().hex
    name = await router.choose(rid, prompt)
    return await router.relay(endpoint, path, request, body, name)


def build_route_app(
    config: RouteConfig,
    *,
    codec: Codec | None = None,
    index: PrefixIndex | None = None,
) -> FastAPI:
    """The router as a FastAPI app. ``codec`` keys text prompts by token ids (see the module
    docstring); ``index`` is a residency source to use instead of the backends' KV events
    (which are followed, from app start-up to shutdown, when any `Backend` names them)."""
    kv = [b for b in config.backends if b.kv_events is not None]
    subscriber: Any = None
    if index is None and kv:
        from .kv_events import KVEventSubscriber, PublisherAddress

        subscriber = KVEventSubscriber(
            {b.url: PublisherAddress(str(b.kv_events), b.kv_replay, topic=b.kv_topic) for b in kv},
            hasher=BlockHasher(block_size=config.engine_block_size),
        )
        index = subscriber.index
    router = _Router(config, codec, index)
    router.subscriber = subscriber

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=config.timeout_s)
        # no cap on connections to backends; idle ones closed before a uvicorn backend's
        # default keep-alive (5 s) would close them under a request
        router.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0), timeout=timeout
        )
        router.fresh_client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout
        )
        if subscriber is not None:
            subscriber.start()
        await router.probe_all()  # /health and routing start from the backends' real state
        router.health_task = asyncio.ensure_future(router.watch_health())
        try:
            yield
        finally:
            router.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await router.health_task
            if router.timer is not None:
                router.timer.cancel()
            await router.client.close()
            await router.fresh_client.close()
            if subscriber is not None:
                subscriber.close()

    app = FastAPI(title="prefixflight route", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    app.add_middleware(BodyLimits, max_bytes=config.max_body_bytes, timeout=config.client_timeout)
    if config.api_keys:
        app.add_middleware(ApiKeys, keys=config.api_keys)  # outermost: before any body is read

    @app.exception_handler(HttpError)
    async def http_error(_r: Request, exc: HttpError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def starlette_error(_r: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(
            HttpError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        )

    @app.exception_handler(Exception)
    async def crashed(_r: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            HttpError(500, f"internal router error ({type(exc).__name__})", "server_error")
        )

    app.include_router(_routes)
    return app


def route_server(app: FastAPI, *, log_level: str = "warning", access_log: bool = False) -> Any:
    """The uvicorn server for a router app (from `build_route_app`), as ``prefixflight
    serve``'s: a deadline for request headers, the keep-alive timeout, and a shutdown that
    first stops accepting, then lets the relayed requests finish for ``shutdown_timeout``."""
    router: _Router = app.state.router
    return GracefulServer.for_app(
        app,
        router.drain,
        client_timeout=router.config.client_timeout,
        keep_alive_timeout=router.config.keep_alive_timeout,
        log_level=log_level,
        access_log=access_log,
    )


def serve(
    app: FastAPI, sock: socket.socket, *, log_level: str = "warning", access_log: bool = False
) -> None:
    """Serve a router app on an already bound socket until SIGINT or SIGTERM, then shut
    down gracefully (`route_server`) and return normally."""
    from .http import _sigterm_returns

    server = route_server(app, log_level=log_level, access_log=access_log)
    with _sigterm_returns():
        server.serve_on(sock)
