"""The routers `BurstRouter` is measured against, and the adapter that puts it behind `Router`.

- `LeastLoadedRouter`: fewest running + waiting requests.
- `ApproxPrefixRouter`: llm-d's approximate prefix-cache-aware routing as deployed today
  (its default scheduling profile): a per-replica LRU index of block hashes that *assumes*
  the chosen replica will cache the prompt, a prefix score (matched leading blocks / prompt
  blocks, weight 3), a queue score (waiting requests, min-max normalised, weight 2) and a
  KV-utilisation score (1 - utilisation, weight 2); the highest total wins and ties are
  broken at random, like llm-d's max-score picker. llm-d records a decision in its index
  only after scheduling it, so requests scheduled concurrently do not see each other:
  ``index_lag`` (seconds) models that; a decision becomes visible ``index_lag`` after it
  was made. A cold burst therefore scores zero everywhere and scatters by load. With
  ``index=`` (a `PrefixIndex`, e.g. a block index fed by the replicas' KV events) the prefix
  score reads that index instead and nothing is assumed, as llm-d's precise prefix-cache
  scorer reads its KV-event index.
- `BurstAffinityRouter`: `BurstRouter` in front of another router: requests it places go
  where it says; those with no affinity go to the fallback (as llm-d's scorer chain does).

Randomness comes only from the ``random.Random`` passed in; without one, ties break on name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import final

import attrs

from .._errors import UsageError
from .._ids import RequestId
from ..cache._hashing import BlockHash
from ..cache._policies import LRU
from ..validate import assert_never, check_instance, check_int, check_number, check_time
from ._burst import BurstRouter, NoAffinity, Placed
from ._protocol import (
    PrefixIndex,
    ReplicaLoad,
    Rng,
    Routed,
    Router,
    RouteRequest,
    check_replicas,
)

__all__ = ["ApproxPrefixConfig", "ApproxPrefixRouter", "BurstAffinityRouter", "LeastLoadedRouter"]


def _pick(candidates: list[str], rng: Rng | None) -> str:
    """One of ``candidates`` (sorted by name): at random with ``rng``, else the first."""
    if rng is None or len(candidates) == 1:
        return candidates[0]
    return candidates[rng.randrange(len(candidates))]


@final
class LeastLoadedRouter:
    """Route each request at once to the replica with the fewest running + waiting requests."""

    __slots__ = ("_now", "_rng")

    def __init__(self, rng: Rng | None = None) -> None:
        self._rng = rng
        self._now = float("-inf")

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        t = check_time("now", now, after=self._now)
        reps = check_replicas(replicas)
        self._now = t
        least = min(r.running + r.waiting for r in reps)
        names = sorted(r.name for r in reps if r.running + r.waiting == least)
        return (Routed(request_id=request.request_id, replica=_pick(names, self._rng)),)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        self._now = check_time("now", now, after=self._now)
        return ()

    def next_deadline(self) -> float | None:
        return None

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        """Nothing to learn."""


@final
@attrs.frozen(kw_only=True)
class ApproxPrefixConfig:
    """llm-d's approximate prefix-cache scorer and its default weights."""

    lru_capacity_per_server: int = 31250
    max_prefix_blocks_to_match: int = 256
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    index_lag: float = 0.0

    def __attrs_post_init__(self) -> None:
        for name in ("lru_capacity_per_server", "max_prefix_blocks_to_match"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("prefix_weight", "queue_weight", "kv_weight", "index_lag"):
            check_number(name, getattr(self, name), minimum=0)


@final
class ApproxPrefixRouter:
    """llm-d's approximate prefix-cache-aware routing (see the module docstring)."""

    __slots__ = ("_config", "_external", "_index", "_lagged", "_now", "_rng")

    def __init__(
        self,
        config: ApproxPrefixConfig | None = None,
        rng: Rng | None = None,
        *,
        index: PrefixIndex | None = None,
    ) -> None:
        self._config = ApproxPrefixConfig() if config is None else config
        self._rng = rng
        self._external = index
        self._index: dict[str, LRU] = {}
        self._lagged: deque[tuple[float, str, tuple[BlockHash, ...]]] = deque()
        self._now = float("-inf")

    @property
    def config(self) -> ApproxPrefixConfig:
        return self._config

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        """How many leading ``blocks`` the index believes ``replica`` holds now (so this
        router is a `PrefixIndex` of what it routed: `BurstRouter`'s ``known``)."""
        if self._external is not None:
            return self._external.prefix_blocks(replica, blocks)
        lru = self._index.get(replica)
        return 0 if lru is None else lru.resident_prefix(blocks)

    def scores(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> dict[str, float]:
        """Each replica's weighted score for ``request`` (higher is better)."""
        c = self._config
        blocks = request.blocks[: c.max_prefix_blocks_to_match]
        lo = min(r.waiting for r in replicas)
        hi = max(r.waiting for r in replicas)
        out: dict[str, float] = {}
        for r in replicas:
            prefix = self.prefix_blocks(r.name, blocks) / len(blocks) if blocks else 0.0
            queue = 1.0 if hi == lo else (hi - r.waiting) / (hi - lo)
            kv = 1.0 - r.kv_utilization
            out[r.name] = c.prefix_weight * prefix + c.queue_weight * queue + c.kv_weight * kv
        return out

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        t = check_time("now", now, after=self._now)
        reps = check_replicas(replicas)
        self._now = t
        self._apply_lagged(t)
        scores = self.scores(request, reps)
        best = max(scores.values())
        names = sorted(n for n, s in scores.items() if s == best)
        target = _pick(names, self._rng)
        self.record(request, target, t)
        return (Routed(request_id=request.request_id, replica=target),)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        self._now = check_time("now", now, after=self._now)
        self._apply_lagged(self._now)
        return ()

    def next_deadline(self) -> float | None:
        return None

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        """Assume ``replica`` caches the prompt; the index learns it after ``index_lag``.

        With an external ``index`` nothing is assumed: that index follows the replicas."""
        if self._external is not None:
            return
        blocks = request.blocks[: self._config.max_prefix_blocks_to_match]
        if self._config.index_lag > 0:
            self._lagged.append((now + self._config.index_lag, replica, blocks))
        else:
            self._learn(replica, blocks)

    def _apply_lagged(self, now: float) -> None:
        lagged = self._lagged
        while lagged and lagged[0][0] <= now:
            _, replica, blocks = lagged.popleft()
            self._learn(replica, blocks)

    def _learn(self, replica: str, blocks: tuple[BlockHash, ...]) -> None:
        lru = self._index.get(replica)
        if lru is None:
            lru = self._index[replica] = LRU(self._config.lru_capacity_per_server)
        lru.access(blocks)


@final
class BurstAffinityRouter:
    """`BurstRouter` behind the `Router` protocol, with a fallback for requests it leaves.

    Every request waits for its window (its id may not arrive again while it waits). When
    the batch seals, a `Placed` request goes to its
    replica (and the fallback learns of it through `Router.record`); a `NoAffinity` request is
    routed by the fallback. Decisions of one seal see each other: the replica chosen for one
    counts as one more waiting request for the next.
    """

    __slots__ = ("_burst", "_fallback", "_held")

    def __init__(self, burst: BurstRouter, fallback: Router) -> None:
        self._burst = burst
        self._fallback = fallback
        self._held: dict[RequestId, RouteRequest] = {}

    @property
    def burst(self) -> BurstRouter:
        return self._burst

    def route(
        self, request: RouteRequest, now: float, replicas: Sequence[ReplicaLoad]
    ) -> tuple[Routed, ...]:
        check_time("now", now, after=self._burst.now)
        reps = check_replicas(replicas)
        check_instance("request", request, RouteRequest, error=UsageError)
        if request.request_id in self._held:
            raise UsageError(f"request {request.request_id!r} is already waiting")
        self._burst.update_replicas(reps)
        sealed = self._burst.arrive(request, now)
        self._held[request.request_id] = request
        return self._resolve(sealed, now, reps)

    def tick(self, now: float, replicas: Sequence[ReplicaLoad]) -> tuple[Routed, ...]:
        check_time("now", now, after=self._burst.now)
        reps = check_replicas(replicas)
        self._burst.update_replicas(reps)
        sealed = self._burst.tick(now)
        self._fallback.tick(now, reps)
        return self._resolve(sealed, now, reps)

    def next_deadline(self) -> float | None:
        return self._burst.wake_at

    def record(self, request: RouteRequest, replica: str, now: float) -> None:
        self._fallback.record(request, replica, now)

    def _resolve(
        self,
        sealed: tuple[Placed | NoAffinity, ...],
        now: float,
        replicas: tuple[ReplicaLoad, ...],
    ) -> tuple[Routed, ...]:
        out: list[Routed] = []
        reps = list(replicas)
        for a in sealed:
            request = self._held.pop(a.request_id)
            match a:
                case Placed(replica=replica):
                    self._fallback.record(request, replica, now)
                case NoAffinity():
                    (decision,) = self._fallback.route(request, now, reps)
                    replica = decision.replica
                case _:
                    assert_never(a)
            out.append(Routed(request_id=a.request_id, replica=replica))
            reps = [
                attrs.evolve(r, waiting=r.waiting + 1) if r.name == replica else r for r in reps
            ]
        return tuple(out)
