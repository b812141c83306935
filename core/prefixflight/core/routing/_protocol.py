"""Values shared by every router: what a request looks like to a router, what a replica
looks like, what a routing decision is, and the small `Router` protocol.

A router sees a request as its chained block hashes (`BlockHasher` output, or a trace's
``hash_ids``) plus its prompt length; it never sees tokens or text. Replicas are named by
the host; their loads are inputs the host refreshes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final, runtime_checkable

import attrs

from .._errors import UsageError
from .._ids import RequestId
from ..cache._hashing import BlockHash
from ..validate import (
    check_block_hashes,
    check_instance,
    check_int,
    check_name,
    check_ratio,
    int_field,
    request_id_field,
)

__all__ = [
    "PrefixIndex",
    "ReplicaLoad",
    "RouteRequest",
    "Routed",
    "Router",
    "Rng",
    "check_replicas",
]


@final
@attrs.frozen(kw_only=True)
class RouteRequest:
    """A request as routers see it.

    ``blocks`` are the prompt's chained block hashes, block 0 first (a prefix of hashes is a
    prefix of tokens); ``num_tokens`` is the prompt length in tokens.
    """

    request_id: RequestId = attrs.field(validator=request_id_field())
    blocks: tuple[BlockHash, ...] = attrs.field(converter=check_block_hashes)
    num_tokens: int = attrs.field(validator=int_field(0, error=UsageError))


@final
@attrs.frozen(kw_only=True)
class ReplicaLoad:
    """One replica and its load as the host last observed it.

    ``running``: requests decoding or prefilling; ``waiting``: queued, not yet admitted;
    ``kv_utilization``: fraction of the KV cache in use, in [0, 1].
    """

    name: str
    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0

    def __attrs_post_init__(self) -> None:
        check_name("replica name", self.name)
        check_int("running", self.running, minimum=0, error=UsageError)
        check_int("waiting", self.waiting, minimum=0, error=UsageError)
        check_ratio("kv_utilization", self.kv_utilization, error=UsageError)


@final
@attrs.frozen(kw_only=True)
class Routed:
    """A final routing decision: send ``request_id`` to ``replica``."""

    request_id: RequestId
    replica: str


class Router(Protocol):
    """What the cluster simulator (and a host) needs from a router.

    Immediate routers answer `route` with one decision and never hold requests; windowed
    routers may hold requests and answer later from `route` or `tick`. Every request routed
    is answered exactly once.
    """

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        """A request arrived at ``now``; return the decisions made now (maybe none)."""
        ...

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        """Time passed; return decisions due at ``now`` (windowed routers only)."""
        ...

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do; ``None`` when nothing is held."""
        ...

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        """Learn that ``request`` was sent to ``replica`` by someone else (a wrapper)."""
        ...


@runtime_checkable
class PrefixIndex(Protocol):
    """Residency: what a router can read about replicas' caches from outside. The one
    protocol for it: a block index fed by KV events
    (``prefixflight.serve.kv_events.ClusterBlockIndex``), Ray Serve's stats snapshots and
    KV-event residency (``prefixflight.serve.ray``) all implement it."""

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        """How many leading ``blocks`` ``replica`` holds now."""
        ...


class Rng(Protocol):
    """The randomness a router or workload generator draws: ``random.Random`` fits.

    The core never imports ``random``; pass a seeded ``random.Random(seed)`` in.
    """

    def randrange(self, stop: int, /) -> int: ...

    def randint(self, a: int, b: int, /) -> int: ...

    def uniform(self, a: float, b: float, /) -> float: ...


def check_replicas(replicas: Sequence[ReplicaLoad]) -> tuple[ReplicaLoad, ...]:
    """At least one replica, each a `ReplicaLoad`, names unique."""
    out = tuple(replicas)
    if not out:
        raise UsageError("at least one replica is needed, got none")
    seen: set[str] = set()
    for r in out:
        check_instance("each replica", r, ReplicaLoad, error=UsageError)
        if r.name in seen:
            raise UsageError(f"duplicate replica name {r.name!r}")
        seen.add(r.name)
    return out
