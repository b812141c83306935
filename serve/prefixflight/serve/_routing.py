"""The routing state both hosts drive: ``prefixflight route`` (an HTTP router in front of
OpenAI-compatible engines) and the Ray Serve router. Ray-free, asyncio-free: time is passed
in as values, decisions come back as `Routed` values.

A host hands `RoutingState` each request as a `Routable` (its route tokens, its token ids as
the engines see them when known, its tenant namespace) with the replicas' loads, and gets the
decisions made now; a windowed policy answers later from `tick`, at `deadline`. The policy:

- ``"burst"``: the core's `BurstRouter` window in front of the fallback (`BurstAffinityRouter`);
  a sealing window reads the fallback's record of what was routed where (`BurstRouter`'s
  ``known``), so a burst split over two windows stays on one replica;
- ``"prefix"``: the fallback alone, at once: the replica with the longest resident prefix
  (`ResidencyFirstRouter`, with a residency source) else llm-d's approximate prefix scorer;
- ``"round_robin"``: every request to the next replica in name order.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, TypeAlias, final

from prefixflight.core import (
    BlockHash,
    BlockHasher,
    BurstConfig,
    BurstRouter,
    ConfigError,
    PrefixIndex,
    ReplicaLoad,
    Routed,
    Router,
    RouteRequest,
    UsageError,
)
from prefixflight.core.routing import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
    LeastLoadedRouter,
)
from prefixflight.core.routing._protocol import check_replicas
from prefixflight.core.validate import check_time

from ._residency import BlockSetResidency, FollowsReplicas, ResidencyFirstRouter

__all__ = [
    "POLICIES",
    "FallbackName",
    "PolicyName",
    "Routable",
    "RoundRobinRouter",
    "RoutingState",
]

FallbackName: TypeAlias = Literal["approx", "least_loaded"]
PolicyName: TypeAlias = Literal["burst", "prefix", "round_robin"]
POLICIES: tuple[PolicyName, ...] = ("burst", "prefix", "round_robin")


class Routable(Protocol):
    """A request as `RoutingState` keys it (``GenerateRequest`` of the Ray package is one).

    ``route_tokens()``: what the router hashes (token ids, or a text's UTF-8 bytes);
    ``prompt_ids``: the token ids as the engines see them, or ``None`` when unknown (then no
    residency lookup); ``namespace``: the tenant (separate keys, separate caches).
    """

    @property
    def prompt_ids(self) -> tuple[int, ...] | None: ...

    @property
    def namespace(self) -> str: ...

    def route_tokens(self) -> tuple[int, ...]: ...


@final
class RoundRobinRouter:
    """Every request to the next replica in name order (the `Router` protocol)."""

    __slots__ = ("_next", "_now")

    def __init__(self) -> None:
        self._next = 0
        self._now = float("-inf")

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        t = check_time("now", now, after=self._now)
        names = sorted(r.name for r in check_replicas(replicas))
        self._now = t
        name = names[self._next % len(names)]
        self._next += 1
        return (Routed(request_id=request.request_id, replica=name),)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        self._now = check_time("now", now, after=self._now)
        return ()

    def next_deadline(self) -> float | None:
        return None

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        """Nothing to learn."""


@final
class RoutingState:
    """A routing policy as a host needs it, time passed in as values.

    `submit` hands a request to the policy's core router (for ``"burst"``, the
    `BurstAffinityRouter`: our `BurstRouter` in front of a fallback for the requests it
    leaves); `tick` seals a due window. Both return the
    decisions made now, as `Routed` values; `decision` remembers each until `consumed` (a
    routing retry gets the same replica). `drop_replica` forgets a dead replica: decisions
    for it are withdrawn (the requests are routed again) and the residency source drops it.
    """

    __slots__ = (
        "_burst_config",
        "_decided",
        "_engine_block_size",
        "_engine_hashers",
        "_fallback",
        "_max_decided",
        "_now",
        "_policy",
        "_residency",
        "_route_hashers",
        "_router",
        "_waiting",
    )

    def __init__(
        self,
        config: BurstConfig | None = None,
        *,
        policy: PolicyName = "burst",
        fallback: FallbackName = "approx",
        engine_block_size: int = 16,
        residency: PrefixIndex | None = None,
        stats_residency: bool = False,
        seed: int | None = None,
        max_decided: int = 100_000,
    ) -> None:
        self._burst_config = BurstConfig() if config is None else config
        if not isinstance(self._burst_config, BurstConfig):
            raise ConfigError(f"config must be a BurstConfig, got {self._burst_config!r}")
        if isinstance(engine_block_size, bool) or not isinstance(engine_block_size, int):
            raise ConfigError(f"engine_block_size must be an int, got {engine_block_size!r}")
        if engine_block_size < 1:
            raise ConfigError(f"engine_block_size must be >= 1, got {engine_block_size!r}")
        if residency is not None and not isinstance(residency, PrefixIndex):
            raise ConfigError(f"residency must be a PrefixIndex (prefix_blocks), got {residency!r}")
        if residency is not None and stats_residency:
            raise ConfigError("give a residency source or stats_residency=True, not both")
        if stats_residency:
            residency = BlockSetResidency()
        rng = random.Random(seed)
        inner: Router
        known: ApproxPrefixRouter | None = None  # what was routed where, learnt at once
        match fallback:
            case "approx":
                inner = known = ApproxPrefixRouter(
                    ApproxPrefixConfig(
                        max_prefix_blocks_to_match=min(256, self._burst_config.max_prefix_blocks)
                    ),
                    rng,
                )
            case "least_loaded":
                inner = LeastLoadedRouter(rng)
            case _:
                raise ConfigError(f"fallback must be 'approx' or 'least_loaded', got {fallback!r}")
        self._fallback: ResidencyFirstRouter | None = None
        if residency is not None:
            self._fallback = ResidencyFirstRouter(inner, residency)
            inner = self._fallback
        self._residency = residency
        self._engine_block_size = engine_block_size
        self._router: Router
        match policy:
            case "burst":
                self._router = BurstAffinityRouter(
                    BurstRouter(self._burst_config, _PLACEHOLDER, known=known), inner
                )
            case "prefix":
                self._router = inner
            case "round_robin":
                self._router = RoundRobinRouter()
                self._fallback = None  # no residency lookups
            case _:
                raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._policy: PolicyName = policy
        self._now = float("-inf")
        # per namespace (tenant, cache_salt), the most recently used kept
        self._route_hashers: OrderedDict[str, BlockHasher] = OrderedDict()
        self._engine_hashers: OrderedDict[str, BlockHasher] = OrderedDict()
        self._decided: OrderedDict[str, str] = OrderedDict()
        self._waiting: set[str] = set()
        self._max_decided = max_decided

    @property
    def config(self) -> BurstConfig:
        return self._burst_config

    @property
    def policy(self) -> PolicyName:
        return self._policy

    @property
    def deadline(self) -> float | None:
        """When `tick` next has work (the window seals, or a lone request is released), in
        the caller's time; ``None`` when nothing waits."""
        return self._router.next_deadline()

    @property
    def now(self) -> float:
        """The latest time seen (``-inf`` before any call)."""
        return self._now

    @property
    def waiting(self) -> frozenset[str]:
        """Requests waiting in the open window."""
        return frozenset(self._waiting)

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None:
        """A replica's latest ``record_routing_stats``, passed to a residency source that
        `FollowsReplicas` (with ``stats_residency``, a new report replaces the replica's
        resident blocks)."""
        source: object = self._residency
        if isinstance(source, FollowsReplicas):
            source.observe(replica, stats)

    def decision(self, request_id: str) -> str | None:
        """The replica chosen for ``request_id`` and not yet consumed."""
        return self._decided.get(request_id)

    def route_request(self, request_id: str, request: Routable) -> RouteRequest:
        """The request as the core router sees it (route keys, partial block included)."""
        tokens = request.route_tokens()
        hasher = _cached(
            self._route_hashers,
            request.namespace,
            lambda: BlockHasher(
                block_size=self._burst_config.block_size,
                namespace=request.namespace,
                include_partial=True,
            ),
        )
        return RouteRequest(
            request_id=request_id, blocks=hasher.hash_tokens(tokens), num_tokens=len(tokens)
        )

    def engine_blocks(self, request: Routable) -> tuple[BlockHash, ...]:
        """The prompt's full blocks as a replica's prefix cache keys them (token ids only:
        a text prompt's engine blocks need the replica's tokenizer, so none)."""
        if not request.prompt_ids:
            return ()
        hasher = _cached(
            self._engine_hashers,
            request.namespace,
            lambda: BlockHasher(block_size=self._engine_block_size, namespace=request.namespace),
        )
        return hasher.hash_tokens(request.prompt_ids)

    def submit(
        self,
        request_id: str,
        request: Routable,
        now: float,
        replicas: Sequence[ReplicaLoad],
    ) -> tuple[Routed, ...]:
        """A request asks for a replica at ``now``; returns the decisions made now.

        A request already decided is withdrawn first (a retry after its replica died). Raises
        `UsageError` (changing nothing) if it is waiting in the window, or for bad inputs.
        """
        if request_id in self._waiting:
            raise UsageError(f"request {request_id!r} is already waiting in the window")
        rr = self.route_request(request_id, request)
        if self._fallback is not None:
            self._fallback.set_blocks(request_id, self.engine_blocks(request))
        try:
            decisions = self._router.route(rr, now, replicas)
        except UsageError:
            if self._fallback is not None:
                self._fallback.forget(request_id)
            raise
        self._now = now
        self._decided.pop(request_id, None)
        self._waiting.add(request_id)
        return self._record(decisions)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        """Time passed: seal the window if due; returns the decisions made now."""
        decisions = self._router.tick(now, replicas)
        self._now = now
        return self._record(decisions)

    def consumed(self, request_id: str) -> None:
        """The request was sent to its replica: forget its decision."""
        self._decided.pop(request_id, None)

    @property
    def residency(self) -> PrefixIndex | None:
        """The residency source (``None`` without one)."""
        return self._residency

    def drop_replica(self, name: str) -> tuple[str, ...]:
        """Forget replica ``name``; returns the withdrawn (decided, unsent) request ids."""
        withdrawn = tuple(rid for rid, rep in self._decided.items() if rep == name)
        for rid in withdrawn:
            del self._decided[rid]
        source: object = self._residency
        if isinstance(source, FollowsReplicas):
            source.drop_replica(name)
        return withdrawn

    def _record(self, decisions: tuple[Routed, ...]) -> tuple[Routed, ...]:
        for d in decisions:
            rid = str(d.request_id)
            self._waiting.discard(rid)
            self._decided[rid] = d.replica
            self._decided.move_to_end(rid)
        while len(self._decided) > self._max_decided:  # decisions nobody consumed (cancelled)
            self._decided.popitem(last=False)
        return decisions


MAX_HASHERS: Final = 1024
"""Hashers kept per kind, one per namespace (a tenant and ``cache_salt``): a client sending
a new salt with every request costs one hasher, dropped once 1,024 newer ones were used."""


def _cached(
    hashers: OrderedDict[str, BlockHasher], namespace: str, make: Callable[[], BlockHasher]
) -> BlockHasher:
    hasher = hashers.get(namespace)
    if hasher is None:
        hasher = hashers[namespace] = make()
        while len(hashers) > MAX_HASHERS:
            hashers.popitem(last=False)
    else:
        hashers.move_to_end(namespace)
    return hasher


_PLACEHOLDER = (ReplicaLoad(name="-"),)
"""`BurstRouter` needs a replica to be built; every call passes the real ones."""
