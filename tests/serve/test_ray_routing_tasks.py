"""Serve's routing loop around `BurstRequestRouter`: every request is routed, none abandoned.

Serve 2.59's own routing tasks can pop a request and then retire without routing it (when the
head of the pending queue is assigned while ``choose_replicas`` awaits, as a burst window
does); the request then waits forever. This drives Serve's real ``RequestRouter`` machinery
(pending queues, routing tasks, backoff, queue-length probes) with our router on top, in one
event loop, without a Ray instance: the only stand-ins are the replicas, which answer the
router's queue-length probe after a random delay of a few milliseconds (as busy actors do).
"""

from __future__ import annotations

import asyncio
import random
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():  # Ray 2.5x's pydantic models warn on import (pydantic 2.x)
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("ray.serve")
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        ReplicaID,
        RequestMetadata,
    )
    from ray.serve._private.request_router.common import PendingRequest

from prefixflight.serve.ray import GenerateRequest
from prefixflight.serve.ray._router import BurstRequestRouter

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DEPLOYMENT = DeploymentID(name="engine", app_name="routing-tasks")


class ProbedReplica:
    """What the router reads of a replica; its queue-length probe answers after 0-4 ms."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 1000
        self.routing_stats: dict[str, Any] = {}
        self.node_id = None
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self._rng = rng

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self._rng.uniform(0.0, 0.004))
        return 0


async def route_all(seed: int, requests: int) -> tuple[int, int]:
    """Send ``requests`` over 0.2 s (half a shared prompt, half distinct) through Serve's
    routing entry point; return (requests not routed within 1 s, routing tasks left)."""
    rng = random.Random(seed)
    router = BurstRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(window_ms=3, block_size=4, seed=0)
    replicas: list[Any] = [ProbedReplica(f"r{i}", rng) for i in range(3)]
    router.update_replicas(replicas)
    shared = tuple(range(1, 9))

    async def one(i: int) -> bool:
        await asyncio.sleep(rng.uniform(0.0, 0.2))
        ids = shared if rng.random() < 0.5 else tuple(rng.randrange(1, 50) for _ in range(8))
        meta = RequestMetadata(request_id=str(i), internal_request_id=f"{seed}-{i}")
        pending = PendingRequest(args=[GenerateRequest(prompt_ids=ids)], kwargs={}, metadata=meta)
        try:
            async with asyncio.timeout(1.0):
                await router._choose_replica_for_request(pending)
        except TimeoutError:
            return False
        return True

    routed = await asyncio.gather(*(one(i) for i in range(requests)))
    for _ in range(200):  # the tasks retire once nothing is left to route (bounded wait)
        if not router.curr_num_routing_tasks:
            break
        await asyncio.sleep(0.005)
    return routed.count(False), router.curr_num_routing_tasks


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_request_is_routed_and_the_routing_tasks_retire(seed: int) -> None:
    # Serve's own routing loop loses 1-2 of these 200 requests for each of these seeds
    lost, tasks_left = asyncio.run(route_all(seed, 200))
    assert lost == 0
    assert tasks_left == 0


def test_the_prefix_router_is_rays_with_routing_tasks_that_keep_their_request() -> None:
    from prefixflight.serve.ray import ROUTERS, router_config
    from prefixflight.serve.ray._router import load_object
    from prefixflight.serve.ray._routing_tasks import OwnRequestRoutingMixin

    paths = {name: ROUTERS[name] for name in ("burst", "prefix")}
    for path in paths.values():
        assert path is not None
        cls = load_object(path)
        assert issubclass(cls, OwnRequestRoutingMixin)
        assert cls._fulfill_pending_requests is OwnRequestRoutingMixin._fulfill_pending_requests
    rays = [c for c in load_object(str(paths["prefix"])).__mro__ if c.__module__.startswith("ray.")]
    assert rays[0].__name__ == "PrefixCacheAffinityRouter"  # Ray's own, right below the mixin
    pow2 = router_config("pow2").get_request_router_class()  # Serve's default: FIFO, safe
    assert pow2.__name__ == "PowerOfTwoChoicesRequestRouter"
    assert not issubclass(pow2, OwnRequestRoutingMixin)


class FailsOnBad(BurstRequestRouter):
    """Our router, raising inside ``choose_replicas`` for the request with id ``"bad"``."""

    async def choose_replicas(
        self, candidate_replicas: list[Any], pending_request: Any = None
    ) -> list[list[Any]]:
        if pending_request is not None and pending_request.metadata.request_id == "bad":
            raise ValueError("no replica for this one")
        return await super().choose_replicas(candidate_replicas, pending_request)


def test_a_request_the_router_fails_on_gets_the_error_and_the_others_are_routed() -> None:
    async def scenario() -> list[object]:
        router = FailsOnBad(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(window_ms=3, block_size=4, seed=0)
        replicas: list[Any] = [ProbedReplica(f"r{i}", random.Random(i)) for i in range(2)]
        router.update_replicas(replicas)

        def pending(name: str, i: int) -> PendingRequest:
            meta = RequestMetadata(request_id=name, internal_request_id=f"id-{i}")
            request = GenerateRequest(prompt_ids=(1, 2, 3, i))
            return PendingRequest(args=[request], kwargs={}, metadata=meta)

        async with asyncio.timeout(5.0):
            results: list[object] = await asyncio.gather(
                *(router._choose_replica_for_request(pending(n, i)) for i, n in enumerate("abc")),
                router._choose_replica_for_request(pending("bad", 3)),
                return_exceptions=True,
            )
        for _ in range(200):
            if not router.curr_num_routing_tasks:
                break
            await asyncio.sleep(0.005)
        assert router.curr_num_routing_tasks == 0
        return results

    *routed, failed = asyncio.run(scenario())
    assert [getattr(r, "replica_id", None) is not None for r in routed] == [True] * 3
    assert isinstance(failed, ValueError) and "no replica for this one" in str(failed)
