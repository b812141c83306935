"""``prefixflight route`` for real: two tiny-model ``prefixflight serve`` backends (each with
its KV-event publisher), the router in front on a free loopback port, driven by the openai
client and httpx. Where a request ran is read from the backends' own answers and metrics."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from ..conftest import source_env  # noqa: E402
from .conftest import MODEL_NAME, PAGE, CharCodec, ServerThread, openai_client  # noqa: E402
from .test_http import metrics, until, value  # noqa: E402

pytestmark = pytest.mark.torch


class Backend:
    """A tiny-model server publishing its KV events on a free loopback port."""

    def __init__(self, model: Any) -> None:
        from prefixflight.backends.torch import AsyncEngine, EngineConfig
        from prefixflight.serve.http import ServerConfig, build_app
        from prefixflight.serve.kv_events import KVEventPublisher

        self.publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        engine = AsyncEngine.from_model(
            model,
            EngineConfig(block_size=PAGE, max_batch_tokens=256, num_pages=1024, max_running=16),
            eos_token_ids=[CharCodec.EOS],
            event_sink=self.publisher,
            device="cpu",
        )
        self.server = ServerThread(
            build_app(engine, CharCodec(), ServerConfig(model_name=MODEL_NAME))
        )
        self.server.start()
        self.url = self.server.base_url

    def requests_served(self) -> float:
        """Prompt tokens this backend has seen (its own vllm:prompt_tokens counter)."""
        return value(metrics(self.server), "vllm:prompt_tokens_total")

    def aborted(self) -> float:
        """Requests this backend has aborted (its vllm:request_success_total for "abort")."""
        return value(metrics(self.server), "vllm:request_success_total", finished_reason="abort")

    def unfinished(self) -> bool:
        async def read() -> bool:
            app: Any = self.server.server.config.app
            engine = app.state.server.engine
            return bool(engine.scheduler.has_unfinished)

        return bool(self.server.call(read()))

    def stop(self) -> None:
        self.server.stop()
        self.publisher.close()


@pytest.fixture(scope="module")
def backends(tiny: Any) -> Iterator[list[Backend]]:
    started = [Backend(tiny), Backend(tiny)]
    yield started
    for b in started:
        b.stop()


@pytest.fixture
def start_router(backends: list[Backend]) -> Iterator[Callable[..., ServerThread]]:
    """Start routers in front of the two backends (KV events followed); stopped after the test."""
    from prefixflight.serve.route import Backend as RouteBackend
    from prefixflight.serve.route import RouteConfig, build_route_app, route_server

    started: list[ServerThread] = []

    def start(
        urls: list[str] | None = None, *, kv: bool = True, healthy: bool = True, **config: Any
    ) -> ServerThread:
        targets = [
            RouteBackend(
                url=b.url,
                kv_events=b.publisher.endpoint if kv else None,
                kv_replay=b.publisher.replay_endpoint if kv else None,
            )
            for b in backends
        ]
        if urls is not None:
            targets = [RouteBackend(url=u) for u in urls]
        config.setdefault("engine_block_size", PAGE)
        app = build_route_app(RouteConfig(backends=tuple(targets), **config), codec=CharCodec())
        started.append(ServerThread(app, make_server=route_server).start(healthy=healthy))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def client(server: ServerThread, **kw: Any) -> Any:
    return openai_client(server.base_url, **kw)


def router_state(router: ServerThread) -> Any:
    app: Any = router.server.config.app
    return app.state.router


def routed(router: ServerThread) -> dict[str, float]:
    """Requests the router relayed, per backend (its own metrics)."""
    text = httpx.get(router.base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "prefixflight_route_requests_total":
                out[s.labels["backend"]] = out.get(s.labels["backend"], 0.0) + s.value
    return out


def prompt(n: int = 40) -> str:
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


async def burst(base_url: str, text: str, n: int, **kw: Any) -> list[Any]:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused") as c:
        return list(
            await asyncio.gather(
                *(
                    c.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, **kw)
                    for _ in range(n)
                )
            )
        )


# -- placement ---------------------------------------------------------------------------------
def test_a_burst_of_identical_prompts_lands_on_one_backend(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    router = start_router(policy="burst")
    before = [b.requests_served() for b in backends]
    text = prompt(41)
    answers = asyncio.run(burst(router.base_url, text, 8, temperature=0))
    grew = [b.requests_served() - x for b, x in zip(backends, before, strict=True)]
    assert sorted(grew) == [0.0, 8 * 41.0], grew  # all 8 on one backend
    assert len({a.choices[0].text for a in answers}) == 1  # greedy: one answer
    assert sum(routed(router).values()) == 8


def test_round_robin_alternates(start_router: Callable[..., ServerThread]) -> None:
    router = start_router(policy="round_robin")
    c = client(router)
    for _ in range(4):
        c.completions.create(model=MODEL_NAME, prompt=prompt(), max_tokens=2)
    assert sorted(routed(router).values()) == [2.0, 2.0]


def test_a_lone_request_goes_where_its_prefix_is_resident_per_the_kv_events(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    """Each prompt is first sent to one backend directly; the router, which saw none of
    them, learns from the backends' KV events where they are and sends each there."""
    from prefixflight.core import BlockHasher

    router = start_router(policy="prefix")
    state = router_state(router)
    index = state.subscriber.index
    hasher = BlockHasher(block_size=PAGE)
    warm = [(prompt(40), backends[i % 2]) for i in range(6)]
    for text, backend in warm:
        client(backend.server).completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
        blocks = hasher.hash_tokens(CharCodec().encode(text))
        url = backend.url
        until(lambda: index.prefix_blocks(url, blocks) == len(blocks), "the KV events")  # noqa: B023
    for text, backend in warm:
        before = backend.requests_served()
        client(router).completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
        assert backend.requests_served() == before + 40, "routed away from its resident prefix"


