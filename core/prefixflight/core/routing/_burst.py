"""Burst prefix-affinity routing: co-locate prompt-sharing requests that arrive in one window.

A port of llm-d's burst prefix-cache producer (llm-d's burst prefix-affinity PR; in
llm-d-router: ``pkg/epp/framework/plugins/requestcontrol/dataproducer/burstprefix``) as a
pure state machine. When a burst of requests sharing a prompt arrives at once, no replica's
cache is warm yet, so a prefix-cache scorer sees zero everywhere and load balancing scatters
the burst: the shared prefix is prefilled on every replica. `BurstRouter` instead collects
the arrivals of one batch window and places them jointly, so requests sharing a prefix land
together and the prefix is prefilled once.

Grouping key. A request's key is its full chained block-hash sequence, capped at the match
limit. **The trailing partial block is part of the key** (hash prompts with
``BlockHasher(include_partial=True)``, as `BurstRouter.hash_prompt` does), as in llm-d: two
prompts that differ only in their last few tokens are different prompts, not samples of one,
and a prompt shorter than one block (GRPO prompts of 55-88 tokens with 64-token blocks) still
gets a non-empty key instead of no affinity at all.

The window is driven by explicit time: the first arrival opens it, ``now`` rides on every
call, and an arrival or a `tick` at or past the deadline seals it. Sealing returns one
`Assignment` per request of the batch, in arrival order.

A full batch (``max_batch_size`` requests) behaves as in llm-d by default
(``full_batch="no_affinity"``): a request arriving when the batch is full is answered
`NoAffinity` at once ("batch full": no burst affinity, the fallback routes it) and the batch
still seals only at its deadline. ``full_batch="seal_early"`` is a prefixflight extension:
the arrival that fills the batch seals it at once, itself included, and the next arrival
opens a new window.

Deviation from llm-d: `BurstRouter.cancel` removes the request from the open batch (it no
longer counts toward ``max_batch_size`` or the joint placement, and an emptied window
closes); llm-d leaves a cancelled request's entry in its batch until the timer seals it.

The adaptive window (``lone_wait_ms``, a prefixflight extension, off by default): a request
that shares its prefix with nothing else in the window is released after ``lone_wait_ms``
instead of waiting for the seal, answered `NoAffinity` (what the seal would answer if nothing
sharing arrived meanwhile). A request that shares its prefix with another waits for the seal
as before. The burst's samples arrive within milliseconds of each other, so the first one is
no longer alone by the time its short wait ends; a request nobody shares with stops paying the
whole window.

The quiet seal (``quiet_ms``, a prefixflight extension, off by default): the window also
seals once no request has joined it for ``quiet_ms``, so a burst that arrives within a few
milliseconds is placed a few milliseconds after its last sample instead of at the end of the
window. The window never outlasts ``window_ms``. A burst with a longer gap inside it is
sealed in two batches; with ``known`` (below) the second follows the first.

Known prefixes (``known``, a prefixflight extension, off by default): a `PrefixIndex` over
the router's own keys, read when a batch seals, of what replicas are known to hold already
(e.g. `ApproxPrefixRouter`, which records every routing decision at once). A unit whose
prefix is known somewhere goes there, within the same caps: a burst that straddles two
windows (its first samples routed, its KV events not yet arrived) stays on one replica
instead of being placed afresh in the second window. With ``min_colocate_blocks`` ``m > 0`` a
known prefix counts as a match like one placed in the same batch (at least ``m`` leading
blocks); with ``m == 0`` only a known whole key pulls (identical prompts, as the batch itself
groups them).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal, TypeAlias, final

import attrs

from .._errors import ConfigError, UsageError
from .._ids import RequestId
from ..cache._hashing import BlockHash, BlockHasher
from ..validate import check_choice, check_instance, check_int, check_time, deprecated_alias
from ._protocol import PrefixIndex, ReplicaLoad, RouteRequest, check_replicas

__all__ = [
    "Assignment",
    "BalanceBy",
    "BurstConfig",
    "BurstRouter",
    "FullBatch",
    "NoAffinity",
    "Placed",
    "assign_batch",
]

BalanceBy: TypeAlias = Literal["requests", "tokens"]
FullBatch: TypeAlias = Literal["no_affinity", "seal_early"]

UNLIMITED = -1
DEFAULT_MAX_PREFIX_BLOCKS = 2048
"""llm-d's default cap on the blocks in a group key (``max_prefix_tokens_to_match=0``)."""


