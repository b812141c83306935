"""`BurstRequestRouter` on a real local Ray Serve: three tiny random-weight Llama replicas.

Ray starts once for the module (2 CPUs, no dashboard) and is shut down after it. The
requests go through a real deployment handle; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
with warnings.catch_warnings():  # Ray 2.5x's pydantic models warn on import (pydantic 2.x)
    warnings.simplefilter("ignore", DeprecationWarning)
    ray: Any = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")

from prefixflight.serve.ray import (
    FirstToken,
    GenerateRequest,
    GenerateResult,
    ModelSpec,
    run_local,
    shutdown,
)
from prefixflight.serve.ray._router import BurstRequestRouter

pytestmark = [
    pytest.mark.ray,
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # from Ray's own modules
]

REPLICAS = 3
TINY = {  # the shape of tests/backends/conftest.py's make_tiny_model("llama")
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def handle() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield run_local(
            REPLICAS,
            "burst",
            ModelSpec(kind="llama-config", llama_config=TINY, seed=0),
            router_kwargs={"window_ms": 300, "residency_source": "stats"},
            stats_period_s=0.5,
        )
    finally:
        shutdown()


def prompt(seed: int, n: int = 70) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 7) % 500 + 1 for i in range(n))


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def the_router() -> BurstRequestRouter:
    """The router of the handle, in this process (Serve builds one per handle)."""
    routers = [o for o in gc.get_objects() if type(o) is BurstRequestRouter]
    assert len(routers) == 1
    return routers[0]


async def burst(handle: Any, ids: tuple[int, ...], n: int, max_tokens: int) -> list[Any]:
    req = GenerateRequest(prompt_ids=ids, max_tokens=max_tokens)
    return list(await asyncio.gather(*(handle.generate.remote(req) for _ in range(n))))


def test_a_burst_of_identical_prompts_lands_on_one_replica(handle: Any) -> None:
    async def run() -> tuple[list[Any], list[Any]]:
        return await asyncio.gather(
            burst(handle, prompt(1), 8, 4), burst(handle, prompt(2), 8, 4)
        )

    a, b = asyncio.run(run())
    for group in (a, b):
        assert all(isinstance(r, GenerateResult) and len(r.token_ids) == 4 for r in group)
        assert len({r.replica for r in group}) == 1
        # one leader computes the prompt; the seven others reuse its full blocks
        assert sorted(r.cached_tokens for r in group) == [0] + [64] * 7
    assert a[0].replica != b[0].replica  # two groups in one window: balanced apart
    assert len(the_router().curr_replicas) == REPLICAS


def test_a_killed_replica_is_dropped_without_losing_other_requests(handle: Any) -> None:
    router = the_router()

    async def run() -> tuple[str, list[Any], list[Any]]:
        streaming = handle.options(stream=True)
        reqs = {
            g: GenerateRequest(prompt_ids=prompt(10 + g), max_tokens=300) for g in range(2)
        }
        streams = {g: [streaming.stream.remote(reqs[g]) for _ in range(4)] for g in range(2)}
        firsts = {
            g: await asyncio.gather(*(s.__anext__() for s in streams[g])) for g in range(2)
        }
        for g in range(2):  # every request is running: it has its first token
            assert all(isinstance(f, FirstToken) for f in firsts[g])
        victim = firsts[0][0].replica
        assert {f.replica for f in firsts[0]} == {victim}
        assert {f.replica for f in firsts[1]} == {firsts[1][0].replica} != {victim}
        (name,) = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if victim in a["name"]
        ]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        async def finish(stream: Any) -> Any:
            try:
                return [item async for item in stream][-1]
            except Exception as exc:  # the victim's own requests die with it
                return exc

        killed = await asyncio.gather(*(finish(s) for s in streams[0]))
        survived = await asyncio.gather(*(finish(s) for s in streams[1]))
        return victim, killed, survived

    victim, killed, survived = asyncio.run(run())
    assert all(isinstance(r, GenerateResult) and len(r.token_ids) == 300 for r in survived)
    assert all(isinstance(r, BaseException) for r in killed)
    wait_for(lambda: victim not in {r.unique_id for r in router.curr_replicas})
    assert all(router.state.decision(rid) != victim for rid in list(router._sent))
    after = asyncio.run(burst(handle, prompt(3), 8, 4))
    assert len({r.replica for r in after}) == 1 and after[0].replica != victim
