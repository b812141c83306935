"""The Ray-free half of the Ray Serve integration: request values, the mapping from Ray's
router objects to the core's routing values, and the routing state the Ray router drives.

Nothing here imports Ray (or torch): the mapping and the window logic are tested with plain
objects. `BurstRequestRouter` (``_router.py``) is the thin glue that calls `RoutingState` from
Ray Serve's event loop, passing the loop's time as a value.

Real cache residency comes through the core's `PrefixIndex` (``prefix_blocks``), the one
residency protocol (``prefixflight.serve._residency``): a per-replica view of which engine
blocks each replica holds. Without one, requests that the burst window leaves alone
(`NoAffinity`) go to the fallback router, llm-d's approximate prefix scorer
(`ApproxPrefixRouter`), which *assumes* a replica caches what it was sent. Two sources are
built: `BlockSetResidency`, fed by the block snapshots in the replicas' routing stats, and
``KVEventResidency`` (``_kv_residency.py``), a KV-event subscriber following every replica's
publisher (vLLM-shaped ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events).
Both also `FollowsReplicas`: they read the stats reports and forget dead replicas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from prefixflight.core import (
    ReplicaLoad,
    UsageError,
)

from .._routing import FallbackName, RoutingState

__all__ = [
    "ROUTING_STATS_KEYS",
    "FallbackName",
    "FirstToken",
    "GenerateRequest",
    "GenerateResult",
    "RoutingState",
    "find_request",
    "replica_load",
]

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