# -- relaying ----------------------------------------------------------------------------------
def test_streams_pass_through_chunk_by_chunk(start_router: Callable[..., ServerThread]) -> None:
    router = start_router(policy="burst", burst=_window(5))
    text = prompt(30)
    whole = client(router).completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=12, temperature=0
    )
    parts = list(
        client(router).completions.create(
            model=MODEL_NAME, prompt=text, max_tokens=12, temperature=0, stream=True
        )
    )
    assert len(parts) > 1
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    with client(router).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    ) as chat:
        assert next(c.choices[0].delta.role for c in chat) == "assistant"
    raw = httpx.post(
        router.base_url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": text, "max_tokens": 3, "stream": True},
        timeout=30,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n")


def test_models_health_metrics_and_tokenize(start_router: Callable[..., ServerThread]) -> None:
    router = start_router()
    assert [m.id for m in client(router).models.list()] == [MODEL_NAME]
    assert httpx.get(router.base_url + "/health").status_code == 200
    got = httpx.post(router.base_url + "/tokenize", json={"prompt": "abc"}).json()
    assert got["tokens"] == CharCodec().encode("abc")
    text = httpx.get(router.base_url + "/metrics").text
    assert "prefixflight_route_backend_up" in text and "prefixflight_route_kv_blocks" in text


def test_a_backends_error_passes_through(start_router: Callable[..., ServerThread]) -> None:
    router = start_router()
    with pytest.raises(openai.NotFoundError) as info:
        client(router).completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    assert "no-such-model" in str(info.value)


def test_a_client_that_leaves_mid_stream_aborts_the_request_upstream(
    start_router: Callable[..., ServerThread], backends: list[Backend], step_gate: Any
) -> None:
    router = start_router(policy="round_robin")
    body = {
        "model": MODEL_NAME,
        "prompt": prompt(20),
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    before = sum(b.aborted() for b in backends)
    step_gate.hold_after(3)  # the request runs until the test lets it go on, whatever the speed
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # held: dropping a half-read iterator closes the connection
        first = next(chunks)  # the first chunk arrived: the request runs on a backend
        assert any(b.unfinished() for b in backends), first
    # the client is gone: the router drops its upstream stream and the backend aborts
    until(lambda: sum(b.aborted() for b in backends) == before + 1, "the backend to abort it")
    step_gate.release()
    until(lambda: not any(b.unfinished() for b in backends), "the backend to finish the step")
    until(lambda: router_state(router).total_in_flight == 0, "the router's count")


# -- errors and limits -------------------------------------------------------------------------
def test_bad_bodies_are_refused_naming_the_problem(
    start_router: Callable[..., ServerThread],
) -> None:
    router = start_router(max_body_bytes=2000)
    url = router.base_url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL_NAME, "prompt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/../chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, json={"model": MODEL_NAME, "prompt": "x" * 3000})
    assert r.status_code == 413 and "the limit is 2000" in r.json()["error"]["message"]
    assert sum(routed(router).values()) == 0  # none of them reached a backend


def test_api_keys(start_router: Callable[..., ServerThread]) -> None:
    router = start_router(api_keys={"k1": None, "k2": None})
    with pytest.raises(openai.AuthenticationError):
        openai_client(router.base_url, api_key="wrong").models.list()
    c = openai_client(router.base_url, api_key="k2")
    assert c.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1).choices
    assert httpx.get(router.base_url + "/health").status_code == 200  # probes need no key


def test_a_dead_backend_is_skipped_and_all_dead_is_503(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    dead = _closed_port_url()
    router = start_router([dead, backends[0].url], policy="round_robin", health_interval_s=60)
    c = client(router)
    for _ in range(4):
        assert c.completions.create(model=MODEL_NAME, prompt=prompt(), max_tokens=1).choices
    assert routed(router) == {backends[0].url: 4.0}
    assert router_state(router).up[dead] is False
    only_dead = start_router([dead], policy="round_robin", health_interval_s=60, healthy=False)
    with pytest.raises(openai.InternalServerError) as info:
        client(only_dead, max_retries=0).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=1
        )
    assert info.value.status_code == 503
    assert httpx.get(only_dead.base_url + "/health").status_code == 503


class LoopbackServer:
    """A real loopback TCP server: each accepted connection is handled on a thread of its
    own by `handle` (subclasses say how to misbehave); `stop` closes the listening socket
    and the connections still held."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by stop()
                return
            self.held.append(conn)
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def read_request(conn: socket.socket) -> bytes:
    """Read one HTTP request (its head and a ``Content-Length`` body); its head, or b"" at
    EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head


class RawBackend(LoopbackServer):
    """Answers its health probes, and every other request with ``reply`` (raw bytes,
    possibly a cut stream), then closes; with ``reply=None`` never answers those (the
    router's timeout decides)."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        if read_request(conn).startswith(b"GET /health "):
            conn.sendall(HEALTHY)
            conn.close()
        elif self.reply is not None:
            conn.sendall(self.reply)
            conn.close()


EVENT = b'data: {"choices": [{"text": "a"}]}\n\n'
CUT_STREAM = (  # one event in a chunked stream, then the connection drops
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"%x\r\n" % len(EVENT)
    + EVENT
    + b"\r\n"
)


def test_a_backend_that_breaks_mid_stream_ends_the_stream_with_an_error_event(
    start_router: Callable[..., ServerThread],
) -> None:
    backend = RawBackend(CUT_STREAM)
    try:
        router = start_router([backend.url], policy="round_robin")
        body = {"model": MODEL_NAME, "prompt": "hello", "stream": True}
        with httpx.stream("POST", router.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert text.startswith(EVENT.decode()), text
        assert "failed mid-stream" in text and text.endswith("data: [DONE]\n\n"), text
        until(lambda: router_state(router).total_in_flight == 0, "the router's count")
    finally:
        backend.stop()


def test_a_backend_that_never_answers_is_a_504_after_the_timeout(
    start_router: Callable[..., ServerThread],
) -> None:
    backend = RawBackend(None)
    try:
        router = start_router([backend.url], policy="round_robin", timeout_s=0.5)
        r = httpx.post(router.base_url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 504 and "did not answer in time" in r.json()["error"]["message"]
        assert router_state(router).total_in_flight == 0
    finally:
        backend.stop()


class DroppingBackend(LoopbackServer):
    """Answers the first request of each connection and keeps the connection open, then
    closes it when a second request arrives on it, without answering: a keep-alive
    connection the server dropped just as it was reused."""

    ANSWER = b'{"ok": true}'

    def handle(self, conn: socket.socket) -> None:
        with conn:
            if not read_request(conn):
                return
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + b"content-length: %d\r\n\r\n" % len(self.ANSWER)
                + self.ANSWER
            )
            read_request(conn)  # the next request on this connection: dropped


def test_a_keep_alive_connection_the_backend_dropped_is_retried_on_a_new_one(
    start_router: Callable[..., ServerThread],
) -> None:
    backend = DroppingBackend()
    try:
        router = start_router([backend.url], policy="round_robin")
        url = router.base_url + "/v1/completions"
        for _ in range(3):  # the second and third reuse a connection the backend then drops
            r = httpx.post(url, json={"prompt": "x"}, timeout=30)
            assert r.status_code == 200 and r.json() == {"ok": True}, r.text
        text = httpx.get(router.base_url + "/metrics", timeout=10).text
        assert 'kind="stale_connection"' in text, text
        assert router_state(router).total_in_flight == 0
    finally:
        backend.stop()


def test_config_mistakes_name_the_value() -> None:
    from prefixflight.core import ConfigError
    from prefixflight.serve.route import Backend as RouteBackend
    from prefixflight.serve.route import RouteConfig

    with pytest.raises(ConfigError, match="'localhost:8000'"):
        RouteBackend(url="localhost:8000")
    with pytest.raises(ConfigError, match="without /v1"):
        RouteBackend(url="http://h:1/v1")
    with pytest.raises(ConfigError, match="kv_events must be a ZMQ address"):
        RouteBackend(url="http://h:1", kv_events="h:5557")
    with pytest.raises(ConfigError, match="unique"):
        RouteConfig(backends=(RouteBackend(url="http://h:1"), RouteBackend(url="http://h:1")))
    with pytest.raises(ConfigError, match="policy must be one of"):
        RouteConfig(backends=(RouteBackend(url="http://h:1"),), policy="random")  # type: ignore[arg-type]


def _window(ms: int) -> Any:
    from prefixflight.core import BurstConfig

    return BurstConfig(window_ms=ms)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# -- hardening: tenants, hung backends, /health, hostile KV peers ------------------------------
def cached_tokens(router: ServerThread, key: str, text: str, **extra: Any) -> int:
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 1, **extra}
    r = httpx.post(
        router.base_url + "/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_router_writes_the_tenant_into_the_salt_so_backends_keep_tenants_apart(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    """Behind the router's keys file, a backend without one (``prefixflight serve`` here)
    serves a tenant's cached prefix to that tenant only, whatever salt the others send."""
    from prefixflight.serve.route import tenant_salt

    router = start_router(
        [backends[0].url], api_keys={"kA": "tenantA", "kB": "tenantB", "kC": None}
    )
    text = prompt(200)
    assert cached_tokens(router, "kA", text) == 0
    assert cached_tokens(router, "kA", text) >= 196  # the same tenant hits
    assert cached_tokens(router, "kB", text) == 0  # another tenant misses
    forged = tenant_salt({}, "tenantA")  # A's salt as the backend sees it
    assert forged is not None
    assert cached_tokens(router, "kB", text, cache_salt=forged) == 0
    assert cached_tokens(router, "kC", text, cache_salt=forged) == 0  # a key without tenant
    assert cached_tokens(router, "kC", text) == 0
    # a client's own salt divides its tenant's namespace, never joins another's
    assert cached_tokens(router, "kA", text, cache_salt="s1") == 0
    assert cached_tokens(router, "kA", text, cache_salt="s1") >= 196


class HangingBackend(LoopbackServer):
    """A backend that answers (health probes with 200, completions with a small answer)
    until `hang` is set; then it reads requests and answers none, as a stopped process
    would, until `resume` (its held requests are then dropped)."""

    ANSWER = b'{"choices": [{"text": "x"}]}'

    def __init__(self) -> None:
        import threading

        self.hang = threading.Event()
        self.resumed = threading.Event()
        self.held_requests = 0
        super().__init__()

    def resume(self) -> None:
        self.hang.clear()
        self.resumed.set()

    def handle(self, conn: socket.socket) -> None:
        with conn:
            while head := read_request(conn):
                if self.hang.is_set():
                    self.held_requests += 1
                    self.resumed.wait(60)
                    return
                reply = b"{}" if head.startswith(b"GET /health ") else self.ANSWER
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + b"content-length: %d\r\n\r\n" % len(reply)
                    + reply
                )


