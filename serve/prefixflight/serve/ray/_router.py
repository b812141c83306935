"""`BurstRequestRouter`: our `BurstRouter` behind Ray Serve's `RequestRouter` interface.

How Serve drives a request router (ray/serve/_private/request_router/request_router.py,
Ray 2.59): every handle (and every HTTP proxy) owns one router; each pending request is
picked up by a *routing task* on the router's event loop, which awaits
``choose_replicas(candidates, pending_request)`` and then sends the request to the least
loaded replica of the first rank whose queue is not full, trying the next rank (with
backoff) otherwise. Serve runs at most ``max_num_routing_tasks`` tasks (``2 x replicas``,
capped at 50); a window can only batch requests that are being routed, so this router raises
the cap to its batch size.

This class is glue only. The mapping (`find_request`, `replica_load`) and the window state
(`RoutingState`, driving the core's `BurstAffinityRouter`) are Ray-free, in ``_adapter.py``.
``choose_replicas`` submits the request with ``loop.time()`` as ``now`` and awaits its
decision; one timer (``loop.call_at``) seals the window at the core's deadline. The answer is
two ranks: the chosen replica alone, then the others by load (used only when the chosen
replica's queue is full, so a full replica spills instead of stalling).

Its routing tasks come from `OwnRequestRoutingMixin`: Serve 2.59's own loop can drop a
request whose ``choose_replicas`` awaits (as a window does), and it would hang.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixflight.core import BurstConfig, PrefixIndex, ReplicaLoad, Routed, UsageError
from prefixflight.core.validate import renamed

from ._adapter import FallbackName, RoutingState, find_request, replica_load
from ._routing_tasks import OwnRequestRoutingMixin

__all__ = ["BurstRequestRouter", "load_object"]


def load_object(path: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"expected 'package.module:attribute', got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class BurstRequestRouter(OwnRequestRoutingMixin, RequestRouter):
    """Burst prefix-affinity routing for a Serve deployment of prefixflight engines.

    Select it with ``RequestRouterConfig(request_router_class=
    "prefixflight.serve.ray:BurstRequestRouter", request_router_kwargs={...})``; the kwargs
    are `initialize_state`'s.
    """

    _state: RoutingState
    _waiters: dict[str, asyncio.Future[str]]
    _timer: asyncio.TimerHandle | None
    _in_flight: dict[str, int]
    _sent: dict[str, str]
    _max_tasks: int
    _rng: random.Random

    def initialize_state(
        self,
        window_ms: int = 100,
        max_per_replica: int = -1,
        block_size: int = 64,
        max_prefix_tokens_to_match: int = 0,
        min_colocate_blocks: int = 0,
        max_batch_size: int = 1000,
        balance_by: str = "requests",
        lone_wait_ms: int | None = None,
        quiet_ms: int | None = None,
        engine_block_size: int = 16,
        fallback: FallbackName = "approx",
        residency_source: str | None = None,
        max_routing_tasks: int = 1000,
        seed: int | None = None,
        block_size_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Called by Serve with ``request_router_kwargs``.

        The `BurstConfig` fields (``block_size_tokens``: the deprecated name of
        ``block_size``), the engines' block size (to key residency),
        the fallback for requests with no affinity in their window (``"approx"``: llm-d's
        approximate prefix scorer; ``"least_loaded"``), ``residency_source`` (``"stats"``: the
        resident blocks the replicas report in ``record_routing_stats``; ``"kv_events"``: a
        `KVEventResidency` following the KV-event publishers whose endpoints the replicas
        report there; or the import path of a zero-argument factory returning a
        `PrefixIndex`) and the most concurrent routing tasks (the largest window this
        router can form).
        """
        super().initialize_state(**kwargs)  # type: ignore[no-untyped-call]
        block_size = renamed(
            "BurstRequestRouter.initialize_state",
            "block_size_tokens",
            block_size_tokens,
            "block_size",
            block_size,
            block_size != 64,
        )
        config = BurstConfig(
            window_ms=window_ms,
            max_per_replica=max_per_replica,
            block_size=block_size,
            max_prefix_tokens_to_match=max_prefix_tokens_to_match,
            min_colocate_blocks=min_colocate_blocks,
            max_batch_size=max_batch_size,
            balance_by=cast(Any, balance_by),
            lone_wait_ms=lone_wait_ms,
            quiet_ms=quiet_ms,
        )
        residency: PrefixIndex | None = None
        if residency_source == "kv_events":
            from ._kv_residency import KVEventResidency

            kv = residency = KVEventResidency()
            weakref.finalize(self, kv.close)  # no shutdown hook: at collection or exit
        elif residency_source is not None and residency_source != "stats":
            factory = cast(Callable[[], PrefixIndex], load_object(residency_source))
            residency = factory()
        self._state = RoutingState(
            config,
            fallback=fallback,
            engine_block_size=engine_block_size,
            residency=residency,
            stats_residency=residency_source == "stats",
            seed=seed,
        )
        self._waiters = {}
        self._timer = None
        self._in_flight = {}
        self._sent = {}
        self._max_tasks = max(1, int(max_routing_tasks))
        self._rng = random.Random(seed)

    @property
    def state(self) -> RoutingState:
        """The Ray-free routing state (for inspection)."""
        return self._state

    @property
    def max_num_routing_tasks(self) -> int:
        replicas = len(self.curr_replicas)
        if not replicas:
            return 0
        serve_cap = min(self.max_num_routing_tasks_cap, 2 * replicas)
        return max(serve_cap, getattr(self, "_max_tasks", 0))

    # -- routing --------------------------------------------------------------------------
    def _loads(self, replicas: Sequence[RunningReplica]) -> list[ReplicaLoad]:
        cache = self.replica_queue_len_cache
        for r in replicas:
            self._state.observe(r.replica_id.unique_id, r.routing_stats)
        return [
            replica_load(
                r.replica_id.unique_id,
                r.routing_stats,
                queue_len=cache.get(r.replica_id),
                in_flight=self._in_flight.get(r.replica_id.unique_id, 0),
            )
            for r in replicas
        ]

    def _ranks(self, name: str) -> list[list[RunningReplica]] | None:
        replicas = list(self.curr_replicas.values())
        chosen = [r for r in replicas if r.replica_id.unique_id == name]
        if not chosen:
            return None
        rest = [r for r in replicas if r.replica_id.unique_id != name]
        loads = {x.name: x.running + x.waiting for x in self._loads(rest)}
        rest.sort(key=lambda r: (loads[r.replica_id.unique_id], r.replica_id.unique_id))
        return [chosen, rest] if rest else [chosen]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = (
            None
            if pending_request is None
            else find_request(pending_request.args, pending_request.kwargs)
        )
        if pending_request is None or request is None:  # not a generation: two random choices
            k = min(2, len(candidate_replicas))
            return [self._rng.sample(list(candidate_replicas), k)]
        rid = str(pending_request.metadata.internal_request_id)
        for _ in range(3):  # a decided replica may die before the request is sent
            name = self._state.decision(rid)
            if name is None:
                name = await self._decide(rid, request, candidate_replicas)
            ranks = self._ranks(name)
            if ranks is not None:
                return ranks
            self._state.drop_replica(name)
        return [list(self.curr_replicas.values())]

    async def _decide(self, rid: str, request: Any, candidates: Sequence[RunningReplica]) -> str:
        loop = asyncio.get_running_loop()
        future = self._waiters.get(rid)
        if future is None:  # another routing task may already wait for this request
            future = self._waiters[rid] = loop.create_future()
            now = max(loop.time(), self._state.now)
            try:
                decisions = self._state.submit(rid, request, now, self._loads(candidates))
            except BaseException:  # the request fails with it (OwnRequestRoutingMixin)
                del self._waiters[rid]
                raise
            self._resolve(decisions)
            self._arm()
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                self._waiters.pop(rid, None)

    def _resolve(self, decisions: Sequence[Routed]) -> None:
        for d in decisions:
            future = self._waiters.get(str(d.request_id))
            if future is not None and not future.done():
                future.set_result(d.replica)

    def _arm(self) -> None:
        deadline = self._state.deadline
        timer = self._timer
        if timer is not None and (deadline is None or timer.when() != deadline):
            timer.cancel()
            self._timer = timer = None
        if deadline is not None and timer is None:
            self._timer = asyncio.get_running_loop().call_at(deadline, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        replicas = list(self.curr_replicas.values())
        if not replicas:  # every replica is gone: wait for update_replicas
            return
        now = max(loop.time(), self._state.deadline or 0.0, self._state.now)
        self._resolve(self._state.tick(now, self._loads(replicas)))
        self._arm()

    # -- replica lifecycle ----------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        new = {r.unique_id for r in self.curr_replicas}
        for name in old - new:
            self._forget(name)
        if new and getattr(self, "_timer", 1) is None and self._state.deadline is not None:
            self._arm()  # a window left open while no replica was up

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, name: str) -> None:
        if hasattr(self, "_state"):
            self._state.drop_replica(name)
            self._in_flight.pop(name, None)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        rid = str(pending_request.metadata.internal_request_id)
        name = replica_id.unique_id
        self._state.consumed(rid)
        self._sent[rid] = name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = self._sent.pop(str(internal_request_id), None)
        if name is not None and self._in_flight.get(name, 0) > 0:
            self._in_flight[name] -= 1
