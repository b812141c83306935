"""Executable specification of `BurstRouter`: a reference model and a conformance machine.

`reference_assign` is a literal reading of the assignment rules (after llm-d's burst
prefix-cache producer): slow, with linear scans and explicit common-prefix comparisons
instead of the implementation's hash index. `ReferenceWindow` is the batch window as a list.
`ReferenceWindow` includes the adaptive window (``lone_wait_ms``): a request sharing its
prefix with no other waiting request is released after that wait, read as a list scan; and
the quiet seal (``quiet_ms``): the deadline is the earlier of the window's end and
``quiet_ms`` after the latest request joined.
`BurstRouterConformance.for_factory(factory)` runs any implementation side by side with the
model after every step::

    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(BurstRouterConformance.for_factory(my_factory))

where ``my_factory(config, replicas)`` returns an object with ``arrive``, ``tick``,
``cancel``, ``update_replicas``, ``pending``, ``deadline`` and ``wake_at`` (see
`WindowedRouter`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar, Protocol

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import (
    BlockHash,
    BurstConfig,
    BurstRouter,
    PrefixIndex,
    ReplicaLoad,
    RequestId,
    RouteRequest,
    UsageError,
)
from prefixflight.core.routing import Assignment, NoAffinity, Placed

__all__ = [
    "BurstRouterConformance",
    "ReferenceWindow",
    "WindowedRouter",
    "burst_configs",
    "chained_blocks",
    "reference_assign",
    "replica_loads",
    "route_batches",
]


# -- the reference assignment -----------------------------------------------------------------


def _common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reference_assign(
    requests: Sequence[RouteRequest],
    replicas: Sequence[ReplicaLoad],
    config: BurstConfig,
    known: PrefixIndex | None = None,
) -> tuple[Assignment, ...]:
    """The assignment rules, read literally. Keys must be chained (position-unique) hashes.

    ``known``: the leading blocks of a key each replica is known to hold before the batch.
    The first run of a unit goes to a replica with room under the fair share that holds at
    least ``min_colocate_blocks`` of its leading blocks (placed in this batch or known),
    or, with ``min_colocate_blocks == 0``, its whole key known; the longest such hold wins."""
    cap = config.max_prefix_blocks
    k = config.max_per_replica
    m = config.min_colocate_blocks
    bs = config.block_size
    key = {r.request_id: tuple(r.blocks[:cap]) for r in requests}

    # Identical groups, in order of first arrival; empty prefixes are never grouped.
    groups: list[tuple[tuple[BlockHash, ...], list[RequestId]]] = []
    for r in requests:
        kr = key[r.request_id]
        if not kr:
            continue
        for gk, members in groups:
            if gk == kr:
                members.append(r.request_id)
                break
        else:
            groups.append((kr, [r.request_id]))

    def shares_with_another(rid: RequestId) -> bool:
        mine = key[rid]
        return len(mine) >= m and any(
            other.request_id != rid and _common_prefix(mine, key[other.request_id]) >= m
            for other in requests
        )

    identical = [g for g in groups if len(g[1]) >= 2]
    sharing = [g for g in groups if len(g[1]) == 1 and m > 0 and shares_with_another(g[1][0])]
    identical = sorted(identical, key=lambda g: -len(g[0]))  # stable: longer prefixes first
    sharing = sorted(sharing, key=lambda g: -len(g[0]))
    units = identical + sharing

    def cost(unit_key: tuple[BlockHash, ...]) -> int:
        return len(unit_key) * bs

    by_tokens = config.balance_by == "tokens"
    total = sum(cost(u[0]) if by_tokens else len(u[1]) for u in units)
    fair_share = -(-total // len(replicas))
    load = {r.name: 0 for r in replicas}
    running = {r.name: r.running for r in replicas}
    placed_keys: dict[str, list[tuple[BlockHash, ...]]] = {r.name: [] for r in replicas}
    where: dict[RequestId, tuple[str, int]] = {}

    def rank(name: str) -> tuple[int, int, str]:
        return (load[name], running[name], name)

    for unit_key, members in units:
        match = {
            name: max((_common_prefix(unit_key, pk) for pk in keys), default=0)
            for name, keys in placed_keys.items()
        }
        warm = {name: 0 if known is None else known.prefix_blocks(name, unit_key) for name in load}
        held = {name: max(match[name], warm[name]) for name in load}
        on: dict[str, int] = {name: 0 for name in load}
        left = list(members)
        first = True
        while left:
            has_room = [n for n in load if k == -1 or on[n] < k]
            target = None
            if first:
                # with m == 0 only a known whole key pulls (what this batch places is ignored)
                hold, need = (held, m) if m > 0 else (warm, len(unit_key))
                preferred = [n for n in has_room if load[n] < fair_share and hold[n] >= need]
                if preferred:
                    target = min(preferred, key=lambda n: (-hold[n], *rank(n)))
            if target is None:
                target = min(has_room or list(load), key=rank)
            first = False
            run = len(left) if k == -1 else min(len(left), max(1, k - on[target]))
            for rid in left[:run]:
                where[rid] = (target, len(unit_key))
            left = left[run:]
            if by_tokens:
                if on[target] == 0:
                    load[target] += max(0, cost(unit_key) - held[target] * bs)
            else:
                load[target] += run
            on[target] += run
        for name, n in on.items():
            if n:
                placed_keys[name].append(unit_key)

    out: list[Assignment] = []
    for r in requests:
        if r.request_id in where:
            name, blocks = where[r.request_id]
            out.append(Placed(request_id=r.request_id, replica=name, matched_blocks=blocks))
        else:
            out.append(NoAffinity(request_id=r.request_id))
    return tuple(out)


# -- the reference window ---------------------------------------------------------------------


class ReferenceWindow:
    """The batch window, plainly: a list of waiting requests with their arrival times, and the
    time the window opened."""

    def __init__(
        self,
        config: BurstConfig,
        replicas: Sequence[ReplicaLoad],
        known: PrefixIndex | None = None,
    ) -> None:
        self.config = config
        self.replicas = list(replicas)
        self.known = known
        self.waiting: list[tuple[RouteRequest, float]] = []
        self.opened_at: float | None = None
        self.joined_at: float | None = None  # when the latest request joined the window
        self.now = float("-inf")

    @property
    def deadline(self) -> float | None:
        """``window_ms`` after the window opened, or (quiet seal) ``quiet_ms`` after the
        latest request joined it, whichever is first."""
        if self.opened_at is None or self.joined_at is None:
            return None
        end = self.opened_at + self.config.window_s
        quiet = self.config.quiet_s
        return end if quiet is None else min(end, self.joined_at + quiet)

    @property
    def wake_at(self) -> float | None:
        """The deadline, or the earlier release time of a lone request (adaptive window)."""
        deadline = self.deadline
        if deadline is None:
            return None
        return min([deadline, *(release for _, release in self._lone_releases())])

    @property
    def pending(self) -> tuple[RequestId, ...]:
        return tuple(r.request_id for r, _ in self.waiting)

    def _shares(self, a: RouteRequest, b: RouteRequest) -> bool:
        """Would a seal place ``a`` with ``b``: the same non-empty key, or (with
        ``min_colocate_blocks``) at least that many leading blocks in common."""
        cap, m = self.config.max_prefix_blocks, self.config.min_colocate_blocks
        ka, kb = tuple(a.blocks[:cap]), tuple(b.blocks[:cap])
        if ka and ka == kb:
            return True
        return m > 0 and _common_prefix(ka, kb) >= m

    def _lone_releases(self) -> list[tuple[RouteRequest, float]]:
        """Each waiting request that shares with no other waiting one, and its release time."""
        wait = self.config.lone_wait_s
        if wait is None:
            return []
        return [
            (r, at + wait)
            for r, at in self.waiting
            if not any(o.request_id != r.request_id and self._shares(r, o) for o, _ in self.waiting)
        ]

    def _release(self, now: float) -> tuple[Assignment, ...]:
        """Release the lone requests whose wait ended by ``now`` (and by the deadline)."""
        deadline = self.deadline
        if deadline is None:
            return ()
        until = min(now, deadline)
        gone = {r.request_id for r, release in self._lone_releases() if release <= until}
        out = tuple(
            NoAffinity(request_id=r.request_id) for r, _ in self.waiting if r.request_id in gone
        )
        self.waiting = [(r, at) for r, at in self.waiting if r.request_id not in gone]
        if not self.waiting:
            self.opened_at = self.joined_at = None
        return out

    def _seal(self) -> tuple[Assignment, ...]:
        batch, self.waiting, self.opened_at, self.joined_at = self.waiting, [], None, None
        return reference_assign([r for r, _ in batch], self.replicas, self.config, self.known)

    def _check_time(self, now: float) -> None:
        if not math.isfinite(now) or now < self.now:
            raise UsageError(f"bad time {now!r}")

    def _full(self) -> bool:
        cap = self.config.max_batch_size
        return cap != -1 and len(self.waiting) >= cap

    def arrive(self, request: RouteRequest, now: float) -> tuple[Assignment, ...]:
        """Lone requests due by ``now`` are released, then a late arrival seals the open
        batch. Then, when the batch is full: with ``full_batch="no_affinity"`` (llm-d) the
        arrival gets NoAffinity and is not added; with ``"seal_early"`` the arrival that
        fills the batch seals it, itself included. An id still waiting after the releases
        and the seal is rejected."""
        self._check_time(now)
        deadline = self.deadline
        late = deadline is not None and now >= deadline
        if not late and request.request_id in self.pending:
            until = now if deadline is None else min(now, deadline)
            due = {r.request_id for r, release in self._lone_releases() if release <= until}
            if request.request_id not in due:
                raise UsageError(f"{request.request_id!r} is already waiting")
        out = self._release(now)
        if late:
            out += self._seal()
        self.now = now
        if self._full():
            assert self.config.full_batch == "no_affinity", "a seal_early batch is never full"
            return (*out, NoAffinity(request_id=request.request_id))
        if self.opened_at is None:
            self.opened_at = now
        self.joined_at = now
        self.waiting.append((request, now))
        if self._full() and self.config.full_batch == "seal_early":
            out += self._seal()
        return out

    def tick(self, now: float) -> tuple[Assignment, ...]:
        self._check_time(now)
        self.now = now
        out = self._release(now)
        deadline = self.deadline
        return out + self._seal() if deadline is not None and now >= deadline else out

    def cancel(self, request_id: RequestId) -> None:
        if request_id not in self.pending:
            raise UsageError(f"{request_id!r} is not waiting")
        self.waiting = [(r, at) for r, at in self.waiting if r.request_id != request_id]
        if not self.waiting:
            self.opened_at = self.joined_at = None

    def update_replicas(self, replicas: Sequence[ReplicaLoad]) -> None:
        names = [r.name for r in replicas]
        if not names or len(set(names)) != len(names):
            raise UsageError("replica names must be unique and non-empty")
        self.replicas = list(replicas)


# -- strategies -------------------------------------------------------------------------------


class WindowedRouter(Protocol):
    """What the conformance machine drives (`BurstRouter` is one)."""

    @property
    def pending(self) -> tuple[RequestId, ...]: ...

    @property
    def deadline(self) -> float | None: ...

    @property
    def wake_at(self) -> float | None: ...

    def arrive(self, request: RouteRequest, now: float) -> tuple[Assignment, ...]: ...

    def tick(self, now: float) -> tuple[Assignment, ...]: ...

    def cancel(self, request_id: RequestId) -> None: ...

    def update_replicas(self, replicas: Sequence[ReplicaLoad]) -> None: ...


RouterFactory = Callable[..., WindowedRouter]
"""``factory(config, replicas)``, or ``factory(config, replicas, known=index)`` for a machine
made with ``known=True``."""


class _KnownPrefixes:
    """A `PrefixIndex` read literally: per replica, the keys it is known to hold; a replica
    holds the longest common prefix of a prompt with any of them."""

    def __init__(self) -> None:
        self.keys: dict[str, list[tuple[BlockHash, ...]]] = {}

    def learn(self, replica: str, key: Sequence[BlockHash]) -> None:
        self.keys.setdefault(replica, []).append(tuple(key))

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        return max((_common_prefix(blocks, k) for k in self.keys.get(replica, ())), default=0)


@st.composite
def chained_blocks(draw: st.DrawFn, max_blocks: int = 4, alphabet: int = 3) -> tuple[Any, ...]:
    """Block hashes that chain like `BlockHasher`'s: block ``i`` stands for tokens ``0..i``.

    A small alphabet makes shared prefixes and identical prompts common.
    """
    tokens = draw(st.lists(st.integers(0, alphabet - 1), max_size=max_blocks))
    return tuple(tuple(tokens[: i + 1]) for i in range(len(tokens)))


def replica_loads(max_replicas: int = 4) -> st.SearchStrategy[list[ReplicaLoad]]:
    """One to ``max_replicas`` replicas with distinct names and small running counts."""
    return st.lists(st.integers(0, 3), min_size=1, max_size=max_replicas).map(
        lambda running: [ReplicaLoad(name=f"r{i}", running=n) for i, n in enumerate(running)]
    )


@st.composite
def burst_configs(draw: st.DrawFn) -> BurstConfig:
    """Small configurations that reach every branch quickly (block size 4); half of them
    with the adaptive window (``lone_wait_ms`` at most the window), a quarter with the quiet
    seal (``quiet_ms``)."""
    window_ms = draw(st.sampled_from([10, 50, 100]))
    return BurstConfig(
        window_ms=window_ms,
        max_per_replica=draw(st.sampled_from([-1, 1, 2, 3])),
        block_size=4,
        max_prefix_tokens_to_match=draw(st.sampled_from([0, 8, 12])),
        min_colocate_blocks=draw(st.sampled_from([0, 1, 2])),
        max_batch_size=draw(st.sampled_from([-1, 1, 3, 6])),
        full_batch=draw(st.sampled_from(["no_affinity", "seal_early"])),
        balance_by=draw(st.sampled_from(["requests", "tokens"])),
        lone_wait_ms=draw(st.sampled_from([None, 4, window_ms // 2, window_ms])),
        quiet_ms=draw(st.sampled_from([None, None, 4, window_ms // 2])),
    )


@st.composite
def route_batches(draw: st.DrawFn, max_size: int = 12) -> list[RouteRequest]:
    """Batches with unique ids whose prompts come from a small pool of chained keys, so
    identical groups, shared prefixes and singletons are all common."""
    pool = draw(st.lists(chained_blocks(), min_size=1, max_size=5))
    picks = draw(st.lists(st.sampled_from(pool), max_size=max_size))
    return [
        RouteRequest(request_id=i, blocks=k, num_tokens=4 * len(k)) for i, k in enumerate(picks)
    ]


def _arrive_at(router: WindowedRouter, *, request: RouteRequest, now: float) -> Any:
    return router.arrive(request, now)


# -- the conformance machine ------------------------------------------------------------------


class BurstRouterConformance(RuleBasedStateMachine):
    """A router implementation vs `ReferenceWindow`, compared after every step."""

    factory: ClassVar[RouterFactory] = BurstRouter
    known: ClassVar[bool] = True

    @classmethod
    def for_factory(
        cls, factory: RouterFactory, *, known: bool = False
    ) -> type[BurstRouterConformance]:
        """A machine class that tests ``factory(config, replicas)``'s routers; with
        ``known=True``, ``factory(config, replicas, known=index)``: routers that read known
        prefixes (a `PrefixIndex`) when a batch seals, as `BurstRouter` does."""
        attrs = {"factory": staticmethod(factory), "known": known}
        return type(f"{cls.__name__}For", (cls,), attrs)

    def __init__(self) -> None:
        super().__init__()
        self.impl: WindowedRouter | None = None
        self.model: ReferenceWindow | None = None
        self.now = 0.0
        self.next_id = 0
        self.sealed: set[RequestId] = set()
        self.prompts: list[tuple[Any, ...]] = []
        self.replica_names: list[str] = []
        self.index: _KnownPrefixes | None = None

    @initialize(
        config=burst_configs(),
        replicas=replica_loads(),
        prompts=st.lists(chained_blocks(), min_size=1, max_size=4),
    )
    def start(
        self, config: BurstConfig, replicas: list[ReplicaLoad], prompts: list[tuple[Any, ...]]
    ) -> None:
        """Arrivals draw their prompts from a small pool, so groups and shared prefixes form."""
        note(f"config={config!r} replicas={replicas!r}")
        self.prompts = prompts
        self.replica_names = sorted({r.name for r in replicas})
        if type(self).known:
            self.index = _KnownPrefixes()
            self.impl = type(self).factory(config, replicas, known=self.index)
        else:
            self.impl = type(self).factory(config, replicas)
        self.model = ReferenceWindow(config, replicas, self.index)

    def _both(self, call: Callable[[Any], Any]) -> Any:
        assert self.impl is not None and self.model is not None
        before = (self.impl.pending, self.impl.deadline, self.impl.wake_at)
        try:
            got = call(self.impl)
        except UsageError as exc:
            note(f"implementation rejected: {exc}")
            try:
                call(self.model)
            except UsageError:
                after = (self.impl.pending, self.impl.deadline, self.impl.wake_at)
                assert after == before, "state changed"
                return None
            raise AssertionError(f"implementation rejected what the model accepts: {exc}") from None
        want = call(self.model)
        assert got == want, f"implementation {got!r} != model {want!r}"
        for a in got or ():
            assert a.request_id not in self.sealed, f"{a.request_id!r} answered twice"
            self.sealed.add(a.request_id)
        return got

    @rule(dt=st.sampled_from([0.0, 0.004, 0.02, 0.05, 0.1, 0.2]), data=st.data())
    def arrive(self, dt: float, data: st.DataObject) -> None:
        blocks = data.draw(st.sampled_from(self.prompts))
        self.now += dt
        request = RouteRequest(request_id=self.next_id, blocks=blocks, num_tokens=4 * len(blocks))
        self.next_id += 1
        note(f"arrive {request.request_id} at {self.now}")
        self._both(lambda r: r.arrive(request, self.now))

    @rule(n=st.integers(2, 8), data=st.data())
    def burst(self, n: int, data: st.DataObject) -> None:
        """Several arrivals at one instant (the samples of one prompt, a fan-out): fills
        batches, so ``max_batch_size`` and ``full_batch`` are exercised on every run."""
        for _ in range(n):
            blocks = data.draw(st.sampled_from(self.prompts))
            rid = self.next_id
            self.next_id += 1
            request = RouteRequest(request_id=rid, blocks=blocks, num_tokens=4 * len(blocks))
            note(f"arrive {rid} at {self.now}")
            self._both(partial(_arrive_at, request=request, now=self.now))

    @precondition(lambda self: self.impl is not None and bool(self.impl.pending))
    @rule(data=st.data())
    def arrive_again(self, data: st.DataObject) -> None:
        """A waiting id arrives again: rejected, unless the arrival first releases it (its lone
        wait ended; a cancel made it lone) or seals its window."""
        assert self.impl is not None
        rid = data.draw(st.sampled_from(sorted(self.impl.pending, key=repr)))
        self._both(
            lambda r: r.arrive(RouteRequest(request_id=rid, blocks=(), num_tokens=0), self.now)
        )
        if rid in self.impl.pending:  # released first (adaptive window), then waiting anew
            self.sealed.discard(rid)

    @rule(dt=st.sampled_from([0.0, 0.004, 0.02, 0.05, 0.1, 0.2]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._both(lambda r: r.tick(self.now))

    @precondition(lambda self: self.model is not None and self.model.wake_at is not None)
    @rule()
    def tick_at_wake(self) -> None:
        """Exactly when the router said it would have something to do (a release, a seal)."""
        assert self.model is not None and self.model.wake_at is not None
        self.now = max(self.now, self.model.wake_at)
        self._both(lambda r: r.tick(self.now))

    @rule()
    def tick_in_the_past(self) -> None:
        self._both(lambda r: r.tick(self.now - 1.0))

    @precondition(lambda self: self.impl is not None and bool(self.impl.pending))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        assert self.impl is not None
        rid = data.draw(st.sampled_from(sorted(self.impl.pending, key=repr)))
        self._both(lambda r: r.cancel(rid))

    @rule()
    def cancel_unknown(self) -> None:
        self._both(lambda r: r.cancel(-1))

    @rule(replicas=replica_loads())
    def update_replicas(self, replicas: list[ReplicaLoad]) -> None:
        self._both(lambda r: r.update_replicas(replicas))
        if self.model is not None:
            self.replica_names = sorted({r.name for r in self.model.replicas})

    @precondition(lambda self: self.index is not None)
    @rule(data=st.data())
    def learn(self, data: st.DataObject) -> None:
        """A replica is known to hold a prompt (routed there before: what `ApproxPrefixRouter`
        records); the next seal reads it."""
        assert self.index is not None
        replica = data.draw(st.sampled_from(self.replica_names))
        key = data.draw(st.sampled_from(self.prompts))
        note(f"known: {replica} holds {key!r}")
        self.index.learn(replica, key)

    @invariant()
    def views_agree(self) -> None:
        assert self.impl is not None and self.model is not None  # invariants run after `start`
        assert self.impl.pending == self.model.pending
        assert self.impl.deadline == self.model.deadline
        assert self.impl.wake_at == self.model.wake_at
        check = getattr(self.impl, "check_invariants", None)
        if check is not None:
            check()
