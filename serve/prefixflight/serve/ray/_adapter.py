"""The Ray-free half of the Ray Serve integration: request values, the mapping from Ray's
router objects to the core's routing values, and the routing state the Ray router drives.

Nothing here imports Ray (or torch): the mapping and the window logic are tested with plain
objects. `BurstRequestRouter` (``_router.py``) is the thin glue that calls `RoutingState` from
Ray Serve's event loop, passing the loop's time as a value.

Real cache residency comes through `ResidencySource`: a per-replica view of which engine
blocks each replica holds. Without one, requests that the burst window leaves alone
(`NoAffinity`) go to the fallback router, llm-d's approximate prefix scorer
(`ApproxPrefixRouter`), which *assumes* a replica caches what it was sent. Two sources are
built: `BlockSetResidency`, fed by the block snapshots in the replicas' routing stats, and
``KVEventResidency`` (``_kv_residency.py``), a KV-event subscriber following every replica's
publisher (vLLM-shaped ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias, final, runtime_checkable

import attrs

from prefixflight.core import (
    BlockHash,
    BlockHasher,
    BurstConfig,
    BurstRouter,
    ConfigError,
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

__all__ = [
    "ROUTING_STATS_KEYS",
    "BlockSetResidency",
    "FallbackName",
    "FirstToken",
    "GenerateRequest",
    "GenerateResult",
    "ObservesRoutingStats",
    "ResidencyFirstRouter",
    "ResidencySource",
    "RoutingState",
    "find_request",
    "replica_load",
]

FallbackName: TypeAlias = Literal["approx", "least_loaded"]

ROUTING_STATS_KEYS = (
    "running",
    "waiting",
    "kv_utilization",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "cached_blocks",
    "version",
    "resident_blocks",
)
"""What a replica's ``record_routing_stats`` reports (the coarse cache state): running and
waiting requests, fraction of KV pages in use, cumulative request / prompt-token /
cached-token counters, the number of blocks in its prefix cache, a report counter and the
hashes of its resident blocks (at most a configured number; a snapshot, one period old)."""


def _token_ids(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError(f"prompt_ids must be a sequence of ints, got {value!r}")
    ids = tuple(value)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise UsageError(f"prompt_ids must hold ints >= 0, got {t!r}")
    return ids


@attrs.frozen(kw_only=True)
class GenerateRequest:
    """One generation request sent through the deployment handle.

    ``prompt`` is text (the replica tokenizes it); ``prompt_ids`` are token ids and win when
    both are given (a client that tokenizes itself may still send the text, e.g. for a router
    that reads ``.prompt``, as Ray's ``PrefixCacheAffinityRouter`` does). ``namespace``
    separates tenants in the replica's prefix cache and in the router's keys.
    """

    prompt: str = ""
    prompt_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_token_ids)
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    namespace: str = ""

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise UsageError(f"prompt must be a str, got {self.prompt!r}")
        if not self.prompt and not self.prompt_ids:
            raise UsageError("a request needs a non-empty prompt or prompt_ids")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise UsageError(f"max_tokens must be an int >= 1, got {m!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise UsageError(f"temperature must be a number >= 0, got {t!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise UsageError(f"seed must be None or an int, got {self.seed!r}")
        if not isinstance(self.namespace, str):
            raise UsageError(f"namespace must be a str, got {self.namespace!r}")

    def route_tokens(self) -> tuple[int, ...]:
        """What the router hashes: the token ids, else the prompt's UTF-8 bytes."""
        if self.prompt_ids:
            return self.prompt_ids
        return tuple(self.prompt.encode("utf-8"))


@attrs.frozen(kw_only=True)
class GenerateResult:
    """What a replica answers: the tokens, where the request ran and what it reused.

    ``replica`` is the Serve replica's unique id (the name routers use);
    ``cached_tokens`` of ``prompt_tokens`` came from the replica's prefix cache (its own
    counter); ``ttft`` is measured by the engine from its arrival there; ``first_token_unix``
    and ``finished_unix`` are wall-clock (``time.time()``) so a client on the same host can
    measure TTFT including routing.
    """

    replica: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    role: str
    ttft: float | None
    first_token_unix: float | None
    finished_unix: float


@attrs.frozen(kw_only=True)
class FirstToken:
    """The first event of a streamed request: its first token and where it runs."""

    replica: str
    token_id: int
    unix: float


def find_request(args: Sequence[Any], kwargs: Mapping[str, Any]) -> GenerateRequest | None:
    """The `GenerateRequest` of a handle call: the first such positional argument, or one
    built from ``prompt`` / ``prompt_ids`` keyword arguments; ``None`` when there is none
    (a call to another method) or the keywords do not make a valid request."""
    for a in args:
        if isinstance(a, GenerateRequest):
            return a
    for v in kwargs.values():
        if isinstance(v, GenerateRequest):
            return v
    if "prompt" in kwargs or "prompt_ids" in kwargs:
        fields = {k: v for k, v in kwargs.items() if k in _REQUEST_FIELDS}
        try:
            return GenerateRequest(**fields)
        except (UsageError, TypeError):
            return None
    return None


_REQUEST_FIELDS = frozenset(a.name for a in attrs.fields(GenerateRequest))


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return max(0, int(value))


def replica_load(
    name: str,
    stats: Mapping[str, Any] | None = None,
    *,
    queue_len: int | None = None,
    in_flight: int = 0,
) -> ReplicaLoad:
    """A `ReplicaLoad` from what a Serve router knows about a replica.

    ``stats`` is the replica's last ``record_routing_stats`` (may be empty or stale; junk
    values count as 0); ``queue_len`` is Serve's cached count of ongoing requests, and
    ``in_flight`` the requests this router sent that have not completed. ``running`` is the
    freshest of the three (the largest: every source undercounts, none overcounts);
    ``waiting`` and ``kv_utilization`` come from the replica.
    """
    s = stats or {}
    running = max(_count(s.get("running")), _count(queue_len), _count(in_flight))
    u = s.get("kv_utilization", 0.0)
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u):
        u = 0.0
    return ReplicaLoad(
        name=name,
        running=running,
        waiting=_count(s.get("waiting")),
        kv_utilization=min(1.0, max(0.0, float(u))),
    )