@final
@deprecated_alias("block_size_tokens", "block_size")
@attrs.frozen(kw_only=True)
class BurstConfig:
    """`BurstRouter`'s settings (llm-d's parameter names in snake case, but ``block_size``, the
    block size's one name here); validated here.

    - ``window_ms``: batch window T, 1..10000 ms.
    - ``max_per_replica``: k, the most members of one unit per replica; -1 puts a whole
      group on one replica.
    - ``block_size``: tokens per block of the hashes the router is given (llm-d's
      ``blockSizeTokens``; ``block_size_tokens`` is its deprecated name here).
    - ``max_prefix_tokens_to_match``: cap on the tokens in a key; 0 means 2048 blocks.
    - ``min_colocate_blocks``: shared leading blocks that make different prompts co-locate
      (and give a lone request an affinity); 0 co-locates identical groups only.
    - ``max_batch_size``: the most requests in one batch; -1 for no cap.
    - ``full_batch``: what a request arriving at a full batch gets. ``"no_affinity"``
      (llm-d's behaviour, the default): `NoAffinity` at once, and the batch still seals at
      its deadline. ``"seal_early"`` (a prefixflight extension, not in llm-d): the arrival
      that fills the batch seals it at once, itself included.
    - ``balance_by``: ``"requests"`` or ``"tokens"`` (uncached prefix tokens).
    - ``lone_wait_ms``: the adaptive window (a prefixflight extension, not in llm-d). ``None``
      (the default, llm-d's behaviour): every request waits for the seal. An int in
      ``1..window_ms``: a request that shares its prefix (an identical key, or at least
      ``min_colocate_blocks`` leading blocks when that is set) with no other waiting request
      is released `NoAffinity` once it has waited that long.
    - ``quiet_ms``: the quiet seal (a prefixflight extension, not in llm-d). ``None`` (the
      default, llm-d's behaviour): a window seals ``window_ms`` after it opened. An int in
      ``1..window_ms``: it seals earlier, once ``quiet_ms`` have passed since the last request
      joined it.
    """

    window_ms: int = 100
    max_per_replica: int = UNLIMITED
    block_size: int = 64
    max_prefix_tokens_to_match: int = 0
    min_colocate_blocks: int = 0
    max_batch_size: int = 1000
    full_batch: FullBatch = "no_affinity"
    balance_by: BalanceBy = "requests"
    lone_wait_ms: int | None = None
    quiet_ms: int | None = None

    def __attrs_post_init__(self) -> None:
        w = check_int("window_ms", self.window_ms)
        if not 1 <= w <= 10_000:
            raise ConfigError(f"window_ms must be in 1..10000, got {w!r}")
        k = check_int("max_per_replica", self.max_per_replica, minimum=UNLIMITED)
        if k == 0:
            raise ConfigError(f"max_per_replica must be -1 (unlimited) or >= 1, got {k!r}")
        bs = check_int("block_size", self.block_size, minimum=1)
        cap = check_int("max_prefix_tokens_to_match", self.max_prefix_tokens_to_match, minimum=0)
        if cap != 0 and cap < bs:
            raise ConfigError(
                f"max_prefix_tokens_to_match must be 0 or >= block_size ({bs}), got {cap!r}"
            )
        check_int("min_colocate_blocks", self.min_colocate_blocks, minimum=0)
        b = check_int("max_batch_size", self.max_batch_size, minimum=UNLIMITED)
        if b == 0:
            raise ConfigError(f"max_batch_size must be -1 (unlimited) or >= 1, got {b!r}")
        check_choice("full_batch", self.full_batch, ("no_affinity", "seal_early"))
        check_choice("balance_by", self.balance_by, ("requests", "tokens"))
        for name in ("lone_wait_ms", "quiet_ms"):
            value = getattr(self, name)
            if value is not None and not 1 <= check_int(name, value) <= w:
                raise ConfigError(f"{name} must be None or in 1..window_ms ({w}), got {value!r}")

    @property
    def max_prefix_blocks(self) -> int:
        """How many leading blocks form a key."""
        if self.max_prefix_tokens_to_match == 0:
            return DEFAULT_MAX_PREFIX_BLOCKS
        return self.max_prefix_tokens_to_match // self.block_size

    @property
    def window_s(self) -> float:
        return self.window_ms / 1000.0

    @property
    def lone_wait_s(self) -> float | None:
        return None if self.lone_wait_ms is None else self.lone_wait_ms / 1000.0

    @property
    def quiet_s(self) -> float | None:
        return None if self.quiet_ms is None else self.quiet_ms / 1000.0