def test_a_backend_that_stops_answering_is_marked_down_and_its_waiting_requests_move(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    hung = HangingBackend()
    try:
        router = start_router(
            [hung.url, backends[0].url],
            policy="round_robin",
            health_interval_s=0.2,
            health_timeout_s=0.5,
            health_failures=2,
        )
        state = router_state(router)
        hung.hang.set()
        started = time.monotonic()

        async def four() -> list[Any]:
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"model": MODEL_NAME, "prompt": prompt(), "max_tokens": 1}
                url = router.base_url + "/v1/completions"
                return list(await asyncio.gather(*(c.post(url, json=body) for _ in range(4))))

        answers = asyncio.run(four())
        took = time.monotonic() - started
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert all("usage" in a.json() for a in answers)  # all answered by the real backend
        assert took < 10, took
        assert state.up[hung.url] is False and hung.held_requests >= 2
        health = httpx.get(router.base_url + "/health").json()
        assert health["backends"][hung.url]["up"] is False
        text = httpx.get(router.base_url + "/metrics").text
        assert 'kind="moved"' in text and 'kind="health"' in text
        hung.resume()
        until(lambda: state.up[hung.url], "the backend to be marked up again")
    finally:
        hung.resume()
        hung.stop()


def test_a_backend_whose_answer_does_not_start_in_time_is_a_504(
    start_router: Callable[..., ServerThread],
) -> None:
    hung = HangingBackend()
    try:
        router = start_router([hung.url], policy="round_robin", first_byte_timeout_s=0.5)
        hung.hang.set()  # no other backend: the request stays, then the deadline ends it
        r = httpx.post(router.base_url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 504, r.text
        assert "did not start its answer within 0.5 s" in r.json()["error"]["message"]
        assert router_state(router).total_in_flight == 0
    finally:
        hung.resume()
        hung.stop()


def test_health_reports_the_backends_and_the_kv_subscriber(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    router = start_router()
    got = httpx.get(router.base_url + "/health")
    assert got.status_code == 200
    body = got.json()
    assert body["status"] == "ok"
    assert {u: b["up"] for u, b in body["backends"].items()} == {b.url: True for b in backends}
    assert body["kv_events"]["alive"] is True
    assert set(body["kv_events"]["backends"]) == {b.url for b in backends}
    router_state(router).subscriber.close()  # its thread ends: residency is frozen
    body = httpx.get(router.base_url + "/health").json()
    assert body["status"] == "degraded" and body["kv_events"]["alive"] is False
    assert "prefixflight_route_kv_subscriber_up 0.0" in httpx.get(router.base_url + "/metrics").text
    dead = start_router([_closed_port_url()], healthy=False)
    r = httpx.get(dead.base_url + "/health")
    assert r.status_code == 503 and "no backend is up" in r.json()["error"]["message"]
    assert httpx.get(dead.base_url + "/v1/models").status_code == 503  # consistent


def test_a_lone_surrogate_is_a_400_naming_it(start_router: Callable[..., ServerThread]) -> None:
    router = start_router()
    for body in ('{"prompt": "ab\\ud800"}', '{"prompt": "x", "cache_salt": "\\udfff"}'):
        r = httpx.post(
            router.base_url + "/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400, r.text
        assert "lone surrogate" in r.json()["error"]["message"], r.text
    assert sum(routed(router).values()) == 0


def test_a_new_salt_on_every_request_keeps_a_bounded_number_of_hashers(
    start_router: Callable[..., ServerThread],
) -> None:
    from prefixflight.serve._routing import MAX_HASHERS
    from prefixflight.serve.route import RoutePrompt

    router = start_router(policy="prefix")
    state = router_state(router).state
    c = client(router)
    for i in range(20):
        c.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"cache_salt": f"s{i}"}
        )
    assert len(state._route_hashers) == 20  # one per salt so far
    for i in range(MAX_HASHERS + 10):  # past the cap, without HTTP
        state.route_request(f"r{i}", RoutePrompt((1, 2, 3), namespace=f"n{i}"))
    assert len(state._route_hashers) == MAX_HASHERS
    assert "s0" not in state._route_hashers  # the least recently used went first


def test_a_hostile_kv_peer_at_one_backends_endpoint_blinds_nothing(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    """Our own PUB socket stands at backend 1's KV endpoint and sends frames that once
    killed the subscriber's thread; backend 0's residency keeps flowing into the router."""
    import msgspec
    import zmq

    from prefixflight.core import BlockHasher
    from prefixflight.serve.route import Backend as RouteBackend
    from prefixflight.serve.route import RouteConfig, build_route_app, route_server

    pub: Any = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    evil = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    config = RouteConfig(
        backends=(
            RouteBackend(
                url=backends[0].url,
                kv_events=backends[0].publisher.endpoint,
                kv_replay=backends[0].publisher.replay_endpoint,
            ),
            RouteBackend(url=backends[1].url, kv_events=evil, kv_topic="kv@b1@tiny"),
        ),
        engine_block_size=PAGE,
        policy="prefix",
    )
    router = ServerThread(build_route_app(config, codec=CharCodec()), make_server=route_server)
    router.start()
    try:
        sub = router_state(router).subscriber
        t = b"kv@b1@tiny"
        hostile = [
            [t, (2**64 - 1).to_bytes(8, "big"), b"\x90"],  # seq 2**64-1
            [t, (1).to_bytes(8, "big"), b"\x91" * 10_000 + b"\xc0"],  # 10,000-deep
            [t, (2).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [], 0]) + b"\x00"],
            [b"kv@b0@tiny", (3).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [], 0])],
        ]

        def sent() -> bool:  # a SUB joins late: send until the errors show
            for frames in hostile:
                pub.send_multipart(frames)
            kinds = {k for (name, k) in sub.error_counts() if name == backends[1].url}
            return {"seq", "decode", "topic"} <= kinds

        until(sent, "the hostile frames to be counted")
        hasher = BlockHasher(block_size=PAGE)
        text = prompt(40)
        client(backends[0].server).completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
        blocks = hasher.hash_tokens(CharCodec().encode(text))
        index = sub.index
        url = backends[0].url
        until(lambda: index.prefix_blocks(url, blocks) == len(blocks), "backend 0's events")
        metrics = httpx.get(router.base_url + "/metrics").text
        assert f'prefixflight_route_kv_errors_total{{backend="{backends[1].url}",kind="seq"}}' in (
            metrics
        )
        assert "prefixflight_route_kv_subscriber_up 1.0" in metrics
        health = httpx.get(router.base_url + "/health").json()
        assert health["status"] == "ok" and health["kv_events"]["alive"] is True
        assert health["kv_events"]["backends"][backends[1].url]["errors"]["decode"] >= 1
    finally:
        router.stop()
        pub.close(linger=0)