# -- residency -----------------------------------------------------------------------------


@runtime_checkable
class ResidencySource(Protocol):
    """Which engine blocks each replica holds (`BlockSetResidency`, ``KVEventResidency``).

    ``blocks`` are the prompt's chained full-block hashes as the replicas' prefix caches key
    them (``BlockHasher(block_size=engine_block_size, namespace=...)``); replicas are named
    by their Serve replica unique ids.
    """

    def resident_prefix(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        """How many leading ``blocks`` ``replica`` holds now."""
        ...

    def drop_replica(self, replica: str) -> None:
        """``replica`` is gone: forget its blocks."""
        ...


@runtime_checkable
class ObservesRoutingStats(Protocol):
    """A `ResidencySource` that also reads the replicas' routing stats (e.g. to learn where
    each replica publishes its KV events); `RoutingState.observe` passes every report on."""

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None: ...


@final
class BlockSetResidency:
    """A per-replica set of resident blocks, fed by a KV-event subscriber (or a test).

    `stored`, `removed` and `cleared` mirror vLLM's ``BlockStored``, ``BlockRemoved`` and
    ``AllBlocksCleared`` events (and the core's `PrefixCache` events of the same names).
    """

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: dict[str, set[BlockHash]] = {}

    def stored(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        self._blocks.setdefault(replica, set()).update(blocks)

    def removed(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        held = self._blocks.get(replica)
        if held is not None:
            held.difference_update(blocks)

    def cleared(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def replace(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        """A full snapshot of ``replica``'s resident blocks (a coarse stats report)."""
        self._blocks[replica] = set(blocks)

    def drop_replica(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def resident_prefix(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in blocks:
            if h not in held:
                break
            n += 1
        return n

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(sorted(self._blocks))


@final
class ResidencyFirstRouter:
    """A `Router` that sends a request to the replica holding the longest resident prefix of
    it (per a `ResidencySource`), among replicas whose load is within ``max_imbalance``
    requests of the least loaded; with no resident prefix anywhere, ``inner`` decides.
    ``inner`` learns every decision (`Router.record`)."""

    __slots__ = ("_blocks", "_inner", "_max_imbalance", "_source")

    def __init__(self, inner: Router, source: ResidencySource, *, max_imbalance: int = 8) -> None:
        m = max_imbalance
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"max_imbalance must be an int >= 0, got {max_imbalance!r}")
        self._inner = inner
        self._source = source
        self._max_imbalance = max_imbalance
        self._blocks: dict[object, tuple[BlockHash, ...]] = {}

    def set_blocks(self, request_id: object, blocks: tuple[BlockHash, ...]) -> None:
        """The engine blocks of a request about to be routed (consumed when it is)."""
        self._blocks[request_id] = blocks

    def forget(self, request_id: object) -> None:
        self._blocks.pop(request_id, None)

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        blocks = self._blocks.pop(request.request_id, ())
        if blocks and replicas:
            least = min(r.running + r.waiting for r in replicas)
            best: tuple[int, int, str] | None = None  # (-resident, load, name): smallest wins
            for r in replicas:
                load = r.running + r.waiting
                if load - least > self._max_imbalance:
                    continue
                n = self._source.resident_prefix(r.name, blocks)
                if n > 0 and (best is None or (-n, load, r.name) < best):
                    best = (-n, load, r.name)
            if best is not None:
                self._inner.record(request, best[2], now)
                return (Routed(request_id=request.request_id, replica=best[2]),)
        return self._inner.route(request, now, replicas)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        return self._inner.tick(now, replicas)

    def next_deadline(self) -> float | None:
        return self._inner.next_deadline()

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        self._blocks.pop(request.request_id, None)
        self._inner.record(request, replica, now)


# -- the routing state ---------------------------------------------------------------------


@final
class RoutingState:
    """The burst window as a Serve router needs it, time passed in as values.

    `submit` hands a request to the core `BurstAffinityRouter` (our `BurstRouter` in front of
    a fallback for the requests it leaves); `tick` seals a due window. Both return the
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
        "_residency",
        "_route_hashers",
        "_router",
        "_snapshots",
        "_stats_seen",
        "_waiting",
    )

    def __init__(
        self,
        config: BurstConfig | None = None,
        *,
        fallback: FallbackName = "approx",
        engine_block_size: int = 16,
        residency: ResidencySource | None = None,
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
        if residency is not None and not isinstance(residency, ResidencySource):
            raise ConfigError(f"residency must be a ResidencySource, got {residency!r}")
        if residency is not None and stats_residency:
            raise ConfigError("give a residency source or stats_residency=True, not both")
        self._snapshots: BlockSetResidency | None = None
        if stats_residency:
            residency = self._snapshots = BlockSetResidency()
        self._stats_seen: dict[str, object] = {}
        rng = random.Random(seed)
        inner: Router
        match fallback:
            case "approx":
                inner = ApproxPrefixRouter(
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
        self._router = BurstAffinityRouter(BurstRouter(self._burst_config, _PLACEHOLDER), inner)
        self._route_hashers: dict[str, BlockHasher] = {}
        self._engine_hashers: dict[str, BlockHasher] = {}
        self._decided: OrderedDict[str, str] = OrderedDict()
        self._waiting: set[str] = set()
        self._max_decided = max_decided

    @property
    def config(self) -> BurstConfig:
        return self._burst_config

    @property
    def deadline(self) -> float | None:
        """When the open window seals (in the caller's time); ``None`` if none is open."""
        return self._router.next_deadline()

    @property
    def now(self) -> float:
        return self._router.burst.now

    @property
    def waiting(self) -> frozenset[str]:
        """Requests waiting in the open window."""
        return frozenset(self._waiting)

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None:
        """A replica's latest ``record_routing_stats``: with ``stats_residency``, a new report
        (its ``version`` changed) replaces the replica's resident blocks; a residency source
        that `ObservesRoutingStats` gets every report."""
        source: object = self._residency
        if isinstance(source, ObservesRoutingStats):
            source.observe(replica, stats)
        if self._snapshots is None or not stats:
            return
        blocks = stats.get("resident_blocks")
        version = stats.get("version")
        if blocks is None or version is None or self._stats_seen.get(replica) == version:
            return
        self._stats_seen[replica] = version
        self._snapshots.replace(replica, blocks)

    def decision(self, request_id: str) -> str | None:
        """The replica chosen for ``request_id`` and not yet consumed."""
        return self._decided.get(request_id)

    def route_request(self, request_id: str, request: GenerateRequest) -> RouteRequest:
        """The request as the core router sees it (route keys, partial block included)."""
        tokens = request.route_tokens()
        hasher = self._route_hashers.get(request.namespace)
        if hasher is None:
            hasher = self._route_hashers[request.namespace] = BlockHasher(
                block_size=self._burst_config.block_size_tokens,
                namespace=request.namespace,
                include_partial=True,
            )
        return RouteRequest(
            request_id=request_id, blocks=hasher.hash_tokens(tokens), num_tokens=len(tokens)
        )

    def engine_blocks(self, request: GenerateRequest) -> tuple[BlockHash, ...]:
        """The prompt's full blocks as a replica's prefix cache keys them (token ids only:
        a text prompt's engine blocks need the replica's tokenizer, so none)."""
        if not request.prompt_ids:
            return ()
        hasher = self._engine_hashers.get(request.namespace)
        if hasher is None:
            hasher = self._engine_hashers[request.namespace] = BlockHasher(
                block_size=self._engine_block_size, namespace=request.namespace
            )
        return hasher.hash_tokens(request.prompt_ids)

    def submit(
        self,
        request_id: str,
        request: GenerateRequest,
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
        self._decided.pop(request_id, None)
        self._waiting.add(request_id)
        return self._record(decisions)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        """Time passed: seal the window if due; returns the decisions made now."""
        return self._record(self._router.tick(now, replicas))

    def consumed(self, request_id: str) -> None:
        """The request was sent to its replica: forget its decision."""
        self._decided.pop(request_id, None)

    @property
    def residency(self) -> ResidencySource | None:
        """The residency source (``None`` without one)."""
        return self._residency

    def drop_replica(self, name: str) -> tuple[str, ...]:
        """Forget replica ``name``; returns the withdrawn (decided, unsent) request ids."""
        withdrawn = tuple(rid for rid, rep in self._decided.items() if rep == name)
        for rid in withdrawn:
            del self._decided[rid]
        if self._residency is not None:
            self._residency.drop_replica(name)
        self._stats_seen.pop(name, None)
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


_PLACEHOLDER = (ReplicaLoad(name="-"),)
"""`BurstRouter` needs a replica to be built; every call passes the real ones."""