@final
@attrs.frozen(kw_only=True)
class Placed:
    """Send ``request_id`` to ``replica``: its prefix (``matched_blocks`` blocks of its key)
    fully matches there and nowhere else."""

    request_id: RequestId
    replica: str
    matched_blocks: int

    def match_blocks(self, replica: str) -> int:
        """Prefix-match info for a scorer: the full key on the assigned replica, 0 elsewhere."""
        return self.matched_blocks if replica == self.replica else 0


@final
@attrs.frozen(kw_only=True)
class NoAffinity:
    """No placement for ``request_id``: it shares nothing in its batch; other scorers decide."""

    request_id: RequestId


Assignment: TypeAlias = Placed | NoAffinity


# -- the assignment ---------------------------------------------------------------------------


@attrs.define(eq=False, slots=True)
class _Unit:
    """Requests placed together: an identical group, or one prefix-sharing request."""

    key: tuple[BlockHash, ...]
    members: list[RequestId]
    cost: int


def assign_batch(
    requests: Sequence[RouteRequest],
    replicas: Sequence[ReplicaLoad],
    config: BurstConfig,
    known: PrefixIndex | None = None,
) -> tuple[Assignment, ...]:
    """Place one sealed batch jointly; one `Assignment` per request, in the given order.

    Pure and deterministic: the same requests, loads and ``known`` prefixes give the same
    assignment, whatever the order of ``replicas`` (ties break on batch load, running
    requests, then name). Three steps: group the requests by key, form the units to place
    (identical groups, then lone requests sharing a prefix), and place each unit in turn.
    ``known`` (see the module docstring) says which leading blocks of a unit's key each
    replica is known to hold before this batch.
    """
    reps = check_replicas(replicas)
    groups = _groups(requests, config.max_prefix_blocks)
    units = _units(groups, config.min_colocate_blocks, config.block_size)
    placement = _Placement(reps, units, config, known)
    for unit in units:
        placement.place(unit)
    placed = placement.placed
    return tuple(placed.get(r.request_id) or NoAffinity(request_id=r.request_id) for r in requests)


def _groups(
    requests: Sequence[RouteRequest], cap: int
) -> dict[tuple[BlockHash, ...], list[RequestId]]:
    """Request ids by key (the first ``cap`` blocks), in arrival order; a request without
    blocks joins no group. A repeated request id is the caller's mistake."""
    groups: dict[tuple[BlockHash, ...], list[RequestId]] = {}
    seen: set[RequestId] = set()
    for r in requests:
        if r.request_id in seen:
            raise UsageError(f"duplicate request id {r.request_id!r} in one batch")
        seen.add(r.request_id)
        key = r.blocks[:cap]
        if key:
            groups.setdefault(key, []).append(r.request_id)
    return groups


def _units(groups: dict[tuple[BlockHash, ...], list[RequestId]], m: int, bs: int) -> list[_Unit]:
    """The units to place, in order: identical groups (two or more requests), then lone
    requests sharing at least ``m`` leading blocks with another request of the batch (none
    if ``m`` is 0); longest key first within each tier, first arrival first on ties."""
    signature_count: dict[tuple[BlockHash, ...], int] = {}
    if m > 0:
        for key, members in groups.items():
            if len(key) >= m:
                sig = key[:m]
                signature_count[sig] = signature_count.get(sig, 0) + len(members)
    identical: list[_Unit] = []
    sharing: list[_Unit] = []
    for key, members in groups.items():
        if len(members) >= 2:
            identical.append(_Unit(key, members, len(key) * bs))
        elif m > 0 and len(key) >= m and signature_count[key[:m]] >= 2:
            sharing.append(_Unit(key, members, len(key) * bs))
    identical.sort(key=lambda u: -len(u.key))  # stable
    sharing.sort(key=lambda u: -len(u.key))
    return identical + sharing


