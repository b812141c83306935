"""Cache residency for routers in front of real replicas. Ray-free, ZMQ-free.

One protocol says which blocks a replica holds: the core's `PrefixIndex`
(``prefix_blocks(replica, blocks) -> int``, the leading blocks of a prompt that replica
holds now). Every source implements it: the block index a KV-event subscriber keeps
(``prefixflight.serve.kv_events.ClusterBlockIndex``), `BlockSetResidency` here (snapshots in
Ray Serve's routing stats, or events applied by hand), ``KVEventResidency`` in the Ray
package. A source that also follows replicas as they come and go implements
`FollowsReplicas`; a host calls it when it has news and ignores it otherwise.

`ResidencyFirstRouter` is the one place where residency decides: a request goes to the
replica holding its longest resident prefix (within a load margin), else to the router it
wraps. Both hosts (``prefixflight route`` and the Ray Serve router) use it as the fallback
behind the burst window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, final, runtime_checkable

from prefixflight.core import (
    BlockHash,
    ConfigError,
    PrefixIndex,
    ReplicaLoad,
    Routed,
    Router,
    RouteRequest,
)

__all__ = ["BlockSetResidency", "FollowsReplicas", "PrefixIndex", "ResidencyFirstRouter"]


@runtime_checkable
class FollowsReplicas(Protocol):
    """A `PrefixIndex` that learns from the replicas' reports and forgets dead replicas."""

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None:
        """``replica``'s latest report (Ray Serve's ``record_routing_stats``)."""
        ...

    def drop_replica(self, replica: str) -> None:
        """``replica`` is gone: forget its blocks."""
        ...


@final
class BlockSetResidency:
    """A per-replica set of resident blocks (a `PrefixIndex` that `FollowsReplicas`).

    `stored`, `removed` and `cleared` mirror vLLM's ``BlockStored``, ``BlockRemoved`` and
    ``AllBlocksCleared`` events (and the core's `PrefixCache` events of the same names);
    `observe` takes the snapshot a replica reports in its routing stats
    (``resident_blocks``), once per new ``version``.
    """

    __slots__ = ("_blocks", "_versions")

    def __init__(self) -> None:
        self._blocks: dict[str, set[BlockHash]] = {}
        self._versions: dict[str, object] = {}

    def stored(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        self._blocks.setdefault(replica, set()).update(blocks)

    def removed(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        held = self._blocks.get(replica)
        if held is not None:
            held.difference_update(blocks)

    def cleared(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def replace(self, replica: str, blocks: Iterable[BlockHash]) -> None:
        """A full snapshot of ``replica``'s resident blocks."""
        self._blocks[replica] = set(blocks)

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None:
        """A routing-stats report: a new ``version`` with ``resident_blocks`` replaces the
        replica's blocks; a report seen before (or without a snapshot) changes nothing."""
        if not stats:
            return
        blocks = stats.get("resident_blocks")
        version = stats.get("version")
        if blocks is None or version is None or self._versions.get(replica) == version:
            return
        self._versions[replica] = version
        self.replace(replica, blocks)

    def drop_replica(self, replica: str) -> None:
        self._blocks.pop(replica, None)
        self._versions.pop(replica, None)

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
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
    it (per a `PrefixIndex`), among replicas whose load is within ``max_imbalance``
    requests of the least loaded; with no resident prefix anywhere, ``inner`` decides.
    ``inner`` learns every decision (`Router.record`).

    The engine blocks of a request (hashed as the replicas' caches key them, which need not
    be the router's keys) are given with `set_blocks` before it is routed."""

    __slots__ = ("_blocks", "_index", "_inner", "_max_imbalance")

    def __init__(self, inner: Router, index: PrefixIndex, *, max_imbalance: int = 8) -> None:
        m = max_imbalance
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"max_imbalance must be an int >= 0, got {max_imbalance!r}")
        if not isinstance(index, PrefixIndex):
            raise ConfigError(f"index must be a PrefixIndex (prefix_blocks), got {index!r}")
        self._inner = inner
        self._index = index
        self._max_imbalance = max_imbalance
        self._blocks: dict[object, tuple[BlockHash, ...]] = {}

    @property
    def index(self) -> PrefixIndex:
        return self._index

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
                n = self._index.prefix_blocks(r.name, blocks)
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
