"""`BurstRequestRouter` on a real local Ray Serve: three tiny random-weight Llama replicas.

Ray starts once for the module (2 CPUs, no dashboard) and is shut down after it. The
replicas publish their KV events and the router follows them (``residency_source=
"kv_events"``). The requests go through a real deployment handle; nothing is mocked.
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
    replica_load,
    run_local,
    shutdown,
)
from prefixflight.serve.ray._kv_residency import KVEventResidency, publisher_address
from prefixflight.serve.ray._router import BurstRequestRouter

pytestmark = [
    pytest.mark.ray,
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # from Ray's own modules
]

REPLICAS = 3


@pytest.fixture(scope="module")
def handle() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield run_local(
            REPLICAS,
            "burst",
            ModelSpec.tiny(seed=0),
            router_kwargs={"window_ms": 300, "residency_source": "kv_events"},
            stats_period_s=0.5,
        )
    finally:
        shutdown()
        for router in routers():  # the handle's router outlives Serve: stop its subscriber
            residency = router.state.residency
            assert isinstance(residency, KVEventResidency)
            residency.close()


def prompt(seed: int, n: int = 70) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 7) % 500 + 1 for i in range(n))


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def routers() -> list[BurstRequestRouter]:
    return [o for o in gc.get_objects() if type(o) is BurstRequestRouter]


def the_router() -> BurstRequestRouter:
    """The router of the handle, in this process (Serve builds one per handle)."""
    (router,) = routers()
    return router


def the_residency(router: BurstRequestRouter) -> KVEventResidency:
    residency = router.state.residency
    assert isinstance(residency, KVEventResidency)
    return residency


async def burst(handle: Any, ids: tuple[int, ...], n: int, max_tokens: int) -> list[Any]:
    req = GenerateRequest(prompt_ids=ids, max_tokens=max_tokens)
    return list(await asyncio.gather(*(handle.generate.remote(req) for _ in range(n))))


def test_a_burst_of_identical_prompts_lands_on_one_replica(handle: Any) -> None:
    async def run() -> tuple[list[Any], list[Any]]:
        return await asyncio.gather(burst(handle, prompt(1), 8, 4), burst(handle, prompt(2), 8, 4))

    a, b = asyncio.run(run())
    for group in (a, b):
        assert all(isinstance(r, GenerateResult) and len(r.token_ids) == 4 for r in group)
        assert len({r.replica for r in group}) == 1
        # one leader computes the prompt; the seven others reuse its full blocks
        assert sorted(r.cached_tokens for r in group) == [0] + [64] * 7
    assert a[0].replica != b[0].replica  # two groups in one window: balanced apart
    assert len(the_router().curr_replicas) == REPLICAS


def test_a_lone_request_goes_where_the_kv_events_say_its_prefix_is(handle: Any) -> None:
    router = the_router()
    residency = the_residency(router)

    def reported() -> bool:  # every replica's stats name its publisher
        return all(publisher_address(r.routing_stats) for r in router.curr_replicas.values())

    wait_for(reported)  # the router follows them from its next routing on
    ns = "tenant"  # the engine hashes it as bytes, the router as a str: the same keys
    for k in range(3):
        ids = prompt(20 + k, 320)  # 20 engine blocks (pages of 16), 5 route blocks of 64
        first = asyncio.run(one(handle, ids, ns))
        a = first.replica
        names = {r.unique_id for r in router.curr_replicas}
        assert set(residency.subscriber.publishers) == names
        blocks = router.state.engine_blocks(GenerateRequest(prompt_ids=ids, namespace=ns))
        assert len(blocks) == 20

        def published(a: str = a, blocks: Any = blocks) -> bool:
            return residency.prefix_blocks(a, blocks) == 20

        def fuller(a: str = a) -> bool:  # the router's stats see a's cache grow
            util = {
                r.replica_id.unique_id: replica_load("-", r.routing_stats).kv_utilization
                for r in router.curr_replicas.values()
            }
            return util[a] > min(u for n, u in util.items() if n != a)

        wait_for(published, timeout=15.0)
        assert all(residency.prefix_blocks(o, blocks) == 0 for o in names - {a})
        # the fallback (llm-d's approximate scorer) would now avoid a: its KV use is not the
        # lowest, and the next request's route blocks (64 tokens) match nothing it was sent
        wait_for(fuller)
        # alone in its window, sharing a's first two engine blocks: residency places it
        again = asyncio.run(one(handle, ids[:32] + prompt(40 + k, 48), ns))
        assert again.replica == a
        assert again.cached_tokens == 32


async def one(handle: Any, ids: tuple[int, ...], namespace: str) -> Any:
    return await handle.generate.remote(
        GenerateRequest(prompt_ids=ids, max_tokens=2, namespace=namespace)
    )


def test_a_killed_replica_is_dropped_without_losing_other_requests(handle: Any) -> None:
    router = the_router()
    residency = the_residency(router)

    async def run() -> tuple[str, list[Any], list[Any]]:
        streaming = handle.options(stream=True)
        reqs = {g: GenerateRequest(prompt_ids=prompt(10 + g), max_tokens=300) for g in range(2)}
        streams = {g: [streaming.stream.remote(reqs[g]) for _ in range(4)] for g in range(2)}
        firsts = {g: await asyncio.gather(*(s.__anext__() for s in streams[g])) for g in range(2)}
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
    assert victim not in residency.replicas  # its publisher is no longer followed
    wait_for(lambda: victim not in residency.subscriber.publishers)
    assert all(router.state.decision(rid) != victim for rid in list(router._sent))
    after = asyncio.run(burst(handle, prompt(3), 8, 4))
    assert len({r.replica for r in after}) == 1 and after[0].replica != victim