class _Placement:
    """The state of one batch's placement: each replica's load in this batch (requests, or
    uncached prefix tokens), the blocks already placed on each replica, the prefixes known
    before the batch, and the requests placed so far."""

    __slots__ = (
        "bs",
        "by_tokens",
        "fair_share",
        "holders",
        "k",
        "known",
        "load",
        "m",
        "ordered",
        "placed",
        "running",
    )

    def __init__(
        self,
        reps: Sequence[ReplicaLoad],
        units: Sequence[_Unit],
        config: BurstConfig,
        known: PrefixIndex | None,
    ) -> None:
        self.known = known
        self.k = config.max_per_replica
        self.m = config.min_colocate_blocks
        self.by_tokens = config.balance_by == "tokens"
        self.bs = config.block_size
        by_tokens = self.by_tokens
        total = sum((u.cost if by_tokens else len(u.members)) for u in units)
        self.fair_share = -(-total // len(reps))  # ceil(total / replicas)
        self.running = {r.name: r.running for r in reps}
        self.load = dict.fromkeys(self.running, 0)
        self.ordered = sorted(self.running)  # by name: the last tie-break, order-independence
        self.holders: dict[BlockHash, set[str]] = {}
        self.placed: dict[RequestId, Placed] = {}

    def matches(self, unit: _Unit) -> dict[str, int]:
        """Per replica, the longest run of the unit's key blocks already placed there (only
        needed to co-locate or to count tokens)."""
        matches: dict[str, int] = {}
        if self.m > 0 or self.by_tokens:
            holders = self.holders
            for h in unit.key:
                who = holders.get(h)
                if not who:
                    break
                for name in who:
                    matches[name] = matches.get(name, 0) + 1
        return matches

    def warm(self, unit: _Unit) -> dict[str, int]:
        """Per replica, the leading blocks of the unit's key known to be there before this
        batch (none without ``known``; replicas holding none are left out)."""
        known = self.known
        if known is None:
            return {}
        warm = {name: known.prefix_blocks(name, unit.key) for name in self.ordered}
        return {name: n for name, n in warm.items() if n > 0}

    def primary(self, per_replica: dict[str, int], matches: dict[str, int], m: int) -> str | None:
        """The replica to co-locate with: under ``k`` members of this unit and under the fair
        share, matching at least ``m`` blocks; the longest match, then the least loaded
        (batch load, running requests, name)."""
        k, load, running, fair_share = self.k, self.load, self.running, self.fair_share
        best: tuple[int, int, int, str] | None = None  # (-match, load, running, name)
        for name in self.ordered:
            if k != UNLIMITED and per_replica.get(name, 0) >= k:
                continue
            if load[name] >= fair_share:
                continue
            mt = matches.get(name, 0)
            if mt < m:
                continue
            key = (-mt, load[name], running[name], name)
            if best is None or key < best:
                best = key
        return None if best is None else best[3]

    def least_loaded(self, per_replica: dict[str, int]) -> str:
        """The least loaded replica (batch load, running requests, name) under ``k`` members
        of this unit; if every replica holds ``k`` of them, the least loaded overall."""
        k, load, running = self.k, self.load, self.running
        best: tuple[int, int, str] | None = None
        for name in self.ordered:
            if k != UNLIMITED and per_replica.get(name, 0) >= k:
                continue
            key = (load[name], running[name], name)
            if best is None or key < best:
                best = key
        if best is None:  # overflow guard: every replica holds k members of this unit
            best = min((load[name], running[name], name) for name in self.ordered)
        return best[2]

    def place(self, unit: _Unit) -> None:
        """Place the unit's members, at most ``k`` per replica: the first run on the primary
        replica if there is one, every other run on the least loaded replica.

        The primary matches at least ``m`` leading blocks, placed in this batch or known
        before it; with ``m == 0``, the whole key known before it."""
        k, bs, load = self.k, self.bs, self.load
        matches = self.matches(unit)
        warm = self.warm(unit)
        if warm:  # what a replica holds: placed in this batch or known before it
            matches = {n: max(matches.get(n, 0), warm.get(n, 0)) for n in matches.keys() | warm}
        per_replica: dict[str, int] = {}
        members = unit.members
        i = 0
        while i < len(members):
            target = None
            if i == 0 and self.m > 0:
                target = self.primary(per_replica, matches, self.m)
            elif i == 0 and warm:
                target = self.primary(per_replica, warm, len(unit.key))
            if target is None:
                target = self.least_loaded(per_replica)
            run = len(members) - i
            if k != UNLIMITED:
                run = min(run, max(1, k - per_replica.get(target, 0)))
            for rid in members[i : i + run]:
                self.placed[rid] = Placed(
                    request_id=rid, replica=target, matched_blocks=len(unit.key)
                )
            first_touch = per_replica.get(target, 0) == 0
            per_replica[target] = per_replica.get(target, 0) + run
            if not self.by_tokens:
                load[target] += run
            elif first_touch:  # the prefix is prefilled once per replica, minus what it holds
                load[target] += max(0, unit.cost - matches.get(target, 0) * bs)
            i += run
        holders = self.holders
        for h in unit.key:
            holders.setdefault(h, set()).update(per_replica)


# -- the window -------------------------------------------------------------------------------


@final
class BurstRouter:
    """Windowed joint placement of prompt-sharing requests across replicas (sans-I/O).

    ``replicas`` are the candidate replicas with their loads; refresh them with
    `update_replicas`. Time is ``now`` in seconds, never read from a clock, and may not go
    backwards. A rejected call raises `UsageError` and changes nothing.

    With ``lone_wait_ms`` (the adaptive window), every call first releases the requests that
    have waited that long sharing their prefix with no other waiting request (in arrival
    order, as `NoAffinity`), up to the window's deadline; `wake_at` says when the next one is
    due. With ``known`` (a `PrefixIndex` over this router's keys), a sealing batch places
    units where their prefix is known to be already (the module docstring).
    """

    __slots__ = (
        "_by_key",
        "_by_sig",
        "_config",
        "_deadline",
        "_hasher",
        "_known",
        "_lone",
        "_now",
        "_opened",
        "_pending",
        "_releases",
        "_replicas",
        "_seq",
    )

    def __init__(
        self,
        config: BurstConfig | None = None,
        replicas: Sequence[ReplicaLoad] = (),
        *,
        namespace: str | bytes = b"",
        known: PrefixIndex | None = None,
    ) -> None:
        self._config = BurstConfig() if config is None else config
        check_instance("config", self._config, BurstConfig)
        if known is not None and not isinstance(known, PrefixIndex):
            raise ConfigError(f"known must be a PrefixIndex (prefix_blocks), got {known!r}")
        self._known = known
        try:
            self._replicas = check_replicas(replicas)
        except UsageError as exc:
            raise ConfigError(str(exc)) from None
        self._hasher = BlockHasher(
            block_size=self._config.block_size, namespace=namespace, include_partial=True
        )
        self._pending: dict[RequestId, RouteRequest] = {}
        self._deadline: float | None = None
        self._opened: float | None = None  # when the open window opened
        self._now = float("-inf")
        # the adaptive window's bookkeeping (empty unless lone_wait_ms is set): each waiting
        # request's (release time, arrival number); the waiting ids per key and per leading
        # min_colocate_blocks; a heap of (release time, arrival number, id), checked lazily
        self._releases: dict[RequestId, tuple[float, int]] = {}
        self._by_key: dict[tuple[BlockHash, ...], dict[RequestId, None]] = {}
        self._by_sig: dict[tuple[BlockHash, ...], dict[RequestId, None]] = {}
        self._lone: list[tuple[float, int, RequestId]] = []
        self._seq = 0

    # -- views --------------------------------------------------------------------------------
    @property
    def config(self) -> BurstConfig:
        return self._config

    @property
    def replicas(self) -> tuple[ReplicaLoad, ...]:
        return self._replicas

    @property
    def deadline(self) -> float | None:
        """When the open window seals (as things stand: with ``quiet_ms`` an arrival moves it
        later, up to ``window_ms`` after the window opened); ``None`` when no window is open."""
        return self._deadline

    @property
    def wake_at(self) -> float | None:
        """When a `tick` next has something to do: the deadline, or earlier the release of a
        lone request (adaptive window); ``None`` when nothing waits."""
        if self._deadline is None:
            return None
        top = self._next_lone()
        return self._deadline if top is None else min(self._deadline, top[0])

    @property
    def pending(self) -> tuple[RequestId, ...]:
        """Ids waiting in the open window, in arrival order."""
        return tuple(self._pending)

    @property
    def now(self) -> float:
        """The latest time seen (``-inf`` before any call)."""
        return self._now

    def hash_prompt(self, token_ids: Sequence[int]) -> tuple[BlockHash, ...]:
        """The prompt's chained block hashes as this router keys them (partial block included)."""
        return self._hasher.hash_tokens(token_ids)

    def request(self, request_id: RequestId, token_ids: Sequence[int]) -> RouteRequest:
        """A `RouteRequest` for a prompt given as token ids."""
        return RouteRequest(
            request_id=request_id, blocks=self.hash_prompt(token_ids), num_tokens=len(token_ids)
        )

    # -- events -------------------------------------------------------------------------------
    def update_replicas(self, replicas: Sequence[ReplicaLoad]) -> None:
        """Replace the candidate replicas and their loads (used when a batch seals)."""
        self._replicas = check_replicas(replicas)

    def arrive(self, request: RouteRequest, now: float) -> tuple[Assignment, ...]:
        """Add a request to the window (opening one if none is open).

        Lone requests due by ``now`` are released first (adaptive window). An arrival at or
        past the deadline then seals the open batch (returned) and opens a new window. When
        the batch already holds ``max_batch_size`` requests, the arrival is answered
        `NoAffinity` at once and not added (``full_batch="no_affinity"``, as llm-d); with
        ``full_batch="seal_early"`` the arrival that fills the batch seals it, itself
        included. An id may arrive again only once it no longer waits (sealed, released).
        With ``quiet_ms``, a request that joins moves the deadline to ``quiet_ms`` after it,
        never past ``window_ms`` after the window opened.
        """
        t = check_time("now", now, after=self._now)
        check_instance("request", request, RouteRequest, error=UsageError)
        rid = request.request_id
        late = self._deadline is not None and t >= self._deadline
        if rid in self._pending and not late and not self._due(rid, t):
            raise UsageError(f"request {rid!r} is already waiting in the window")
        out = self._release_due(t)
        if late:
            out += self._seal()
        self._now = t
        limit = self._config.max_batch_size
        if limit != UNLIMITED and len(self._pending) >= limit:  # only with "no_affinity"
            return (*out, NoAffinity(request_id=rid))  # batch full: the fallback decides
        if self._opened is None:
            self._opened = t
        quiet = self._config.quiet_s
        self._deadline = (
            self._opened + self._config.window_s
            if quiet is None
            else min(self._opened + self._config.window_s, t + quiet)
        )
        self._pending[rid] = request
        wait = self._config.lone_wait_s
        if wait is not None:
            self._index(rid, request, t + wait)
        if (
            limit != UNLIMITED
            and len(self._pending) >= limit
            and self._config.full_batch == "seal_early"
        ):
            out += self._seal()
        return out

    def tick(self, now: float) -> tuple[Assignment, ...]:
        """Time passed: release the lone requests due (adaptive window), then seal the open
        batch if ``now`` is at or past its deadline."""
        t = check_time("now", now, after=self._now)
        out = self._release_due(t)
        if self._deadline is not None and t >= self._deadline:
            out += self._seal()
        self._now = t
        return out

    def cancel(self, request_id: RequestId) -> None:
        """Drop a waiting request from the open batch; the window closes if it empties.

        (llm-d keeps a cancelled request's entry in its batch, where it still counts toward
        ``max_batch_size`` and the joint placement; here it is gone at once.) A request that
        shared its prefix only with the cancelled one turns lone; if its wait is over, the next
        `tick` or `arrive` releases it.
        """
        if request_id not in self._pending:
            raise UsageError(f"request {request_id!r} is not waiting in the window")
        self._drop(request_id)

    def check_invariants(self) -> None:
        assert (self._deadline is None) == (not self._pending), "window open iff requests wait"
        assert (self._opened is None) == (self._deadline is None)
        if self._deadline is not None and self._opened is not None:
            assert self._deadline <= self._now + self._config.window_s
            assert self._deadline <= self._opened + self._config.window_s
        limit = self._config.max_batch_size
        if limit != UNLIMITED:
            if self._config.full_batch == "seal_early":
                assert len(self._pending) < limit, "a full batch was not sealed"
            else:
                assert len(self._pending) <= limit, "a batch took more than max_batch_size"
        if self._config.lone_wait_ms is None:
            assert not self._releases and not self._lone, "no adaptive window, no bookkeeping"
            return
        assert self._releases.keys() == self._pending.keys(), "every waiting request indexed"
        assert sum(map(len, self._by_key.values())) == len(self._pending)
        queued = set(self._lone)
        for rid, (release, seq) in self._releases.items():
            if self._is_lone(rid):
                assert (release, seq, rid) in queued, f"lone {rid!r} is not queued for release"

    # -- internals ----------------------------------------------------------------------------
    def _seal(self) -> tuple[Assignment, ...]:
        out = assign_batch(tuple(self._pending.values()), self._replicas, self._config, self._known)
        self._pending = {}  # only once the assignment exists: a failure loses nothing
        self._deadline = self._opened = None
        self._releases.clear()
        self._by_key.clear()
        self._by_sig.clear()
        self._lone.clear()
        return out

    def _key(self, request: RouteRequest) -> tuple[BlockHash, ...]:
        return request.blocks[: self._config.max_prefix_blocks]

    def _sig(self, key: tuple[BlockHash, ...]) -> tuple[BlockHash, ...] | None:
        """The leading ``min_colocate_blocks`` of a key that is long enough, else ``None``."""
        m = self._config.min_colocate_blocks
        return key[:m] if m > 0 and len(key) >= m else None

    def _index(self, rid: RequestId, request: RouteRequest, release: float) -> None:
        self._seq += 1
        self._releases[rid] = (release, self._seq)
        key = self._key(request)
        self._by_key.setdefault(key, {})[rid] = None
        sig = self._sig(key)
        if sig is not None:
            self._by_sig.setdefault(sig, {})[rid] = None
        heapq.heappush(self._lone, (release, self._seq, rid))

    def _is_lone(self, rid: RequestId) -> bool:
        """Nothing else waiting shares this request's prefix (the seal would not place it)."""
        key = self._key(self._pending[rid])
        if not key:
            return True
        if len(self._by_key[key]) >= 2:
            return False
        sig = self._sig(key)
        return sig is None or len(self._by_sig[sig]) < 2

    def _due(self, rid: RequestId, t: float) -> bool:
        """Would a call at ``t`` release ``rid``?"""
        entry = self._releases.get(rid)
        if entry is None or self._deadline is None:
            return False
        return entry[0] <= min(t, self._deadline) and self._is_lone(rid)

    def _next_lone(self) -> tuple[float, int, RequestId] | None:
        """The lone request released next (stale heap entries are dropped on the way)."""
        heap = self._lone
        while heap:
            _, seq, rid = heap[0]
            entry = self._releases.get(rid)
            if entry is not None and entry[1] == seq and self._is_lone(rid):
                return heap[0]
            heapq.heappop(heap)  # gone, or shares now (pushed again if it turns lone)
        return None

    def _release_due(self, t: float) -> tuple[Assignment, ...]:
        if self._deadline is None or not self._lone:
            return ()
        until = min(t, self._deadline)
        out: list[Assignment] = []
        while (top := self._next_lone()) is not None and top[0] <= until:
            self._drop(top[2])
            out.append(NoAffinity(request_id=top[2]))
        return tuple(out)

    def _drop(self, rid: RequestId) -> None:
        """Remove a waiting request; a request it shared with may turn lone."""
        request = self._pending.pop(rid)
        if not self._pending:
            self._deadline = self._opened = None
        if self._releases.pop(rid, None) is None:
            return
        key = self._key(request)
        left: list[RequestId] = []
        for groups, g in ((self._by_key, key), (self._by_sig, self._sig(key))):
            if g is None:
                continue
            members = groups[g]
            del members[rid]
            if not members:
                del groups[g]
            elif len(members) == 1:  # the one left may share with nobody now
                left.extend(members)
        for other in left:
            if self._is_lone(other):
                release, seq = self._releases[other]
                heapq.heappush(self._lone, (release, seq, other))