def test_file_descriptors_return_to_their_baseline_after_many_streams(
    start_router: Callable[..., ServerThread],
) -> None:
    """100 concurrent streams, 20 of them left mid-stream: the process's descriptors
    (router and backends share it) come back to what they were once connections idle out."""
    import os

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    router = start_router()
    c = client(router)
    c.completions.create(model=MODEL_NAME, prompt="warm", max_tokens=1)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    until(lambda: router_state(router).total_in_flight == 0, "the warm-up to end")
    baseline = fds()

    async def streams() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:

            async def one(i: int) -> None:
                body = {"model": MODEL_NAME, "prompt": prompt(), "max_tokens": 8, "stream": True}
                url = router.base_url + "/v1/completions"
                async with http.stream("POST", url, json=body) as s:
                    async for _ in s.aiter_raw():
                        if i % 5 == 0:
                            break  # a client that leaves mid-stream

            await asyncio.gather(*(one(i) for i in range(100)))

    asyncio.run(streams())
    peak = fds()
    until(lambda: fds() <= baseline + 4, f"descriptors back to {baseline} (peak {peak})")
    until(lambda: router_state(router).total_in_flight == 0, "the router's count")


def test_a_stopped_prefixflight_serve_costs_its_waiting_requests_seconds_not_the_stop(
    start_router: Callable[..., ServerThread], backends: list[Backend]
) -> None:
    """The probe as run: a real ``prefixflight serve --model tiny`` process, stopped with
    SIGSTOP while requests go to it. The router's health checks mark it down, its waiting
    requests move to the other backend, and it is marked up once it runs again."""
    import os
    import re
    import signal
    import subprocess
    import sys

    env = source_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "prefixflight.cli", "serve", "--model", "tiny", "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    stopped = False
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert found, line
        url = found[1]
        router = start_router(
            [url, backends[0].url],
            policy="round_robin",
            health_interval_s=0.5,
            health_timeout_s=0.5,
            health_failures=2,
        )
        state = router_state(router)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        started = time.monotonic()

        async def four() -> list[Any]:
            async with httpx.AsyncClient(timeout=60) as c:
                url = router.base_url + "/v1/completions"
                return list(
                    await asyncio.gather(
                        *(
                            c.post(
                                url, json={"model": MODEL_NAME, "prompt": prompt(), "max_tokens": 1}
                            )
                            for _ in range(4)
                        )
                    )
                )

        answers = asyncio.run(four())
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert time.monotonic() - started < 10  # the stop would have held two for 15 s
        assert state.up[url] is False
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        until(lambda: state.up[url], "the backend to be marked up again")
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
