"""`prefixflight serve --kv-events` end to end: a tiny-model engine behind the real HTTP server
publishes its prefix cache's KV events on vLLM's wire; a subscriber (as llm-d's indexer or our
router would) follows it, and its block index equals what the engine's cache holds."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")

from prefixflight.serve.kv_events import (  # noqa: E402
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    fold_hash,
    kv_topic,
)

from .conftest import MODEL_NAME, PAGE, CharCodec, ServerThread  # noqa: E402

pytestmark = pytest.mark.torch
LOOPBACK = "tcp://127.0.0.1:*"


def test_a_subscriber_follows_a_served_engine_through_its_kv_events(tiny: Any) -> None:
    from prefixflight.backends.torch import AsyncEngine, EngineConfig
    from prefixflight.serve.http import ServerConfig, build_app

    publisher = KVEventPublisher(
        LOOPBACK, replay_endpoint=LOOPBACK, topic=kv_topic("pod-0", MODEL_NAME)
    )
    engine = AsyncEngine.from_model(
        tiny,
        EngineConfig(block_size=PAGE, num_pages=64, max_batch_tokens=128, max_running=8),
        eos_token_ids=[CharCodec.EOS],
        event_sink=publisher,
        device="cpu",
    )
    server = ServerThread(build_app(engine, CharCodec(), ServerConfig(model_name=MODEL_NAME)))
    address = PublisherAddress(publisher.endpoint, publisher.replay_endpoint)
    try:
        server.start()
        with KVEventSubscriber({"pod-0": address}) as sub:
            for prompt in ("a shared system prompt, then one question", "a shared system x"):
                r = httpx.post(
                    server.base_url + "/v1/completions",
                    json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
            assert publisher.drain(10.0)
            assert sub.wait_for_seq("pod-0", publisher.next_seq, 10.0), "never caught up"
            resident = server.call(_resident(engine))
            assert resident, "the engine cached nothing"
            assert sub.index.replica("pod-0").keys() == {fold_hash(h) for h in resident}
            assert sub.pod_and_model("pod-0") == ("pod-0", MODEL_NAME)
            assert sub.feeds["pod-0"].lost == 0 and sub.errors == 0
    finally:
        server.stop()
        publisher.close()


async def _resident(engine: Any) -> frozenset[Any]:
    return frozenset(engine.scheduler.cache.policy.resident())
