"""A real uvicorn server on a free loopback port, run by the test in a thread of its own.

`ServerThread` binds 127.0.0.1:0 itself (no port race), serves the app with uvicorn until
`stop`, waits for ``/health`` to answer before a test talks to it (bounded), and runs
coroutines on the server's event loop (`call`), which is where the engine's state may be
read. torch, transformers and the serve extra are imported inside, so collecting this folder
without them works; the test modules skip themselves with ``pytest.importorskip``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see the backend docs)

T = TypeVar("T")
START_TIMEOUT = 60.0


class CharCodec:
    """A small text codec for the tiny random models: characters <-> ids, id ``EOS`` is the
    end of a turn (left out of decoded text), and a plain chat format."""

    EOS = 3

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 500 + 10 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + t % 95) for t in ids if t != self.EOS)

    def chat(self, messages: Sequence[Any]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


def tiny_llama(seed: int = 0) -> Any:
    """The 2-layer random-weight Llama of the backend tests (`tiny_model`)."""
    from prefixflight.backends.torch import tiny_model

    return tiny_model("llama", seed)


class ServerThread:
    """``serve``'s uvicorn server for ``app`` on a free 127.0.0.1 port, in a thread, until
    `stop` (which shuts it down as SIGTERM would: draining, then closing)."""

    def __init__(
        self, app: Any, *, send_buffer: int | None = None, make_server: Any = None
    ) -> None:
        from prefixflight.serve.http import uvicorn_server

        self.sock = socket.create_server(("127.0.0.1", 0))
        if send_buffer is not None:  # accepted connections inherit it: a slow network
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # make_server: another app's server factory (prefixflight route's route_server)
        self.server = (make_server or uvicorn_server)(app, log_level="error")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-uvicorn", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by start/stop
            self.error = exc

    def start(self, *, healthy: bool = True) -> ServerThread:
        """Start and wait until ``/health`` is 200 (``healthy=False``: until it answers at
        all, for a router whose backends are all down)."""
        import httpx

        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if not self.thread.is_alive():
                raise AssertionError(f"the server thread died: {self.error!r}")
            try:
                status = httpx.get(self.base_url + "/health", timeout=5).status_code
                if status == 200 or not healthy:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not answer /health in {START_TIMEOUT} s")
            time.sleep(0.02)  # polling a real condition (the port answering), bounded above

    def call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the server's event loop (where the engine lives)."""
        assert self.loop is not None

        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop within 30 s"
        assert self.error is None, self.error


PAGE = 4
MODEL_NAME = "tiny-llama"


def start_tiny_server(model: Any, codec: Any = None, **limits: Any) -> ServerThread:
    """The tiny model behind the HTTP server (pages of 4 tokens), started and healthy;
    ``limits`` are `EngineConfig`'s ``max_running``/``num_pages`` and `ServerConfig`'s."""
    from prefixflight.backends.torch import AsyncEngine, EngineConfig
    from prefixflight.serve.http import ServerConfig, build_app

    send_buffer = limits.pop("send_buffer", None)
    engine_keys = ("max_running", "num_pages", "block_size", "max_batch_tokens", "release_policy")
    engine_limits = {k: limits.pop(k) for k in engine_keys if k in limits}
    engine_limits.setdefault("num_pages", 1024)
    engine_limits.setdefault("max_running", 8)
    engine_limits.setdefault("block_size", PAGE)
    engine_limits.setdefault("max_batch_tokens", 128)
    engine = AsyncEngine.from_model(
        model,
        EngineConfig(**engine_limits),
        eos_token_ids=[CharCodec.EOS],
        device="cpu",
    )
    config = ServerConfig(model_name=MODEL_NAME, **limits)
    app = build_app(engine, CharCodec() if codec is None else codec, config)
    return ServerThread(app, send_buffer=send_buffer).start()


_OPEN_CLIENTS: list[Any] = []


def openai_client(base_url: str, api_key: str = "unused", **kw: Any) -> Any:
    """An ``openai.OpenAI`` client for ``base_url``, closed when the test that made it ends.

    A client left to the garbage collector leaves its pooled (or half-read, streamed)
    connection open, and the ResourceWarning fails whichever later test collects it."""
    import openai

    c = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, **kw)
    _OPEN_CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_openai_clients() -> Iterator[None]:
    yield
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


@pytest.fixture(scope="module")
def tiny() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def server(tiny: Any) -> Iterator[ServerThread]:
    running = start_tiny_server(tiny)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def codec() -> CharCodec:
    return CharCodec()


@pytest.fixture
def start_server(tiny: Any) -> Iterator[Callable[..., ServerThread]]:
    """Start tiny-model servers with other limits; each is stopped after the test."""
    started: list[ServerThread] = []

    def start(codec: Any = None, **limits: Any) -> ServerThread:
        started.append(start_tiny_server(tiny, codec, **limits))
        return started[-1]

    yield start
    for s in started:
        s.stop()


class StepGate:
    """Holds the engines' model steps (in their worker threads) once a step budget is spent,
    so a test can keep a request running as long as it needs to, whatever the speed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps = 0
        self._limit: int | None = None

    def hold_after(self, steps: int) -> None:
        """Let ``steps`` more steps run, then hold every step until `release`."""
        with self._cond:
            self._limit = self._steps + steps

    def release(self) -> None:
        with self._cond:
            self._limit = None
            self._cond.notify_all()

    def enter(self) -> None:
        with self._cond:
            self._steps += 1
            deadline = time.monotonic() + START_TIMEOUT
            while self._limit is not None and self._steps > self._limit:
                left = deadline - time.monotonic()
                assert left > 0, "a test held the model step and never released it"
                self._cond.wait(left)


@pytest.fixture
def step_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepGate]:
    from prefixflight.backends.torch import TransformersRunner

    gate = StepGate()
    original = TransformersRunner.execute

    def execute(runner: Any, plan: Any) -> Any:
        gate.enter()
        return original(runner, plan)

    monkeypatch.setattr(TransformersRunner, "execute", execute)
    yield gate
    gate.release()
